"""``vega bench`` / ``scripts/bench``: an open- and closed-loop load generator for /v1/infer.

Open loop: requests go out at the times the traffic profile says (``vega.lab.traffic``),
never waiting for answers; latency is counted from each request's *scheduled* send
time, so a slow server cannot hide its latency by slowing the generator down
(coordinated omission). A request due while every connection is busy waits in a
client-side backlog (and more connections are opened, up to --max-connections);
its wait counts in its latency and the backlog is reported. Closed loop: N
connections, each sending its next request as soon as the previous one is answered.

The client is a minimal HTTP/1.1 one on an asyncio.Protocol (uvloop when
installed): keep-alive connections, request bytes encoded once per (length,
class), responses parsed by Content-Length, error bodies decoded only for
non-200s. During the run it polls GET /v1/status for queue depth and reads
/metrics before and after for the batch histograms; at the end it writes
report.json and PNG plots (``vega.lab.report``) and prints a summary.

``configure(parser)`` adds the options, ``run(args)`` runs one bench (exit 0; 1 when
nothing was answered; 2 for bad options). ``python -m vega.lab.loadgen --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import itertools
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import orjson

from vega.lab import report as rep
from vega.lab import traffic
from vega.lab.traffic import (
    OPTIONS,
    PRIORITIES,
    TrafficError,
    parse_bool,
    parse_deadlines,
    resolve,
)

EXIT_NO_ANSWER = 1
EXIT_USAGE = 2


# --- command line -------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench options to ``parser`` (defaults are applied by ``run``)."""
    for o in OPTIONS:
        text = o.help + ("" if o.default is None else f" (default {o.default})")
        if o.name == "url":
            parser.add_argument("url", nargs="?", default=None, help=text)
        elif o.type is parse_bool:
            parser.add_argument("--" + o.name.replace("_", "-"), dest=o.name, default=None,
                                action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument("--" + o.name.replace("_", "-"), dest=o.name, default=None,
                                type=o.type, choices=o.choices, help=text)
    from vega.lab import callers  # --callers N: closed-loop callers on vega.client
    callers.configure(parser)


# --- target and request bytes ------------------------------------------------------

@dataclass(frozen=True)
class Target:
    host: str
    port: int
    uds: str | None
    path: str

    @classmethod
    def parse(cls, url: str, path: str, uds: str | None) -> Target:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http":
            raise TrafficError(f"url {url!r}: only http:// is supported")
        return cls(parts.hostname or "127.0.0.1", parts.port or 80, uds,
                   parts.path if parts.path not in ("", "/") else path)

    async def connect(self, factory: Callable[[], asyncio.Protocol]) -> asyncio.Protocol:
        loop = asyncio.get_running_loop()
        if self.uds:
            _, proto = await loop.create_unix_connection(factory, self.uds)
        else:
            _, proto = await loop.create_connection(factory, self.host, self.port)
        return proto

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if method == "POST":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body


@dataclass(frozen=True)
class Kind:
    """One pre-encoded request: a (length, class) combination."""

    data: bytes
    priority: str
    deadline_s: float


def encode_kinds(target: Target, pairs: set[tuple[int, int]], deadlines: dict[str, float],
                 rng: np.random.Generator) -> dict[tuple[int, int], Kind]:
    kinds = {}
    for length, p in sorted(pairs):
        name = PRIORITIES[p]
        rows = np.round(rng.random((length, 8)), 3).tolist()
        body = orjson.dumps({"inputs": rows, "priority": name,
                             "deadline_ms": round(1000 * deadlines[name], 3)})
        kinds[(length, p)] = Kind(target.request("POST", target.path, body), name,
                                  deadlines[name])
    return kinds


# --- one connection ----------------------------------------------------------------

class Conn(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection with at most one request in flight."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.kind: Kind | None = None  # the request in flight
        self.t_sched = 0.0
        self.sent_at = 0.0
        self.need = -1  # bytes of the whole response once its head is parsed
        self.head_end = 0
        self.status = 0
        self.close_after = False
        self.retry_after_s = 0.0  # the Retry-After header of the answer being read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.engine.connected(self)

    def send(self, kind: Kind, t_sched: float) -> None:
        assert self.transport is not None
        self.kind, self.t_sched, self.sent_at = kind, t_sched, time.perf_counter()
        self.transport.write(kind.data)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while self.kind is not None:
            if self.need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).lower()
                self.status = int(buf[9:12])
                at = head.find(b"\r\ncontent-length:")
                if at < 0:
                    self.fail("connection")  # chunked or close-delimited: not spoken here
                    return
                eol = head.find(b"\r\n", at + 2)
                self.need = end + 4 + int(head[at + 17:eol if eol > 0 else len(head)])
                self.head_end = end + 4
                self.close_after = b"\r\nconnection: close" in head
                self.retry_after_s = _header_seconds(head, b"\r\nretry-after:")
            if len(buf) < self.need:
                return
            body = bytes(buf[self.head_end:self.need]) if self.status != 200 else b""
            del buf[:self.need]
            self.need = -1
            kind, self.kind = self.kind, None
            self.engine.answered(self, kind, self.t_sched, self.status, body)
            if self.close_after and self.transport is not None:
                self.transport.close()

    def fail(self, reason: str) -> None:
        """Give up on the request in flight and on this connection."""
        kind, self.kind = self.kind, None
        if kind is not None:
            self.engine.record(kind, self.t_sched, 0, reason, None)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.kind is not None:
            kind, self.kind = self.kind, None
            self.engine.record(kind, self.t_sched, 0, "connection", None)
        self.engine.lost(self)


# --- the engine: connections, backlog, open and closed loops -----------------------

@dataclass
class ClientStats:
    connections_opened: int = 0
    connect_errors: int = 0
    max_connections_used: int = 0
    queued: int = 0  # requests that waited client-side for a connection
    queued_at_cap: int = 0  # ... of them, arrived while max_connections were all busy
    max_backlog: int = 0
    late_sends: int = 0  # sent more than 10 ms after their scheduled time
    max_send_lag_ms: float = 0.0


@dataclass
class Engine:
    target: Target
    tally: rep.Tally
    max_connections: int
    timeout_s: float
    closed: bool = False
    start: float = 0.0
    stopping: bool = False
    stats: ClientStats = field(default_factory=ClientStats)
    conns: set[Conn] = field(default_factory=set)
    idle: list[Conn] = field(default_factory=list)
    opening: int = 0
    backlog: collections.deque[tuple[Kind, float]] = field(default_factory=collections.deque)
    next_kind: Callable[[], Kind] | None = None  # closed loop: what to send next
    sent: int = 0
    done: int = 0
    limit: int | None = None
    honor_retry_after: bool = False  # closed loop: wait out a 429/503 before the next send
    idle_event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def inflight(self) -> int:
        return sum(1 for c in self.conns if c.kind is not None)

    def record(self, kind: Kind, t_sched: float, status: int, reason: str,
               latency_s: float | None) -> None:
        self.done += 1
        self.tally.add(rep.Record(t_sched, latency_s, status, reason, kind.priority,
                                  kind.deadline_s))
        if self.done >= self.sent and not self.backlog:
            self.idle_event.set()

    def answered(self, conn: Conn, kind: Kind, t_sched: float, status: int, body: bytes) -> None:
        now = time.perf_counter() - self.start
        reason = error_code(body) if status != 200 else ""
        self.record(kind, t_sched, status, reason, now - t_sched)
        if conn.close_after:
            return
        wait_s = conn.retry_after_s if self.honor_retry_after and status in (429, 503) else 0.0
        if wait_s > 0 and self.closed:
            asyncio.get_running_loop().call_later(wait_s, self.ready, conn)
        else:
            self.ready(conn)

    def ready(self, conn: Conn) -> None:
        """``conn`` can take a request: the backlog's oldest, the closed loop's next, or none."""
        if self.backlog:
            kind, t_sched = self.backlog.popleft()
            self.transmit(conn, kind, t_sched)
        elif self.closed and not self.stopping and self.next_kind is not None and (
                self.limit is None or self.sent < self.limit):
            self.transmit(conn, self.next_kind(), time.perf_counter() - self.start)
        else:
            self.idle.append(conn)

    def transmit(self, conn: Conn, kind: Kind, t_sched: float) -> None:
        self.sent += 1
        self.idle_event.clear()
        lag = time.perf_counter() - self.start - t_sched
        if lag > 0.010:
            self.stats.late_sends += 1
            self.stats.max_send_lag_ms = max(self.stats.max_send_lag_ms, 1000 * lag)
        conn.send(kind, t_sched)

    def submit(self, kind: Kind, t_sched: float) -> None:
        """Open loop: send now on an idle connection, or queue and open one if allowed."""
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                self.transmit(conn, kind, t_sched)
                return
        self.backlog.append((kind, t_sched))
        self.idle_event.clear()
        self.stats.queued += 1
        self.stats.max_backlog = max(self.stats.max_backlog, len(self.backlog))
        if len(self.conns) + self.opening < self.max_connections:
            if self.opening < len(self.backlog):
                self.open()
        else:
            self.stats.queued_at_cap += 1

    def open(self) -> None:
        self.opening += 1
        task = asyncio.ensure_future(self.target.connect(lambda: Conn(self)))
        task.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Future[asyncio.Protocol]) -> None:
        if not (task.cancelled() or task.exception() is not None):
            return  # connection_made has called connected()
        self.opening -= 1
        self.stats.connect_errors += 1
        if self.backlog and not self.conns and not self.opening:
            kind, t_sched = self.backlog.popleft()  # nothing else will take it
            self.sent += 1
            self.record(kind, t_sched, 0, "connection", None)
            if self.backlog:
                self.open()

    def connected(self, conn: Conn) -> None:
        self.opening -= 1
        self.conns.add(conn)
        self.stats.connections_opened += 1
        self.stats.max_connections_used = max(self.stats.max_connections_used, len(self.conns))
        self.ready(conn)

    def lost(self, conn: Conn) -> None:
        self.conns.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        if not self.stopping and (self.backlog or self.closed):
            self.open()

    def expire(self) -> None:
        """Fail requests in flight for longer than timeout_s (called from the ticker)."""
        now = time.perf_counter()
        for conn in list(self.conns):
            if conn.kind is not None and now - conn.sent_at > self.timeout_s:
                conn.fail("timeout")

    def close(self) -> None:
        """Record what is left (queued: unsent; in flight: timeout) and close everything."""
        self.stopping = True
        while self.backlog:
            kind, t_sched = self.backlog.popleft()
            self.record(kind, t_sched, 0, "unsent", None)
        for conn in list(self.conns):
            conn.fail("timeout")


