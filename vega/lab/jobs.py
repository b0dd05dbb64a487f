"""The load generator's side of the async lane: follow each accepted job until it ends.

A request sent with ``Prefer: respond-async`` that the server would have refused comes
back 202 with ``{"id", "status": "queued"}``, ``Location: /v1/jobs/{id}`` and
``Retry-After``; ``JobPoller.accepted`` takes that answer and polls ``GET /v1/jobs/{id}``
over a few keep-alive connections of its own (never the measured ones), first after the
Retry-After, then after each answer's Retry-After or ``DEFAULT_WAIT_S``, until the job
is done, failed, expired or cancelled, or until its poll window (the caller's ttl plus a
grace) has passed: a job still unfinished then, or one the server no longer knows (404),
is lost. A job's finish time is read from its ``created_ms`` and ``finished_ms`` (the
server's clock, as a difference) added to when its 202 came, so polling late does not
make it later.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any

import orjson

from vega.lab.client import Kind, Target, header_seconds, header_value
from vega.lab.hdr import Histogram
from vega.lab.report import JOB_ENDS, jobs_section

POLLERS = 8  # keep-alive connections polling job status
DEFAULT_WAIT_S = 1.0  # between polls when the answer carries no Retry-After
MIN_WAIT_S = 0.05
# A job path from the network goes into a request line: only these characters may.
JOB_PATH = re.compile(r"/v1/jobs/[A-Za-z0-9._~-]{1,128}")
POLL_ERRORS = (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError,
               asyncio.LimitOverrunError)


@dataclass(eq=False)
class Job:
    path: str
    t_sched: float  # scheduled send of the request that became this job (run clock)
    accepted_s: float  # when its 202 came (run clock)
    ends_s: float  # past it, polling stops and a job not ended is lost
    state: str = "queued"
    finished_s: float | None = None


def job_path(body: bytes, location: bytes | None) -> str | None:
    """Where to poll the job a 202 announced (its Location, else its id), or None when
    the answer names no job that can be followed."""
    if location is not None:
        path = location.decode("ascii", "replace")
        if JOB_PATH.fullmatch(path):
            return path
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    job_id = doc.get("id") if isinstance(doc, dict) else None
    path = f"/v1/jobs/{job_id}" if isinstance(job_id, str) else ""
    return path if JOB_PATH.fullmatch(path) else None


class JobPoller:
    def __init__(self, target: Target, start: float, share: float, ttl_s: float,
                 grace_s: float, timeout_s: float, connections: int = POLLERS) -> None:
        self.target = target
        self.start = start  # perf_counter at the run's start
        self.share = share
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.connections = connections
        self.jobs: list[Job] = []
        self.unreadable = 0  # 202s naming no job to follow: lost
        self.not_found = 0
        self.polls = 0
        self.poll_errors = 0
        self.latency = Histogram()
        self._open = 0
        self._settled = asyncio.Event()
        self._settled.set()
        self._due: asyncio.Queue[Job] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False

    def now(self) -> float:
        return time.perf_counter() - self.start

    @property
    def open(self) -> int:
        """Jobs still being polled."""
        return self._open

    def accepted(self, kind: Kind, t_sched: float, body: bytes, location: bytes | None,
                 retry_after_s: float) -> None:
        """A 202 (the engine's ``on_accepted``): follow the job it names."""
        path = job_path(body, location)
        if path is None:
            self.unreadable += 1
            return
        now = self.now()
        job = Job(path, t_sched, now, now + self.ttl_s + self.grace_s)
        self.jobs.append(job)
        self._open += 1
        self._settled.clear()
        if not self._workers:
            self._workers = [asyncio.ensure_future(self._worker())
                             for _ in range(self.connections)]
        self._later(job, retry_after_s)

    async def wait(self, stop: asyncio.Event) -> None:
        """Until every job ended or left its window, or ``stop`` is set; then close."""
        stopped = asyncio.ensure_future(stop.wait())
        settled = asyncio.ensure_future(self._settled.wait())
        try:
            await asyncio.wait((stopped, settled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            settled.cancel()
            await self.close()

    async def close(self) -> None:
        self._closed = True
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)

    def summary(self, load_s: float) -> dict[str, Any]:
        """The report's ``jobs`` section; ``load_s``: when the load ended (run clock)."""
        ended = {state: 0 for state in JOB_ENDS}
        for job in self.jobs:
            if job.state in ended:
                ended[job.state] += 1
        ran = [job.finished_s for job in self.jobs
               if job.state in ("done", "failed") and job.finished_s is not None]
        return jobs_section(self.share, len(self.jobs) + self.unreadable, ended,
                            max(ran, default=None), load_s, self.latency,
                            not_found=self.not_found, unreadable=self.unreadable,
                            polls=self.polls, poll_errors=self.poll_errors)

    # -- polling -------------------------------------------------------------------

    def _later(self, job: Job, wait_s: float) -> None:
        if self._closed:
            return
        now = self.now()
        at = min(now + max(MIN_WAIT_S, wait_s if wait_s > 0 else DEFAULT_WAIT_S), job.ends_s)
        asyncio.get_running_loop().call_later(max(0.0, at - now), self._due.put_nowait, job)

    async def _worker(self) -> None:
        conn = KeepAlive(self.target)
        try:
            while True:
                job = await self._due.get()
                await self._poll(conn, job)
        finally:
            conn.close()

    async def _poll(self, conn: KeepAlive, job: Job) -> None:
        self.polls += 1
        try:
            status, head, body = await asyncio.wait_for(conn.get(job.path), self.timeout_s)
        except POLL_ERRORS:
            conn.close()
            status, head, body = 0, b"", b""
        now = self.now()
        if status == 200:
            doc = _view(body)
            if doc.get("status") in JOB_ENDS:
                self._end(job, str(doc["status"]), doc, now)
                return
        elif status == 404:
            self.not_found += 1  # gone: lost
            self._stop(job)
            return
        else:
            self.poll_errors += 1
        if now >= job.ends_s:
            self._stop(job)
        else:
            self._later(job, header_seconds(head.lower(), b"\r\nretry-after:"))

    def _end(self, job: Job, state: str, doc: dict[str, Any], now: float) -> None:
        job.state = state
        created, finished = doc.get("created_ms"), doc.get("finished_ms")
        if isinstance(created, (int, float)) and isinstance(finished, (int, float)):
            job.finished_s = min(now, job.accepted_s + max(0.0, finished - created) / 1000)
        else:
            job.finished_s = now
        if state == "done":
            self.latency.record(job.finished_s - job.t_sched)
        self._stop(job)

    def _stop(self, job: Job) -> None:
        self._open -= 1
        if self._open == 0:
            self._settled.set()


def _view(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}


class KeepAlive:
    """One keep-alive HTTP/1.1 connection for GETs, reopened when the server closes it."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str) -> tuple[int, bytes, bytes]:
        """Status, raw head and body of one GET."""
        if self.writer is None or self.writer.is_closing():
            if self.target.uds:
                self.reader, self.writer = await asyncio.open_unix_connection(self.target.uds)
            else:
                self.reader, self.writer = await asyncio.open_connection(self.target.host,
                                                                         self.target.port)
        assert self.reader is not None
        self.writer.write(self.target.request("GET", path))
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = header_value(head, b"\r\ncontent-length:")
        if length is None:
            raise ValueError("an answer without Content-Length")
        body = await self.reader.readexactly(int(length))
        if b"\r\nconnection: close" in head.lower():
            self.close()
        return int(head[9:12]), head, body

    def close(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(RuntimeError):
                self.writer.close()
            self.writer = self.reader = None
