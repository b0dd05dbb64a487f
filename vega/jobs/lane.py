"""The async lane of one process: its store, a runner per model, and what it reports.

Built by the runtime; started once the models are warm, told to stop taking jobs when
the process drains, stopped with it. ``/v1/status``, ``/metrics`` and the capacity
signal read the last sample of the store's figures (taken every
``VEGA_CAPACITY_SAMPLE_S``), never Redis on their own path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from vega.batcher import Batcher
from vega.channel.link import stop_tasks
from vega.config import Settings
from vega.jobs.redis_store import RedisStore, StoreError
from vega.jobs.runner import STORE_ERRORS, JobRunner
from vega.jobs.store import OUTCOMES, Job, JobStore, MemoryStore, Stats, Submitted
from vega.metrics import Metrics
from vega.models import ModelAdapter

log = logging.getLogger("vega.jobs")

SETTLE_S = 1.0
NOT_DURABLE = ("jobs are held in this process's memory: they are lost if it stops or "
               "crashes (set VEGA_REDIS_URL to keep them in Redis)")


class JobLane:
    def __init__(self, settings: Settings, node: str, metrics: Metrics) -> None:
        self.settings = s = settings
        self.node = node
        self.metrics = metrics
        self.max_attempts = s.max_attempts
        self.claim_idle_ms = s.claim_idle_ms
        self.store: JobStore = (
            RedisStore(s.redis_url, s.jobs_redis_timeout_ms / 1000, s.jobs_result_ttl_s,
                       s.stream_maxlen) if s.redis_url
            else MemoryStore(s.jobs_result_ttl_s, s.jobs_max_depth, s.jobs_memory_bytes))
        self.runners: dict[str, JobRunner] = {}
        self.stats: dict[str, Stats] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.taking = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def durable(self) -> bool:
        return self.store.durable

    def start(self, models: Mapping[str, tuple[ModelAdapter, Batcher]],
              runnable: Callable[[], bool] = lambda: True) -> None:
        """Claim and run jobs for ``models`` while ``runnable()`` (a model can run now)."""
        for name, (adapter, batcher) in models.items():
            runner = self.runners[name] = JobRunner(self, adapter, batcher, runnable)
            self.stats[name] = Stats()
            self.counts[name] = dict.fromkeys(OUTCOMES, 0)
            # At 0 from the start, so rate() sees the first job end, retry or reclaim.
            for outcome in OUTCOMES:
                self.metrics.jobs_total.labels(name, outcome)
            self.metrics.jobs_retried.labels(name)
            self.metrics.jobs_reclaimed.labels(name)
            self._spawn(runner.run(), f"jobs-{name}")
            if self.durable:
                self._spawn(runner.keep_claims(), f"job-claims-{name}")
        self._spawn(self._sample_forever(), "jobs-sample")
        self.taking.set()

    def stop_taking(self) -> None:
        """Draining: claim nothing more; what is held here runs to its end."""
        self.taking.clear()

    async def stop(self) -> None:
        """After drain: what is still held here gets a moment to store its result; with
        Redis the rest stays pending and a peer reclaims it."""
        self.taking.clear()
        for runner in self.runners.values():
            await runner.settle(SETTLE_S)
        # Bounded, and cancelled again while still running: redis-py can lose a cancellation
        # inside a blocking read, and a read must not keep the process from exiting.
        stuck = await stop_tasks(list(self._tasks), timeout_s=2)
        if stuck:
            log.warning("job lane: %d task(s) did not stop in time", len(stuck))
        elif isinstance(self.store, RedisStore):
            for model in self.runners:
                await self.store.leave(model, self.node)
        try:
            await self.store.close()
        except STORE_ERRORS:
            pass

    def _spawn(self, work: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        task.set_name(name)
        task.add_done_callback(_log_end)
        self._tasks.append(task)

    # -- the routes' side ------------------------------------------------------------

    async def submit(self, job: Job, key: str | None, print_: str) -> Submitted:
        return await self.store.submit(job, key, print_, self.settings.jobs_max_depth)

    async def find(self, job_id: str) -> Job | None:
        """The job with ``job_id`` among this process's models (the id names no model)."""
        for model in self.runners:
            try:
                job = await self.store.get(model, job_id)
            except StoreError as error:
                log.warning("job %s: %s", job_id, error)
                return None
            if job is not None:
                return job
        return None

    async def cancel(self, job: Job) -> Job | None:
        after, cancelled_now = await self.store.cancel(job.model, job.id)
        if cancelled_now:  # of two DELETEs at once, one cancelled it
            self.counted(job.model, "cancelled")
        return after

    def wait_s(self, model: str) -> float:
        """Predicted seconds until the backlog of ``model`` has run, at the measured rate."""
        runner = self.runners.get(model)
        stats = self.stats.get(model, Stats())
        if runner is None:
            return 1.0
        rate = runner.batcher.job_items_per_s()
        backlog = (stats.queued + stats.pending + 1) * runner.items_per_job
        return backlog / rate if rate > 0 else 1.0

    # -- what status, metrics and the capacity signal read ---------------------------

    def counted(self, model: str, outcome: str) -> None:
        self.counts.setdefault(model, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
        self.metrics.jobs_total.labels(model, outcome).inc()

    async def _sample_forever(self) -> None:
        while True:
            for model in self.runners:
                try:
                    self.stats[model] = await self.store.stats(model)
                except STORE_ERRORS as error:
                    log.debug("job stats for %s: %r", model, error)
            await asyncio.sleep(self.settings.capacity_sample_s)

    def refresh_metrics(self) -> None:
        for model, stats in self.stats.items():
            self.metrics.jobs_depth.labels(model, "queued").set(stats.queued)
            self.metrics.jobs_depth.labels(model, "pending").set(stats.pending)
            self.metrics.jobs_oldest_age.labels(model).set(stats.oldest_age_s)
            self.metrics.jobs_dead_letters.labels(model).set(stats.dead_letters)

    def status(self, model: str) -> dict[str, Any]:
        stats = self.stats.get(model, Stats())
        runner = self.runners.get(model)
        doc: dict[str, Any] = {
            "durable": self.durable, "depth": stats.queued + stats.pending,
            "queued": stats.queued, "pending": stats.pending,
            "held_here": len(runner.held) if runner is not None else 0,
            "counts": dict(self.counts.get(model, {})),
            "oldest_age_s": round(stats.oldest_age_s, 3),
            "dead_letters": stats.dead_letters, "max_depth": self.settings.jobs_max_depth,
            "drain_rate_items_per_s": round(runner.batcher.job_items_per_s(), 1)
            if runner is not None else 0.0,
            "predicted_drain_s": round(self.wait_s(model), 3)}
        if not self.durable:
            doc["note"] = NOT_DURABLE
        return doc

    def backlog_items(self) -> float:
        """Job items waiting or held, all models: the capacity signal's job backlog."""
        return sum((self.stats[m].queued + self.stats[m].pending) * r.items_per_job
                   for m, r in self.runners.items() if m in self.stats)


def _log_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died: %r", task.get_name(), task.exception())