def error_code(body: bytes) -> str:
    """``error.code`` of an error body, or "" when it has none."""
    try:
        doc = orjson.loads(body)
        code = doc["error"]["code"] if isinstance(doc, dict) else None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    return code if isinstance(code, str) else ""


def _header_seconds(head: bytes, name: bytes) -> float:
    """A header's value as seconds (``Retry-After: 2``), or 0 when absent or not a number."""
    at = head.find(name)
    if at < 0:
        return 0.0
    end = head.find(b"\r\n", at + 2)
    try:
        return float(head[at + len(name):end if end > 0 else len(head)].strip())
    except ValueError:
        return 0.0


async def offer(engine: Engine, times: list[float], kinds: list[Kind]) -> None:
    """Open loop: submit each arrival at its time, whatever happened to the earlier ones."""
    n, i = len(times), 0
    while i < n and not engine.stopping:
        now = time.perf_counter() - engine.start
        if times[i] > now:
            await asyncio.sleep(times[i] - now)
            continue
        due = i
        while i < n and times[i] <= now and i - due < 512:
            engine.submit(kinds[i], times[i])
            i += 1
        await asyncio.sleep(0)  # let answers in between bunches of sends


async def settle(engine: Engine, drain_s: float) -> None:
    """Wait until every sent request is answered, at most ``drain_s``."""
    engine.stopping = engine.stopping or engine.closed
    if engine.done < engine.sent or engine.backlog:
        try:
            await asyncio.wait_for(engine.idle_event.wait(), drain_s)
        except TimeoutError:
            pass
    engine.close()


