"""The load generator's engine: keep-alive connections, a client-side backlog, two loops.

``Engine`` owns the connections (``Conn``, an asyncio.Protocol with at most one request
in flight, responses parsed by Content-Length, error bodies decoded only for non-200s)
and records every request's fate in a ``report.Tally``. Open loop (``offer``): each
arrival is submitted at its scheduled time whatever happened to the earlier ones; a
request due while every connection is busy waits in the backlog, more connections are
opened up to ``max_connections``, and latency counts from the scheduled time, so the
wait is not hidden (coordinated omission). Closed loop: each connection sends its next
request as soon as the previous one is answered. ``settle`` waits for what is in flight.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from vega.lab import report as rep
from vega.lab.client import Kind, Target, error_code, header_seconds, header_value

# What a 202 hands on: the request, its scheduled time, the body, Location and Retry-After.
OnAccepted = Callable[[Kind, float, bytes, bytes | None, float], None]


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
        self.location: bytes | None = None  # ... and its Location, for a 202

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
                self.retry_after_s = header_seconds(head, b"\r\nretry-after:")
                self.location = (header_value(bytes(buf[:end]), b"\r\nlocation:")
                                 if self.status == 202 else None)
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
    on_accepted: OnAccepted | None = None  # a 202: the request became a job
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
        if status == 202 and self.on_accepted is not None:
            self.on_accepted(kind, t_sched, body, conn.location, conn.retry_after_s)
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


async def settle(engine: Engine, drain_s: float, stop: asyncio.Event | None = None) -> None:
    """Wait until every sent request is answered, at most ``drain_s``, or until ``stop``
    is set (Ctrl-C: what is still unanswered is recorded as it stands)."""
    engine.stopping = engine.stopping or engine.closed
    if engine.done < engine.sent or engine.backlog:
        waits = [asyncio.ensure_future(engine.idle_event.wait())]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, timeout=drain_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
    engine.close()


def run_loop(coro: Any) -> dict[str, Any]:
    """Run ``coro`` to its report on a fresh uvloop loop (asyncio's where uvloop is absent)."""
    try:
        import uvloop
        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        result: dict[str, Any] = runner.run(coro)
    return result
