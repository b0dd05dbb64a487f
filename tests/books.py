"""Keeping the books: every request sent is answered once, with a status from DESIGN.md.

``Books`` tallies answers by id; ``offer`` sends a planned load open-loop (each request at
its own time, never waiting for earlier answers) and records each outcome. With a
TEST_LEDGER model (tests/models.py) the books also check that no item ran twice and
that every 200 was really run. ``scripts/soak`` reuses this module.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import orjson

from vega.errors import STATUS_BY_CODE

# A refused connection means the request was never accepted (the process was gone):
# not an answer, and not a loss either. Any other transport failure after sending is a loss.
NOT_ACCEPTED = "not_accepted"
LOST = "lost"


@dataclass(frozen=True)
class Planned:
    at_s: float  # send time, from the start of the run
    id: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Books:
    sent: int = 0
    outcomes: dict[int, str] = field(default_factory=dict)  # id -> "200" or "429 shed"...
    doubled: list[int] = field(default_factory=list)
    outside_table: list[tuple[int, str]] = field(default_factory=list)

    def record(self, request_id: int, outcome: str) -> None:
        if request_id in self.outcomes:
            self.doubled.append(request_id)
        self.outcomes[request_id] = outcome
        status, _, code = outcome.partition(" ")
        if status.isdigit() and not _in_table(int(status), code):
            self.outside_table.append((request_id, outcome))

    def tally(self) -> Counter[str]:
        return Counter(self.outcomes.values())

    def ok_ids(self) -> set[int]:
        return {i for i, outcome in self.outcomes.items() if outcome == "200"}

    def unanswered(self) -> int:
        return self.sent - len(self.outcomes)

    def reruns(self, ran: Iterable[int]) -> list[int]:
        """Items of this run that the model ran more than once."""
        runs = Counter(i for i in ran if i in self.outcomes)  # not warm-up's examples
        return [i for i, n in runs.items() if n > 1]

    def problems(self, ran: Iterable[int] | None = None,
                 reruns_allowed: bool = False) -> list[str]:
        """Everything that breaks the promise; empty when the books balance.

        ``reruns_allowed``: a batch stolen by a peer that then died, or whose reply could
        not come back while Redis was away, is run again to answer it (at least once,
        answered exactly once); with such faults, re-runs are counted, not failed.
        """
        found = []
        tally = self.tally()
        if self.unanswered():
            found.append(f"{self.unanswered()} request(s) never answered")
        if tally[LOST]:
            found.append(f"{tally[LOST]} request(s) lost after sending")
        if self.doubled:
            found.append(f"answered twice: {self.doubled[:10]}")
        if self.outside_table:
            found.append(f"status outside DESIGN.md's table: {self.outside_table[:10]}")
        if ran is not None:
            ran = list(ran)
            twice = self.reruns(ran)
            if twice and not reruns_allowed:
                found.append(f"{len(twice)} item(s) ran more than once: {twice[:10]}")
            # "Not accepted" is the client's view; the ledger says whether Vega ran it.
            dropped = {i for i, o in self.outcomes.items() if o == NOT_ACCEPTED} & set(ran)
            if dropped:
                found.append(f"{len(dropped)} request(s) ran but were never answered")
            never = self.ok_ids() - set(ran)
            if never:
                found.append(f"{len(never)} 200(s) for items the model never ran")
        return found

    def summary(self) -> str:
        tally = self.tally()
        parts = [f"sent {self.sent}"] + [f"{k}: {v}" for k, v in sorted(tally.items())]
        return ", ".join(parts) + f", unanswered {self.unanswered()}, doubled {len(self.doubled)}"


def _in_table(status: int, code: str) -> bool:
    if status == 200:
        return code == ""
    return STATUS_BY_CODE.get(code) == status


async def offer(url: str, plan: Sequence[Planned], books: Books, *, path: str = "/v1/infer",
                timeout_s: float = 30.0, connections: int = 256) -> Books:
    """Send ``plan`` open-loop over keep-alive connections; record every outcome in ``books``.

    A plain HTTP/1.1 client on asyncio streams: an open loop at 10x a server's
    capacity needs more requests per second than a general-purpose client manages here.
    Requests due while every connection is busy wait their turn, in order.
    """
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    due: asyncio.Queue[Planned | None] = asyncio.Queue()
    start = time.monotonic()

    async def schedule() -> None:
        for request in sorted(plan, key=lambda r: r.at_s):
            delay = start + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            due.put_nowait(request)
        for _ in range(connections):
            due.put_nowait(None)

    async def worker() -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while (request := await due.get()) is not None:
            books.sent += 1
            outcome, conn = await _exchange(conn, host, int(port or 80), path, request,
                                            timeout_s)
            books.record(request.id, outcome)
        if conn is not None:
            conn[1].close()

    await asyncio.gather(schedule(), *(worker() for _ in range(connections)))
    return books


async def _exchange(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, host: str,
                    port: int, path: str, request: Planned, timeout_s: float
                    ) -> tuple[str, tuple[asyncio.StreamReader, asyncio.StreamWriter] | None]:
    """One request on ``conn`` (opened if needed): its outcome and the connection to reuse."""
    if conn is None:
        try:
            conn = await asyncio.open_connection(host, port)
        except OSError:
            return NOT_ACCEPTED, None
        fresh = True
    else:
        fresh = False
    reader, writer = conn
    extra = "".join(f"{k}: {v}\r\n" for k, v in request.headers.items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(request.body)}\r\n{extra}\r\n".encode() + request.body)
    try:
        status, close, body = await asyncio.wait_for(_response(reader), timeout_s)
    except (asyncio.IncompleteReadError, ConnectionResetError) as error:
        writer.close()
        # A reset carries no bytes of answer; neither does an EOF with nothing read.
        if not getattr(error, "partial", b""):
            if not fresh:
                # The server had closed this idle keep-alive connection before our request
                # reached it: as every HTTP client does, retry once on a new connection.
                return await _exchange(None, host, port, path, request, timeout_s)
            # A new connection closed (or reset) without a byte of answer: the kernel had
            # queued it, or our request, on a socket the exiting process closed unread.
            return NOT_ACCEPTED, None
        return LOST, None
    except (OSError, TimeoutError, ValueError):
        writer.close()
        return LOST, None
    if close:
        writer.close()
        conn = None
    if status == 200:
        return "200", conn
    try:
        code = orjson.loads(body)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        code = "?"
    return f"{status} {code}", conn


async def _response(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(":") for line in head[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers.get("connection", "").lower() == "close", body


def steady(rate: float, seconds: float, body_for: Callable[[int, str], bytes],
           first_id: int = 1, priorities: Sequence[str] = ("normal",)) -> list[Planned]:
    """Evenly spaced arrivals at ``rate``/s; ``body_for(id, priority)`` makes each body."""
    count = int(rate * seconds)
    return [Planned(at_s=i / rate, id=first_id + i,
                    body=body_for(first_id + i, priorities[i % len(priorities)]))
            for i in range(count)]
