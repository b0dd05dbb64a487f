"""How requests reach the simulated processes: an open loop's arrivals at their times,
or a closed loop's callers, each sending again once answered; either way to the
process Nginx ``least_conn`` would pick."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vega.errors import STATUS_BY_CODE
from vega.lab.simproc import Requests, SimProcess


@dataclass
class Closed:
    """Closed-loop callers, as ``vega bench --mode closed`` drives them: each sends its
    next request ``round_trip_s`` after its last answer (HTTP and the caller's own time,
    not simulated otherwise), or once the Retry-After of a 429/503 has passed."""

    connections: int
    duration_s: float
    priority: Sequence[int]  # the classes and lengths sent, in turn (drawn as vega bench draws)
    length: Sequence[int]
    honor_retry_after: bool = False
    round_trip_s: float = 0.001
    limit: int = 0  # stop after this many requests (0: none), as --requests does


class LeastConn:
    """Nginx ``least_conn``: the process with the fewest open requests, ties in turn."""

    def __init__(self, procs: list[SimProcess]) -> None:
        self.procs = procs
        self.turn = 0

    def __call__(self) -> SimProcess:
        procs = self.procs
        if len(procs) == 1:
            return procs[0]
        least = min(p.open for p in procs)
        for step in range(len(procs)):
            proc = procs[(self.turn + step) % len(procs)]
            if proc.open == least:
                self.turn = (proc.index + 1) % len(procs)
                return proc
        raise AssertionError("unreachable")


async def drive(loop: asyncio.AbstractEventLoop, procs: list[SimProcess], requests: Requests,
                priority: Sequence[int], length: Sequence[int], deadlines: list[float],
                waits: Sequence[bool]) -> None:
    """Hand each arrival to a process at its time (least_conn), then wait for every answer."""
    t_s = requests.t_s
    n = len(t_s)
    requests.quiet = loop.create_future()
    position = 0
    pick = LeastConn(procs)

    def arrivals() -> None:
        nonlocal position
        now = loop.time()
        while position < n and t_s[position] <= now:
            p = priority[position]
            pick().arrive(position, p, length[position], deadlines[p], waits[position])
            position += 1
        if position < n:
            loop.call_at(t_s[position], arrivals)
        else:
            requests.all_sent = True
            requests.check_quiet()

    if n == 0:
        return
    loop.call_at(t_s[0], arrivals)
    await requests.quiet


async def drive_closed(loop: asyncio.AbstractEventLoop, closed: Closed,
                       procs: list[SimProcess], requests: Requests, priority: list[int],
                       length: list[int], deadlines: list[float]) -> None:
    """``closed.connections`` callers, each sending again once answered, until the run's
    time is up; then wait for every answer."""
    pick = LeastConn(procs)
    end = loop.time() + closed.duration_s
    drawn = itertools.cycle(zip(closed.priority, closed.length))
    requests.quiet = loop.create_future()

    def send() -> None:
        if loop.time() >= end:
            return
        if closed.limit and len(priority) >= closed.limit:
            time_up()
            return
        p, n = next(drawn)
        priority.append(p)
        length.append(n)
        pick().arrive(requests.add(loop.time()), p, n, deadlines[p])

    def finished(_index: int, outcome: str, retry_after_s: float) -> None:
        status = STATUS_BY_CODE.get(outcome, 200)
        wait = retry_after_s if closed.honor_retry_after and status in (429, 503) else 0.0
        loop.call_later(closed.round_trip_s + wait, send)

    def time_up() -> None:
        requests.all_sent = True
        requests.check_quiet()

    requests.on_finish = finished
    for _ in range(closed.connections):
        loop.call_soon(send)
    loop.call_at(end, time_up)
    await requests.quiet