# --- side channels: /v1/status and /metrics ----------------------------------------

async def http_get(target: Target, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """One GET on a connection of its own (not the hot path)."""
    async def go() -> tuple[int, bytes]:
        if target.uds:
            reader, writer = await asyncio.open_unix_connection(target.uds)
        else:
            reader, writer = await asyncio.open_connection(target.host, target.port)
        try:
            writer.write(target.request("GET", path)[:-2] + b"Connection: close\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else await reader.read()
            return int(head[9:12]), body
        finally:
            writer.close()
    return await asyncio.wait_for(go(), timeout_s)


def depth_snapshot(t: float, status: dict[str, Any]) -> dict[str, Any]:
    depth = dict.fromkeys(PRIORITIES, 0)
    inflight = 0
    for model in status.get("models", {}).values():
        for p, n in model.get("depth", {}).items():
            depth[p] = depth.get(p, 0) + int(n)
        inflight += int(model.get("inflight_batches", 0))
    return {"t": t, "depth": depth, "inflight_batches": inflight}


async def poll_status(engine: Engine, every_s: float, out: list[dict[str, Any]]) -> None:
    """Queue depth per class from /v1/status until the run stops; stops on a 404."""
    # Checks ``stopping`` as well as being cancelled: Python 3.11's wait_for (in
    # http_get) can swallow a cancel that lands as its call completes, and this loop
    # then polled on for ever while the run waited for it (seen once in bench_core).
    while not engine.stopping:
        t = time.perf_counter() - engine.start
        try:
            status, body = await http_get(engine.target, "/v1/status", max(1.0, every_s))
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
            status, body = 0, b""
        if status == 200:
            out.append(depth_snapshot(t, orjson.loads(body)))
        elif status == 404:
            return
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - engine.start - t)))


