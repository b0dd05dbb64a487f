"""``vega bench --callers N --client polite|naive``: N closed-loop callers on ``vega.client``.

Each caller makes one call, waits for its outcome, and makes the next, until
--duration-s is over; every call has the --deadline-ms of its class. A *polite* caller
is ``AsyncClient.infer``: it waits as each 429/503 asks (with jitter) and gives up
when the wait would outlast its deadline. A *naive* caller uses the same client with
one attempt per call and resends at once on a 429 or 503 until it gets a 200 or its
deadline passes; the deadline sent with each attempt is what is left, as the polite
one sends, so waiting is the only difference.

Reported: 200s per second (answered while the callers were sending), p50/p99 of the
200s' latency (from the call's first attempt, waits and retries included), refusals
by code (one per refused attempt), attempts per 200, and how the calls ended.
Each caller has its own client and connection, as independent callers would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from vega.lab import report as rep
from vega.lab import traffic
from vega.lab.engine import run_loop
from vega.lab.traffic import PRIORITIES, TrafficError, parse_deadlines
from vega.outpath import unwritable

if TYPE_CHECKING:
    from vega.client import AsyncClient

CLIENTS = ("polite", "naive")
SETTLE_S = 5.0  # past the longest deadline, how long the run waits for calls to end
EXIT_USAGE = 2


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--callers", type=int, default=None, metavar="N",
                        help="instead of the raw load generator: N closed-loop callers on "
                             "vega.client (uses --duration-s, --deadline-ms, --mix, --lengths)")
    parser.add_argument("--client", choices=CLIENTS, default="polite",
                        help="with --callers: polite (waits as told) or naive (resends at once)")


@dataclass
class Tally:
    start: float
    stop_at: float
    latencies_s: list[float] = field(default_factory=list)
    ok_in_window: int = 0
    attempts: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    ended: Counter[str] = field(default_factory=Counter)

    def observe(self, status: int, code: str) -> None:
        """Every attempt's answer (the client's observer)."""
        self.attempts += 1
        if status in (0, 429, 503):
            self.refusals[code or str(status)] += 1

    def answered(self, started: float, now: float) -> None:
        self.latencies_s.append(now - started)
        self.ended["ok"] += 1
        self.ok_in_window += now <= self.stop_at

    def report(self, meta: dict[str, Any]) -> dict[str, Any]:
        window_s = self.stop_at - self.start
        lat = np.array(self.latencies_s) * 1000
        ok = len(self.latencies_s)
        return {"meta": meta, "summary": {
            "ok_per_s": round(self.ok_in_window / max(window_s, 1e-9), 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 1) if ok else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 1) if ok else None,
            "attempts": self.attempts, "attempts_per_ok": round(self.attempts / ok, 2) if ok
            else None, "refusals": dict(self.refusals.most_common()),
            "calls": dict(self.ended.most_common())}}


async def caller(client: AsyncClient, polite: bool, kinds: list[tuple[Any, str, float]],
                 offset: int, tally: Tally) -> None:
    """One caller: call after call until the run's end."""
    from vega.client import RefusedError, UnavailableError, VegaClientError

    clock = time.monotonic
    i = offset
    while clock() < tally.stop_at:
        inputs, priority, deadline_s = kinds[i % len(kinds)]
        i += 1
        started = clock()
        try:
            if polite:
                await client.infer(inputs, priority=priority, deadline_s=deadline_s)
            else:
                while True:
                    left = started + deadline_s - clock()
                    if left <= 0:
                        raise VegaClientError("deadline", code="deadline_exceeded")
                    try:
                        await client.infer(inputs, priority=priority, deadline_s=left)
                        break
                    except (RefusedError, UnavailableError):
                        continue  # at once: what a client that ignores Retry-After does
        except VegaClientError as error:
            tally.ended[error.code or type(error).__name__] += 1
        else:
            tally.answered(started, clock())


