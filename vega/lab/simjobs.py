"""The async lane in the simulator: work that can wait, run only on spare capacity.

A request that can wait and that admission refuses with ``shed``, ``queue_full`` or
``deadline_unmeetable`` becomes a job, as ``Prefer: respond-async`` turns it on a real
server (answered 202), unless ``max_depth`` jobs already wait (then 429 ``queue_full``).
The batcher has no job class yet, so the lane is modelled here, by the rule of the real
one: a job batch (one length bucket, oldest jobs first, up to VEGA_MAX_BATCH_SIZE) goes
to an executor thread only when that thread is free and the process's batcher has no
inline item queued, never formed ahead, and a job whose ttl passed before it ran is
expired, not run. The batcher does not see the threads job batches hold, so an inline
batch it forms meanwhile waits out the rest of one job batch in the executor's queue,
as it would behind a running batch. Jobs are one lane for every process when they
overflow (with Redis any process runs any job), else each process keeps its own.
Polling is not modelled: it takes no model time, and no job is lost in a simulation.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vega.lab.hdr import Histogram

if TYPE_CHECKING:
    from vega.lab.simproc import Requests, SimProcess

TURNED = frozenset({"shed", "queue_full", "deadline_unmeetable"})  # refusals a job takes over


@dataclass(eq=False)
class SimJob:
    index: int  # the arrival it was
    length: int
    queued_at: float
    expires_at: float


class JobLane:
    def __init__(self, procs: Sequence[SimProcess], requests: Requests, max_depth: int,
                 ttl_s: float) -> None:
        self.procs = list(procs)
        self.requests = requests
        self.max_depth = max_depth
        self.ttl_s = ttl_s
        self.loop = asyncio.get_running_loop()
        self.queues: dict[int, deque[SimJob]] = {}  # by length bucket
        self.depth = 0
        self.accepted = 0
        self.done = 0
        self.expired = 0
        self.batches = 0
        self.last_finished_s: float | None = None
        self.latency = Histogram()  # done jobs, from arrival to finish

    def submit(self, index: int, length: int, bucket: int, now: float) -> bool:
        """Queue the job the refused arrival ``index`` becomes; False when the lane is full."""
        if self.depth >= self.max_depth:
            return False
        self.queues.setdefault(bucket, deque()).append(
            SimJob(index, length, now, now + self.ttl_s))
        self.depth += 1
        self.accepted += 1
        self.requests.opened(job=True)
        self.feed()
        return True

    def feed(self) -> None:
        """Give job batches to every free thread of a process with no inline item queued."""
        if not self.depth:
            return
        now = self.loop.time()
        for proc in self.procs:
            while self.depth and proc.batcher.depth() == 0 and min(proc.free_at) <= now:
                self._run(proc, now)

    def _run(self, proc: SimProcess, now: float) -> None:
        bucket = min((b for b, q in self.queues.items() if q),
                     key=lambda b: self.queues[b][0].queued_at)
        queue = self.queues[bucket]
        jobs: list[SimJob] = []
        while queue and len(jobs) < proc.batcher.config.max_batch_size:
            job = queue.popleft()
            self.depth -= 1
            if job.expires_at <= now:
                self.expired += 1
                self.requests.closed(job=True)
            else:
                jobs.append(job)
        if not jobs:
            return
        pad_to = max(job.length for job in jobs)
        finish = proc.book(now, proc.draw(pad_to, len(jobs)))
        proc.ran_batch(len(jobs), 1.0 - sum(job.length for job in jobs) / (pad_to * len(jobs)))
        self.batches += 1
        self.loop.call_at(finish, self._finished, jobs)

    def _finished(self, jobs: list[SimJob]) -> None:
        now = self.loop.time()
        t_s = self.requests.t_s
        for job in jobs:
            self.latency.record(now - t_s[job.index])
            self.done += 1
            self.requests.closed(job=True)
        self.last_finished_s = now
        self.feed()