async def read_metrics(target: Target) -> str | None:
    try:
        status, body = await http_get(target, "/metrics")
    except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
        return None
    return body.decode(errors="replace") if status == 200 else None


def batch_distributions(before: str | None, after: str | None
                        ) -> dict[str, rep.Distribution] | None:
    out = {}
    for key, name in (("size", "vega_batch_size"), ("padding", "vega_batch_padding_ratio")):
        delta = rep.distribution_delta(
            rep.prometheus_histogram(before, name) if before else None,
            rep.prometheus_histogram(after, name) if after else None)
        if delta is not None:
            out[key] = delta
    return out or None


# --- progress ----------------------------------------------------------------------

async def ticker(engine: Engine, total_s: float, show: bool) -> None:
    """Every 0.25 s: expire timed-out requests; redraw the progress bar when shown."""
    while True:
        await asyncio.sleep(0.25)
        engine.expire()
        if show:
            sys.stderr.write("\r" + progress_line(engine, total_s))
            sys.stderr.flush()


def progress_line(engine: Engine, total_s: float) -> str:
    elapsed = time.perf_counter() - engine.start
    frac = min(1.0, elapsed / total_s) if total_s > 0 else 1.0
    bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
    return (f"[{bar}] {elapsed:5.1f}/{total_s:.0f}s sent {engine.sent} "
            f"answered {engine.done} inflight {engine.inflight} backlog {len(engine.backlog)} "
            f"conns {len(engine.conns)}   ")


# --- one run -----------------------------------------------------------------------

