"""Running jobs on spare capacity: one runner per model, feeding its batcher.

A runner takes jobs from the store only while no inline item is queued, and holds at
most two full batches of job items in this process, so a crash loses nothing the
store does not still hold (with Redis, the entries stay pending and a peer reclaims
them). Job items run in the batcher's job class: batched only while no inline item
waits, never beside inline items, each batch only on a free thread. A finished job's
result goes to the store in one step with its acknowledgement; a model error puts
the job back until ``VEGA_MAX_ATTEMPTS``, then it is failed and dead-lettered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from redis import exceptions as rexc

from vega.batcher import Batcher
from vega.channel.client import said
from vega.errors import VegaError
from vega.httpio import outputs_json
from vega.jobs.store import DONE, EXPIRED, FAILED, FINAL, Job, wall_ms
from vega.models import ModelAdapter, decode_all
from vega.quarantine import Refused
from vega.records import JOB, Item

if TYPE_CHECKING:
    from vega.jobs.lane import JobLane

log = logging.getLogger("vega.jobs")

# RedisClusterException: what the cluster client raises when no seed node answers.
STORE_ERRORS = (rexc.RedisError, rexc.RedisClusterException, OSError)
PAUSE_S = 0.5  # after a store error, before trying again
OUTAGE_LOG_S = 60.0  # through a store outage, how often it is logged again
# A job item's deadline is its ttl: passed while queued, or its batch would end past it.
MISSED = frozenset({"deadline_exceeded", "deadline_unmeetable"})
TIMEOUT_GRACE_S = 1.0  # a store timing out for less is not logged (see run)


class JobRunner:
    def __init__(self, lane: JobLane, adapter: ModelAdapter, batcher: Batcher,
                 runnable: Callable[[], bool] = lambda: True,
                 clock: Callable[[], int] = wall_ms) -> None:
        self.lane = lane
        self.runnable = runnable  # whether a model can run a batch now (none is restarting)
        self.clock = clock  # wall ms, as jobs' expiries are kept (the simulator's is virtual)
        self.model = adapter.name
        self.adapter = adapter
        self.batcher = batcher
        self.hold_items = 2 * batcher.config.max_batch_size
        self.held: dict[str, Job] = {}
        self.held_items = 0
        self.items_per_job = 1.0  # measured: what a job in the backlog costs in items
        self._room = asyncio.Event()
        self._room.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reclaim_at = 0.0
        self._failing_since: float | None = None  # loop time the store began failing
        self._failed_reclaiming = False  # the last failing pass reclaimed (else took only)
        self._logged_at = 0.0
        self._told = False  # this outage was logged
        self._claims_logged_at = -OUTAGE_LOG_S

    async def run(self) -> None:
        """Claim jobs whenever this process has room for them, until cancelled."""
        loop = asyncio.get_running_loop()
        store, consumer = self.lane.store, self.lane.node
        while True:
            await self.lane.taking.wait()
            await self.batcher.wait_no_inline()
            while not self.runnable():  # a job claimed now would fail unrun; a peer may run it
                await asyncio.sleep(PAUSE_S)
            while self.held_items >= self.hold_items:
                self._room.clear()
                await self._room.wait()
            if not self.lane.taking.is_set():  # told to stop while it waited: claim nothing
                continue
            count = max(1, (self.hold_items - self.held_items) // max(1, round(self.items_per_job)))
            reclaimed = False  # this pass reclaims too: every kind of store call
            try:
                if loop.time() >= self._reclaim_at:
                    reclaimed = True
                    self._reclaim_at = loop.time() + self.lane.claim_idle_ms / 2000
                    jobs = await store.reclaim(self.model, consumer, count,
                                               self.lane.claim_idle_ms)
                    jobs = [job for job in jobs if job.id not in self.held]
                    if jobs:
                        self.lane.metrics.jobs_reclaimed.labels(self.model).inc(len(jobs))
                else:
                    jobs = []
                if not jobs:
                    jobs = await store.take(self.model, consumer, count)
                await self._start(jobs)
                if self._failing_since is not None and (
                        reclaimed or not self._failed_reclaiming):  # what failed, passed
                    if self._told:
                        log.info("job store for %s answers again, after %.1f s", self.model,
                                 loop.time() - self._failing_since)
                    self._failing_since, self._told = None, False
            except STORE_ERRORS as error:
                # Logged once an outage begins and once a minute through it.
                self._failed_reclaiming = reclaimed
                now = loop.time()
                self._failing_since = self._failing_since or now
                # A timeout in the first second is as often this process busy (its loop late
                # to read the answer, while it starts say) as the store away: told if it lasts.
                lasted = not isinstance(error, rexc.TimeoutError) or \
                    now - self._failing_since >= TIMEOUT_GRACE_S
                if lasted and (not self._told or now - self._logged_at >= OUTAGE_LOG_S):
                    self._told, self._logged_at = True, now
                    log.warning("job store for %s: %s; trying again every %.1f s",
                                self.model, said(error), PAUSE_S)
                await asyncio.sleep(PAUSE_S)

    async def keep_claims(self) -> None:
        """Refresh the claims on held jobs so that no peer reclaims work running here."""
        while True:
            await asyncio.sleep(self.lane.claim_idle_ms / 3000)
            if self.held:
                try:
                    await self.lane.store.refresh(self.model, self.lane.node,
                                                  list(self.held.values()))
                except STORE_ERRORS as error:  # told once a minute, as the store's outage
                    now = asyncio.get_running_loop().time()
                    if now - self._claims_logged_at >= OUTAGE_LOG_S:
                        self._claims_logged_at = now
                        log.warning("job claims for %s not refreshed: %s", self.model,
                                    said(error))

    async def _start(self, jobs: list[Job]) -> None:
        store = self.lane.store
        now_ms = self.clock()
        fresh = []
        for job in jobs:
            if job.status in FINAL:
                await store.finish(job, job.status)  # its result is stored: acknowledge only
            elif job.expires_ms <= now_ms:
                await self._end(job, EXPIRED)
            elif job.attempts >= self.lane.max_attempts:
                await self._end(job, FAILED, error={
                    "code": "model_error",
                    "message": f"no result after {job.attempts} attempt(s); dead-lettered"},
                    dead_letter=True)
            else:
                fresh.append(job)
        for job in await store.start(fresh):
            self._enqueue(job)

    def _enqueue(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        try:
            instances = orjson.loads(job.instances)
            if not isinstance(instances, list) or not instances:
                raise VegaError("invalid_input", "a job holds no instances")
        except (VegaError, orjson.JSONDecodeError) as error:
            message = error.message if isinstance(error, VegaError) else "inputs are not JSON"
            self._spawn(self._end(job, FAILED, error={"code": "invalid_input",
                                                      "message": message}))
            return
        try:
            most = self.lane.settings.max_instances
            if len(instances) > most:  # a record no submit here wrote: not all queued at once
                raise VegaError("invalid_input", f"more than {most} instances")
            decoded = decode_all(self.adapter, instances)
        except VegaError as error:
            if job.attempts < self.lane.max_attempts:
                # Its inputs passed the check at submit: this process's model takes other
                # windows than the submitter's (vega_min_length, say), or fewer instances,
                # and another may run it.
                self.lane.metrics.jobs_retried.labels(self.model).inc()
                self._spawn(self.lane.store.retry(job))
            else:
                log.warning("job %s of %s: inputs refused at each attempt: %s", job.id,
                            self.model, error.code)
                self._spawn(self._end(job, FAILED, error={"code": "invalid_input",
                                                          "message": error.message}))
            return
        deadline = loop.time() + (job.expires_ms - self.clock()) / 1000
        items = []
        for sample, length in decoded:
            bucket = self.batcher.bucket_of(length)
            items.append(Item(sample=sample, length=length, priority=JOB,
                              deadline=deadline, future=loop.create_future(), bucket=bucket,
                              cost=self.batcher.item_cost(bucket)))
        self.held[job.id] = job
        self.held_items += len(items)
        self.items_per_job += 0.05 * (len(items) - self.items_per_job)
        for item in items:
            self.batcher.enqueue(item)
        self._spawn(self._await(job, items))

    async def _await(self, job: Job, items: list[Item]) -> None:
        try:
            await asyncio.wait([item.future for item in items])
            errors = [item.future.exception() for item in items if item.future.cancelled()
                      or item.future.exception() is not None]
            if not errors:
                outputs = [item.future.result() for item in items]
                try:
                    body = outputs_json(outputs[0] if job.single else outputs)
                except VegaError as error:  # the same inputs would answer the same: no retry
                    await self._end(job, FAILED, error={"code": error.code,
                                                        "message": error.message})
                else:
                    await self._end(job, DONE, outputs=body)
            elif any(isinstance(e, VegaError) and e.code in MISSED for e in errors):
                await self._end(job, EXPIRED)  # its ttl passed (or would) while queued here
            elif refused := next((e for e in errors if isinstance(e, Refused)), None):
                await self._end(job, FAILED, error={"code": refused.code,
                                                    "message": refused.message})
            elif all(isinstance(e, VegaError) and e.code in ("not_ready", "draining")
                     for e in errors):
                await self.lane.store.retry(job, ran=False)  # refused unrun: not an attempt
            elif job.attempts < self.lane.max_attempts:
                self.lane.metrics.jobs_retried.labels(self.model).inc()
                await self.lane.store.retry(job)
            else:
                first = errors[0]
                message = first.message if isinstance(first, VegaError) else "model failed"
                await self._end(job, FAILED, error={
                    "code": "model_error",
                    "message": f"{message} (attempt {job.attempts} of "
                               f"{self.lane.max_attempts}); dead-lettered"}, dead_letter=True)
        except STORE_ERRORS as error:
            # Left pending in the store: reclaimed after VEGA_CLAIM_IDLE_MS (run again).
            log.warning("job %s: result not stored: %s", job.id, said(error))
        except Exception:  # a bug: the job ends failed once, not held 'running' for good
            log.exception("job %s: failed outside the model", job.id)
            try:
                await self._end(job, FAILED, error={
                    "code": "internal_error", "message": "internal error; see the server log"})
            except STORE_ERRORS:
                pass
        finally:
            self.held.pop(job.id, None)
            self.held_items -= len(items)
            self._room.set()

    async def _end(self, job: Job, status: str, outputs: bytes = b"",
                   error: dict[str, str] | None = None, dead_letter: bool = False) -> None:
        await self.lane.store.finish(job, status, outputs, error, dead_letter)
        self.lane.counted(self.model, status)

    def _spawn(self, work: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_end)

    async def settle(self, timeout_s: float) -> None:
        """Let the jobs held here finish and store their results, bounded."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


def _log_end(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("job task died: %r", task.exception())