async def drive(options: dict[str, Any], callers: int, polite: bool) -> dict[str, Any]:
    from vega.client import AsyncClient

    rng = np.random.default_rng(options["seed"])
    deadlines = parse_deadlines(str(options["deadline_ms"]))
    mix = traffic.parse_mix(options["mix"])
    lengths = traffic.parse_lengths(options["lengths"])
    pri, lens = traffic.draw(4096, mix, lengths, rng)
    kinds = [(rng.random((int(n), 8), dtype=np.float32).round(3), PRIORITIES[p],
              deadlines[PRIORITIES[p]]) for p, n in zip(pri.tolist(), lens.tolist())]
    duration_s = float(options["duration_s"])
    tally = Tally(0.0, 0.0)
    clients = [AsyncClient(options["url"], uds=options["uds"], token=options["token"],
                           max_connections=1,
                           max_attempts=8 if polite else 1, observer=tally.observe)
               for _ in range(callers)]
    start = tally.start = time.monotonic()
    tally.stop_at = start + duration_s
    tasks = [asyncio.ensure_future(caller(c, polite, kinds, n * 7, tally))
             for n, c in enumerate(clients)]
    interrupted = asyncio.Event()

    def interrupt() -> None:
        """Ctrl-C: no new calls; the report covers the calls made until now."""
        tally.stop_at = min(tally.stop_at, time.monotonic())
        interrupted.set()

    loop = asyncio.get_running_loop()
    with contextlib.suppress(RuntimeError, NotImplementedError, ValueError):
        loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        _, late = await asyncio.wait(
            tasks, timeout=duration_s + max(deadlines.values()) + SETTLE_S)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    for task in late:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - start
    await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
    meta = {"url": options["url"], "callers": callers, "client": "polite" if polite else "naive",
            "duration_s": duration_s, "elapsed_s": round(elapsed, 2),
            "interrupted": interrupted.is_set(), "calling_s": round(tally.stop_at - start, 3),
            "deadline_ms": options["deadline_ms"], "mix": options["mix"],
            "lengths": options["lengths"], "unfinished": len(late),
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    return tally.report(meta)


def format_summary(report: dict[str, Any]) -> str:
    s, m = report["summary"], report["meta"]
    stopped = f" (Ctrl-C after {m['calling_s']:g} s)" if m["interrupted"] else ""
    return (f"{m['callers']} {m['client']} callers, {m['duration_s']:g} s{stopped}: "
            f"{s['ok_per_s']} 200s/s, p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms, "
            f"{s['attempts_per_ok']} attempts per 200\n"
            f"  refused attempts: {s['refusals'] or 'none'}\n  calls: {s['calls']}")


def run(args: argparse.Namespace) -> int:
    """``vega bench --callers N``: one run; prints the summary and writes report.json."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("vega bench --callers: needs httpx (pip install vega[client])", file=sys.stderr)
        return EXIT_USAGE
    try:
        options = traffic.resolve(vars(args))
        if args.callers < 1:
            raise TrafficError(f"callers must be >= 1, not {args.callers}")
        # host:port as the raw load generator takes it (httpx would refuse each call)
        url = options["url"] if "://" in options["url"] else "http://" + options["url"]
        if urlsplit(url).scheme not in ("http", "https"):
            raise TrafficError(f"url {options['url']!r}: only http:// and https:// are supported")
        options["url"] = url
    except (TrafficError, ValueError) as exc:
        print(f"vega bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(options["out"] or "out/callers-" + datetime.datetime.now().strftime(
        "%Y%m%d-%H%M%S"))
    problem = unwritable(out, directory=True)
    if problem is not None:
        print(f"vega bench: --out: {problem}", file=sys.stderr)
        return EXIT_USAGE
    report = run_loop(drive(options, args.callers, args.client == "polite"))
    path = rep.write_json(report, out / "report.json")
    print(format_summary(report))
    print(f"wrote {path}")
    return 0 if report["summary"]["calls"].get("ok") else 1