async def bench(options: dict[str, Any]) -> dict[str, Any]:
    """Run one bench from resolved options; returns the report."""
    rng = np.random.default_rng(options["seed"])
    target = Target.parse(options["url"], options["path"], options["uds"])
    deadlines = parse_deadlines(str(options["deadline_ms"]))
    closed = options["mode"] == "closed"
    if closed:
        mix = traffic.parse_mix(options["mix"])
        lengths = traffic.parse_lengths(options["lengths"])
        pri, lens = traffic.draw(65536, mix, lengths, rng)
        pairs = list(zip(lens.tolist(), pri.tolist()))
        total_s = float(options["duration_s"])
    else:
        arrivals = traffic.plan(options, rng)
        pairs = list(zip(arrivals.length.tolist(), arrivals.priority.tolist()))
        total_s = float(arrivals.t_s[-1]) if len(arrivals) else 0.0
    kinds = encode_kinds(target, set(pairs), deadlines, rng)
    sequence = [kinds[pair] for pair in pairs]
    engine = Engine(target, rep.Tally(rep.auto_bin_s(total_s + 1.0)),
                    options["max_connections"], options["timeout_s"], closed=closed,
                    limit=options["requests"] if closed else None,
                    honor_retry_after=bool(options["honor_retry_after"]))
    if closed:
        cycle = itertools.cycle(sequence)
        engine.next_kind = lambda: next(cycle)

    loop = asyncio.get_running_loop()
    with contextlib.suppress(RuntimeError, NotImplementedError, ValueError):
        loop.add_signal_handler(signal.SIGINT, lambda: setattr(engine, "stopping", True))
    before = await read_metrics(target) if options["metrics"] else None
    snapshots: list[dict[str, Any]] = []
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    engine.start = time.perf_counter()
    show = options["progress"] if options["progress"] is not None else sys.stderr.isatty()
    side = [asyncio.ensure_future(ticker(engine, total_s, show))]
    if options["poll_s"] > 0:
        side.append(asyncio.ensure_future(poll_status(engine, options["poll_s"], snapshots)))
    for _ in range(options["connections"]):
        engine.open()
    try:
        if closed:
            while (time.perf_counter() - engine.start < total_s and not engine.stopping
                   and (engine.limit is None or engine.sent < engine.limit)):
                await asyncio.sleep(0.05)
        else:
            await offer(engine, arrivals.t_s.tolist(), sequence)
        await settle(engine, options["drain_s"])
    finally:
        engine.stopping = True
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        loop.remove_signal_handler(signal.SIGINT)
        if show:
            sys.stderr.write("\r" + progress_line(engine, total_s) + "\n")
    elapsed = time.perf_counter() - engine.start
    after = await read_metrics(target) if options["metrics"] else None
    meta = {k: v for k, v in options.items()} | {
        "started_at": started_at, "elapsed_s": round(elapsed, 3), "load_s": round(total_s, 3)}
    if closed:
        for k in ("profile", "process", "rate", "ramp_to", "steps", "burst_factor",
                  "burst_at_s", "burst_s", "trace", "trace_speed", "max_connections"):
            meta.pop(k, None)
    report = rep.build_report(engine.tally, snapshots=snapshots, meta=meta,
                              batches=batch_distributions(before, after))
    report["client"] = vars(engine.stats) | {"timeout_s": options["timeout_s"]}
    return report


def run(args: argparse.Namespace) -> int:
    """Run one bench from parsed ``args``; writes report.json and plots, prints a summary."""
    if getattr(args, "callers", None) is not None:
        from vega.lab import callers
        return callers.run(args)
    try:
        options = resolve(vars(args))
        Target.parse(options["url"], options["path"], options["uds"])
    except (TrafficError, OSError, ValueError) as exc:
        print(f"vega bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(options["out"] or "out/bench-" + datetime.datetime.now().strftime(
        "%Y%m%d-%H%M%S"))
    try:
        report = _run_loop(bench(options))
    except (TrafficError, OSError) as exc:
        print(f"vega bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    files = [rep.write_json(report, out / "report.json")]
    if options["plots"]:
        files += rep.write_plots(report, out)
    print(rep.format_summary(report))
    client = report["client"]
    if client["late_sends"] > 0.01 * max(1, report["summary"]["sent"]):
        print(f"warning: the generator fell behind: {client['late_sends']} sends over 10 ms "
              f"late (worst {client['max_send_lag_ms']:.0f} ms, client backlog up to "
              f"{client['max_backlog']}); latencies include that wait", file=sys.stderr)
    print("wrote " + ", ".join(str(f) for f in files))
    summary = report["summary"]
    return EXIT_NO_ANSWER if summary["sent"] and not summary["answered"] else 0


def _run_loop(coro: Any) -> dict[str, Any]:
    try:
        import uvloop
        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        result: dict[str, Any] = runner.run(coro)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vega bench", description="Open- and closed-loop load generator for Vega "
        "(see docs/bench.md)")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
