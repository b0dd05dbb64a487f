"""The async lane in the simulator: the real job lane, store and runner on each process.

A request that can wait and that admission refuses with ``shed``, ``queue_full`` or
``deadline_unmeetable`` becomes a job as ``JobsApi.turn`` makes one on a real server: a
``Job`` that expires after VEGA_JOBS_DEFAULT_TTL_S, submitted to the process's real
``JobLane``, whose in-memory store holds at most VEGA_JOBS_MAX_DEPTH jobs (queued or
held by a runner); accepted, it is answered 202, else the request keeps its refusal.
Each process runs the real ``JobRunner`` on its batcher: it claims jobs only while no
inline item is queued and holds at most two full batches of job items, and the batcher
runs those in its job class (batched only while no inline item waits, each batch only
on a free thread, never formed ahead). The stand-ins: the runner reads the virtual clock
as its wall clock, and a job's one instance is its length, which a stand-in adapter
decodes. Processes that overflow share one store (with Redis any process runs any job);
else each keeps its own. Polling takes no model time and is not modelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vega.config import Settings
from vega.errors import VegaError
from vega.jobs.lane import JobLane
from vega.jobs.runner import JobRunner
from vega.jobs.store import DONE, FAILED, FINAL, OUTCOMES, Job, MemoryStore
from vega.lab.hdr import Histogram
from vega.metrics import Metrics
from vega.models.base import TensorSpec

if TYPE_CHECKING:
    from vega.lab.simproc import Requests, SimProcess


class _Lengths:
    """The model as the runner sees it: a job's one instance is its length."""

    version = "sim"
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    deterministic = True

    def __init__(self, name: str, max_length: int) -> None:
        self.name = name
        self.max_length = max_length

    def load(self, device: str) -> None:
        return None

    def decode(self, instance: Any) -> tuple[Any, int]:
        return None, int(instance)

    def run(self, samples: list[Any], pad_to: int) -> list[Any]:
        return [None] * len(samples)  # never called: the simulated executor runs batches

    def example(self, length: int) -> Any:
        return None


class _Store(MemoryStore):
    """The embedded store, telling the simulation when each job ends."""

    def __init__(self, jobs: SimJobs, settings: Settings) -> None:
        super().__init__(settings.jobs_result_ttl_s, settings.jobs_max_depth)
        self.jobs = jobs

    async def finish(self, job: Job, status: str, outputs: bytes = b"",
                     error: dict[str, str] | None = None, dead_letter: bool = False) -> None:
        ends = job.status not in FINAL
        await super().finish(job, status, outputs, error, dead_letter)
        if ends:
            self.jobs.ended(job, status)


class SimJobs:
    """The job lanes of one simulation: a lane and a runner per process, and the tally."""

    def __init__(self, procs: Sequence[SimProcess], requests: Requests, settings: Settings,
                 shared: bool) -> None:
        self.requests = requests
        self.ttl_ms = int(1000 * settings.jobs_default_ttl_s)
        self.max_depth = settings.jobs_max_depth
        self.loop = loop = asyncio.get_running_loop()
        self.accepted = 0
        self.ends = dict.fromkeys(OUTCOMES, 0)
        self.done_by: list[float] = []  # when each done job finished (virtual clock)
        self.last_finished_s: float | None = None
        self.latency = Histogram()  # done jobs, from arrival to finish
        metrics = Metrics()
        one = _Store(self, settings) if shared else None
        self.lanes: list[JobLane] = []
        self._tasks: set[asyncio.Task[None]] = set()
        for proc in procs:
            lane = JobLane(settings, f"sim-{proc.index}", metrics)
            lane.store = one or _Store(self, settings)
            model = proc.batcher.config.model
            runner = JobRunner(lane, _Lengths(model, proc.latency.max_length), proc.batcher,
                               clock=lambda: round(1000 * loop.time()))
            lane.runners[model] = runner
            lane.taking.set()
            self._spawn(runner.run()).add_done_callback(self._runner_ended)
            proc.jobs = self
            self.lanes.append(lane)  # by process index
        self.stores = 1 if shared else len(self.lanes)

    @property
    def waiting(self) -> int:
        """Jobs accepted and not ended: queued in a store or held by a runner."""
        return self.accepted - sum(self.ends.values())

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def submit(self, process: int, index: int, priority: int, length: int, refusal: str,
               now: float) -> None:
        """Turn the refused arrival ``index`` into a job, as the server's route does."""
        self.requests.opened(job=True)  # before the store answers, so the run cannot end first
        self._spawn(self._submit(self.lanes[process], index, priority, length, refusal, now))

    async def _submit(self, lane: JobLane, index: int, priority: int, length: int,
                      refusal: str, now: float) -> None:
        now_ms = round(1000 * now)
        model = next(iter(lane.runners))
        job = Job(id=str(index), model=model, instances=b"[%d]" % length, single=True,
                  priority=priority, created_ms=now_ms, expires_ms=now_ms + self.ttl_ms)
        try:
            await lane.submit(job, None, "")
        except VegaError:  # the lane is at its bound: the request keeps its refusal
            self.requests.finish(index, refusal, now)
            self.requests.closed(job=True)
            return
        self.accepted += 1
        self.requests.finish(index, "accepted", now)

    def ended(self, job: Job, status: str) -> None:
        now = self.loop.time()
        self.ends[status] += 1
        if status == DONE:
            self.latency.record(now - self.requests.t_s[int(job.id)])
            self.done_by.append(now)
        if status in (DONE, FAILED):
            self.last_finished_s = now
        self.requests.closed(job=True)

    def _runner_ended(self, task: asyncio.Task[None]) -> None:
        # A runner that died would leave its jobs unended and the run waiting forever.
        quiet = self.requests.quiet
        if not task.cancelled() and task.exception() is not None and quiet is not None \
                and not quiet.done():
            quiet.set_exception(RuntimeError(f"job runner died: {task.exception()!r}"))

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
