"""Job records, their ids, what a job store offers, and the in-memory store.

A job is an accepted ``/v1/infer`` body that may wait: its instances (as JSON),
its model, its expiry, and once finished its outputs or error. The store keeps
jobs between submit and result; the runner (vega/jobs/runner.py) claims them,
runs them and finishes them. ``MemoryStore`` is the embedded default: bounded,
and lost with the process. ``RedisStore`` (vega/jobs/redis_store.py) is durable.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from vega.errors import VegaError
from vega.httpio import kept
from vega.pressure.idempotency import conflict

ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{22}")  # secrets.token_urlsafe(16)
QUEUED, RUNNING, DONE, FAILED, EXPIRED, CANCELLED = (
    "queued", "running", "done", "failed", "expired", "cancelled")
FINAL = frozenset({DONE, FAILED, EXPIRED, CANCELLED})
OUTCOMES = (DONE, FAILED, EXPIRED, CANCELLED)  # vega_jobs_total{outcome}


def new_id() -> str:
    return secrets.token_urlsafe(16)


def valid_id(text: str) -> bool:
    """Checked before any store is asked: a hostile id never reaches Redis."""
    return ID_PATTERN.fullmatch(text) is not None


def wall_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Job:
    id: str
    model: str
    instances: bytes  # the instances as JSON, until the job is finished
    single: bool
    priority: int
    created_ms: int
    expires_ms: int  # past it, a job that has not run is expired and never runs
    status: str = QUEUED
    attempts: int = 0  # runs started so far
    outputs: bytes = b""  # JSON, once done
    error: dict[str, str] | None = None
    finished_ms: int | None = None
    entry: str = ""  # the stream entry that delivered it (Redis)

    def state(self, now_ms: int) -> str:
        """The status as callers see it: a queued job past its expiry is expired."""
        if self.status == QUEUED and now_ms >= self.expires_ms:
            return EXPIRED
        return self.status

    def view(self, now_ms: int) -> dict[str, Any]:
        """The GET /v1/jobs/{id} document (outputs as a JSON fragment)."""
        import orjson

        status = self.state(now_ms)
        doc: dict[str, Any] = {"id": self.id, "model": self.model, "status": status,
                               "created_ms": self.created_ms}
        if status == DONE:
            doc["outputs"] = orjson.Fragment(self.outputs)
        if self.error is not None:
            doc["error"] = self.error
        if self.finished_ms is not None:
            doc["finished_ms"] = self.finished_ms
        elif status == EXPIRED:
            doc["finished_ms"] = self.expires_ms
        return doc


@dataclass(frozen=True)
class Stats:
    queued: int = 0  # never delivered to a runner
    pending: int = 0  # claimed by a runner, not finished
    oldest_age_s: float = 0.0
    dead_letters: int = 0


@dataclass(frozen=True)
class Submitted:
    id: str
    status: str
    created: bool  # False: an Idempotency-Key repeat of an existing job


class JobStore(Protocol):
    """What the lane needs of a store. A claimed job is the caller's until it calls
    ``finish`` or ``retry``; ``take`` waits a little (never forever) for work."""

    durable: bool

    async def submit(self, job: Job, key: str | None, print_: str,
                     max_depth: int) -> Submitted: ...

    async def get(self, model: str, job_id: str) -> Job | None: ...

    async def cancel(self, model: str, job_id: str) -> tuple[Job | None, bool]:
        """The job after the attempt, and whether this call cancelled it."""

    async def take(self, model: str, consumer: str, count: int) -> list[Job]: ...

    async def reclaim(self, model: str, consumer: str, count: int,
                      idle_ms: int) -> list[Job]: ...

    async def start(self, jobs: list[Job]) -> list[Job]: ...

    async def finish(self, job: Job, status: str, outputs: bytes = b"",
                     error: dict[str, str] | None = None, dead_letter: bool = False) -> None: ...

    async def retry(self, job: Job, ran: bool = True) -> None:
        """Queue ``job`` again; ``ran=False`` gives back the attempt its start counted (no
        model ran it: its model process was restarting)."""

    async def refresh(self, model: str, consumer: str, jobs: list[Job]) -> None: ...

    async def stats(self, model: str) -> Stats: ...

    async def close(self) -> None: ...


def queue_full(depth: int, max_depth: int) -> VegaError:
    return VegaError("queue_full", f"job backlog at its bound ({depth} of {max_depth})")


@dataclass
class _Model:
    queue: deque[str] = field(default_factory=deque)
    running: set[str] = field(default_factory=set)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    dead_letters: int = 0


class MemoryStore:
    """Jobs in this process: bounded by the max depth and the bytes of their inputs, lost
    when the process ends.

    Finished jobs are kept for ``result_ttl_s``, and at most ``max_results`` of them
    (oldest dropped first), so memory stays bounded whatever the traffic. The inputs of
    jobs not finished are bounded in bytes: a gzip body of 12 KB inflates to 4 MB.
    """

    durable = False

    def __init__(self, result_ttl_s: float, max_results: int,
                 max_bytes: int = 1 << 28) -> None:
        self.result_ttl_ms = int(1000 * result_ttl_s)
        self.max_results = max_results
        self.max_bytes = max_bytes
        self.held_bytes = 0  # the inputs of the jobs not finished
        self._jobs: dict[str, Job] = {}
        self._finished: OrderedDict[str, int] = OrderedDict()  # id -> when it goes (ms)
        self._keys: dict[tuple[str, str], tuple[str, str]] = {}  # (model, key) -> (print, id)
        self._key_of: dict[str, tuple[str, str]] = {}  # id -> (model, key)
        self._models: dict[str, _Model] = {}

    def _model(self, name: str) -> _Model:
        return self._models.setdefault(name, _Model())

    async def submit(self, job: Job, key: str | None, print_: str,
                     max_depth: int) -> Submitted:
        self._purge()
        if key is not None:
            held = self._keys.get((job.model, key))
            if held is not None and held[1] in self._jobs:
                if held[0] != print_:
                    raise conflict()
                return Submitted(held[1], self._jobs[held[1]].state(wall_ms()), False)
        model = self._model(job.model)
        depth = len(model.queue) + len(model.running)
        if depth >= max_depth:
            raise queue_full(depth, max_depth)
        if self.held_bytes + len(job.instances) > self.max_bytes:
            raise VegaError("queue_full", f"job inputs held here at their bound "
                            f"({self.held_bytes} of {self.max_bytes} bytes)")
        self.held_bytes += len(job.instances)
        self._jobs[job.id] = job
        model.queue.append(job.id)
        model.arrived.set()
        if key is not None:
            self._keys[(job.model, key)] = (print_, job.id)
            self._key_of[job.id] = (job.model, key)
        return Submitted(job.id, QUEUED, True)

    async def get(self, model: str, job_id: str) -> Job | None:
        self._purge()
        job = self._jobs.get(job_id)
        return job if job is not None and job.model == model else None

    async def cancel(self, model: str, job_id: str) -> tuple[Job | None, bool]:
        job = await self.get(model, job_id)
        if job is None or job.state(wall_ms()) != QUEUED:
            return job, False
        self._model(model).queue.remove(job_id)
        self._close(job, CANCELLED)
        return job, True

    async def take(self, model: str, consumer: str, count: int) -> list[Job]:
        state = self._model(model)
        if not state.queue:
            state.arrived.clear()
            try:
                await asyncio.wait_for(state.arrived.wait(), 0.5)
            except TimeoutError:
                return []
        taken: list[Job] = []
        while state.queue and len(taken) < count:
            job_id = state.queue.popleft()
            state.running.add(job_id)
            taken.append(self._jobs[job_id])
        return taken

    async def reclaim(self, model: str, consumer: str, count: int,
                      idle_ms: int) -> list[Job]:
        return []  # nobody else could have claimed them

    async def start(self, jobs: list[Job]) -> list[Job]:
        for job in jobs:
            job.status = RUNNING
            job.attempts += 1
        return jobs

    async def finish(self, job: Job, status: str, outputs: bytes = b"",
                     error: dict[str, str] | None = None, dead_letter: bool = False) -> None:
        state = self._model(job.model)
        state.running.discard(job.id)
        if job.status in FINAL:
            return
        job.outputs, job.error = kept(outputs), error
        if dead_letter:
            state.dead_letters += 1
        self._close(job, status)

    async def retry(self, job: Job, ran: bool = True) -> None:
        state = self._model(job.model)
        state.running.discard(job.id)
        if job.status not in FINAL:
            job.status = QUEUED
            job.attempts -= 0 if ran else 1
            state.queue.append(job.id)
            state.arrived.set()

    async def refresh(self, model: str, consumer: str, jobs: list[Job]) -> None:
        return None

    async def stats(self, model: str) -> Stats:
        state = self._model(model)
        now_ms = wall_ms()
        first = [state.queue[0]] if state.queue else []
        ages = [now_ms - self._jobs[i].created_ms for i in (*first, *state.running)]
        return Stats(queued=len(state.queue), pending=len(state.running),
                     oldest_age_s=max(ages, default=0) / 1000, dead_letters=state.dead_letters)

    async def close(self) -> None:
        return None

    def _close(self, job: Job, status: str) -> None:
        self.held_bytes -= len(job.instances)
        job.status, job.instances, job.finished_ms = status, b"", wall_ms()
        self._finished[job.id] = job.finished_ms + self.result_ttl_ms
        while len(self._finished) > self.max_results:
            self._forget(next(iter(self._finished)))

    def _purge(self) -> None:
        now_ms = wall_ms()
        while self._finished:
            job_id, until = next(iter(self._finished.items()))
            if until > now_ms:
                break
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        self._finished.pop(job_id, None)
        self._jobs.pop(job_id, None)
        slot = self._key_of.pop(job_id, None)
        if slot is not None:
            self._keys.pop(slot, None)
