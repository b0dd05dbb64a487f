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

import httpx
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

    def problems(self, ran: Iterable[int] | None = None) -> list[str]:
        """Everything that breaks the promise; empty when the books balance."""
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
            runs = Counter(ran)
            twice = [i for i, n in runs.items() if n > 1]
            if twice:
                found.append(f"{len(twice)} item(s) ran more than once: {twice[:10]}")
            never = self.ok_ids() - set(runs)
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
                timeout_s: float = 30.0, connections: int = 512) -> Books:
    """Send ``plan`` open-loop and record every outcome in ``books``."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.monotonic()

        async def one(request: Planned) -> None:
            delay = start + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            books.sent += 1
            books.record(request.id, await _send(client, path, request))

        await asyncio.gather(*(one(request) for request in plan))
    return books


async def _send(client: httpx.AsyncClient, path: str, request: Planned) -> str:
    try:
        response = await client.post(path, content=request.body, headers=request.headers)
    except httpx.ConnectError:
        return NOT_ACCEPTED
    except httpx.HTTPError:
        return LOST
    if response.status_code == 200:
        return "200"
    try:
        code = orjson.loads(response.content)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        code = "?"
    return f"{response.status_code} {code}"


def steady(rate: float, seconds: float, body_for: Callable[[int, str], bytes],
           first_id: int = 1, priorities: Sequence[str] = ("normal",)) -> list[Planned]:
    """Evenly spaced arrivals at ``rate``/s; ``body_for(id, priority)`` makes each body."""
    count = int(rate * seconds)
    return [Planned(at_s=i / rate, id=first_id + i,
                    body=body_for(first_id + i, priorities[i % len(priorities)]))
            for i in range(count)]
