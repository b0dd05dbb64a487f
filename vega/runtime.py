"""The engine of one process: models, executor, and per model a batcher and admission.

The HTTP layer (the ``/v1`` and Open Inference Protocol routes alike) calls ``Runtime.infer``;
all below it is wired here, started by ``start`` and stopped by ``drain``/``stop``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vega.admission import Admission, AdmissionConfig
from vega.batcher import Batcher, BatcherConfig
from vega.channel.wire import default_node
from vega.config import Settings
from vega.errors import VegaError, drain_ran_out, reraisable
from vega.executor import Executor, pick_device, process_plan
from vega.jobs.lane import JobLane
from vega.metrics import Metrics
from vega.modelproc.handle import ModelProcessError
from vega.models import ModelAdapter, decode_all, load_model, min_length
from vega.pressure.capacity import Capacity, CapacityConfig, sample_forever
from vega.pressure.fallback import Fallback, check_lengths, first_admitted, load_fallback
from vega.pressure.looplag import LoopLag
from vega.pressure.pacing import RefusalPacer
from vega.records import JOB, PRIORITY_NAMES, SHEDDABLE, Batch, Item, deadline_at
from vega.status import Reporter
from vega.streams import Streams
from vega.warmup import planned, seed_batch_times, warm_up_failed

log = logging.getLogger("vega.runtime")


class ClientGone(Exception):
    """The caller disconnected while its items were queued or running."""


@dataclass
class Answer:
    outputs: list[Any]
    queue_s: float
    infer_s: float
    model: str = ""  # the model that answered: the fallback's name when degraded
    degraded: bool = False


@dataclass
class Served:
    """One model as served: the adapter, its batcher and its admission."""

    adapter: ModelAdapter
    batcher: Batcher
    admission: Admission
    task: asyncio.Task[None] | None = None


class Runtime:
    def __init__(self, settings: Settings, adapters: Sequence[ModelAdapter] | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.node_id = settings.node_id or default_node()
        self._adapters = list(adapters) if adapters is not None else [
            load_model(settings.model, settings.model_name)]
        self.default_model = self._adapters[0].name
        self.fallback = self._add_fallback()  # VEGA_FALLBACK_MODEL (vega/pressure/fallback.py)
        # What a model process rebuilds the adapters from; unknown for adapters given here.
        specs = None if adapters is not None else tuple(
            (spec, name) for spec, name in ((settings.model, settings.model_name),
                                            (settings.fallback_model, "")) if spec)
        self.capacity = Capacity(CapacityConfig(
            target=settings.capacity_target, grow_after_s=settings.capacity_grow_s,
            shrink_after_s=settings.capacity_shrink_s, job_drain_s=settings.jobs_drain_target_s))
        self._capacity_task: asyncio.Task[None] | None = None
        self.device = "cpu"
        self.models: dict[str, Served] = {}
        self.executor = Executor({a.name: a for a in self._adapters},
                                 threads=settings.executor_threads,
                                 torch_threads=settings.torch_threads,
                                 plan=process_plan(settings, self._adapters, specs))
        self._warm = False
        self.draining = False
        self.failed: BaseException | None = None
        # Called once the start has finished: with None when ready, else with the error.
        self.on_start: list[Callable[[BaseException | None], None]] = []
        self._starting: asyncio.Task[None] | None = None
        self._stopping = False
        self.active_requests = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        self.streams: Streams | None = None  # overflow to peers, with VEGA_REDIS_URL
        self.pacer = RefusalPacer(settings.refusal_rate, settings.refusal_max_hold_ms / 1000)
        self.lag = LoopLag(settings.default_deadline_ms / 1000)  # the loop's own queue
        self.reporter = Reporter(self)
        self.jobs = JobLane(settings, self.node_id, self.metrics)  # the async lane
        self._local_batches = 0  # batches given to this process's executor, not yet done

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Begin loading and warming in the background; ``ready`` turns true when done.

        The process listens meanwhile, answering 503 ``not_ready``, so a balancer sees it
        starting rather than a refused connection."""
        self._starting = asyncio.create_task(self._load_and_warm(), name="warm-up")
        self._starting.add_done_callback(self._started)

    async def wait_ready(self) -> None:
        """Until warm (raises what failed the start)."""
        assert self._starting is not None, "start() first"
        await asyncio.shield(self._starting)

    async def _load_and_warm(self) -> None:
        s = self.settings
        self.device = pick_device(s.device)
        if s.torch_threads:
            import torch

            torch.set_num_threads(s.torch_threads)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.executor.load, self.device)
        if self.fallback is not None:
            self.fallback.check_answers(self._adapters)
        self.executor.bind(loop)
        for adapter in self._adapters:
            config = BatcherConfig.from_settings(s, adapter.name, adapter.max_length,
                                                 hands_off=bool(s.redis_url),
                                                 pad=getattr(adapter, "padded_length", None),
                                                 min_length=min_length(adapter))
            batcher = Batcher(config, self._sink, self.metrics.observe_batch)
            await self.executor.call(self._warm_up, adapter, batcher)
            batcher = planned(batcher, s)
            admission = Admission(AdmissionConfig.from_settings(s), batcher, loop.time(),
                                  reach=self)
            served = Served(adapter, batcher, admission)
            served.task = asyncio.create_task(batcher.run(), name=f"batcher-{adapter.name}")
            served.task.add_done_callback(_log_task_end)
            self.models[adapter.name] = served
        self.executor.warm()
        batchers = {n: (m.adapter, m.batcher) for n, m in self.models.items()}
        if s.redis_url:
            self.streams = Streams(s, self.node_id, self.metrics, batchers, self._run_local,
                                   self.lag, lambda: self.executor.available)
            self.streams.link.quarantine = self.executor.quarantine  # shared with peers
            self.streams.start()
        self.jobs.start(batchers, lambda: self.executor.available)
        self._capacity_task = asyncio.create_task(sample_forever(
            self.capacity, self.reporter.capacity_sample, s.capacity_sample_s), name="capacity")
        self._capacity_task.add_done_callback(_log_task_end)

    # What admission reads of the peers (vega.admission.Reach); the local rule without Redis.

    def lent(self, model: str) -> float:
        return self.streams.lent(model) if self.streams is not None else 0.0

    def room(self, model: str) -> bool:
        return self.streams is not None and self.streams.up and self.streams.room(model)

    def _started(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("start failed: %r", error)
            self.failed = error
        else:
            self._warm = True
            self.metrics.ready.set(1)
            log.info("ready: model(s) %s on %s, in a %s", ", ".join(self.models), self.device,
                     self.executor.kind)
        for callback in self.on_start:
            callback(error)

    def _warm_up(self, adapter: ModelAdapter, batcher: Batcher) -> None:
        """Run each (bucket, size) shape; the timed passes seed the batch-time predictor."""
        def measure(bound: int, size: int) -> float:
            if self._stopping:  # a thread cannot be cancelled: it stops at the next shape
                raise VegaError("draining", "stopped during warm-up")
            try:
                return self.executor.run_sync(adapter.name, [adapter.example(bound)] * size,
                                              bound)[1]
            except ModelProcessError as error:  # a shape's first pass may be slow (lazy init)
                raise ModelProcessError(f"warm-up ({size} x {bound} steps): {error}") from None
            except Exception as error:  # the model raised: say on what, and what may fix it
                raise warm_up_failed(adapter, bound, size, error) from error

        log.info("model %s: warming up (every batch shape, %d timed pass(es))", adapter.name,
                 self.settings.warmup_batches)
        seed_batch_times(batcher, self.settings.warmup_batches, measure)

    @property
    def ready(self) -> bool:
        """Warm, a model process up, no batch hung: else 503s, which Nginx retries elsewhere."""
        return self._warm and self.executor.available and not any(
            s.batcher.stalled(asyncio.get_running_loop().time()) for s in self.models.values())

    async def drain(self) -> None:
        """Stop admitting (503 draining) and wait for admitted work, bounded by the timeout."""
        self.draining = True
        self.jobs.stop_taking()
        if self.streams is not None:
            self.streams.stealing = False
        self.metrics.ready.set(0)
        try:
            await asyncio.wait_for(self._until_quiet(), self.settings.drain_timeout_s)
        except TimeoutError:
            # What never began is answered 503 now (Nginx may send it elsewhere) rather
            # than cut off with the connection; a batch still running has until the stop.
            refused = sum(s.batcher.refuse_queued(drain_ran_out) for s in self.models.values())
            log.warning("drain timeout: %d request(s) still open; %d queued item(s) refused",
                        self.active_requests, refused)

    async def _until_quiet(self) -> None:
        for served in self.models.values():
            await served.batcher.wait_idle()
        await self._quiet.wait()

    async def stop(self) -> None:
        self._warm, self._stopping = False, True
        if self._capacity_task is not None:
            self._capacity_task.cancel()
            await asyncio.gather(self._capacity_task, return_exceptions=True)
        await self.jobs.stop()  # while the batchers still run what it holds
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        for served in self.models.values():
            if served.task is not None:
                served.task.cancel()
                await asyncio.gather(served.task, return_exceptions=True)
        if self.streams is not None:
            await self.streams.stop()
        await self.executor.stop()

    # -- the request path ----------------------------------------------------------

    def served(self, name: str | None) -> Served:
        served = self.models.get(name or self.default_model)
        if served is not None:
            return served
        if not self.ready and (name or self.default_model) in self.executor.models:
            raise VegaError("not_ready", "this process is still warming up", retry_after_ms=1000.0)
        raise VegaError("model_not_found", f"no model named {name!r}")

    def check_open(self) -> None:
        if self.draining:
            retry = max(1000.0, *(s.admission.retry_after_ms() for s in self.models.values()))
            raise VegaError("draining", "this process is shutting down", retry_after_ms=retry)
        if not self.ready:
            why = "is still warming up" if not self._warm else "has no model that can run a batch"
            raise VegaError("not_ready", f"this process {why}", retry_after_ms=1000.0)

    def gate(self, model: str, claimed: int | None, unread: bool = False) -> None:
        """The checks before a request's body is read, and again before it is parsed: open,
        the model known, and room for the most favoured class it can claim, if given
        (unless a fallback may take it, or, ``unread``, any class its body may still name)."""
        self.check_open()
        served = self.served(model)
        if claimed is None:
            return
        if self.fallback is not None:  # each request comes here: no fallback, no search
            classes = range(claimed, SHEDDABLE + 1) if unread else (claimed,)
            if any(self.fallback_for(served, c) is not None for c in classes):
                return
        served.admission.precheck(claimed)

    async def infer(self, model: str, instances: list[Any], priority: int,
                    deadline_ms: float, gone: Callable[[], bool] | None = None,
                    arrived: float | None = None) -> Answer:
        """Admit, queue and await ``instances`` of a model past ``gate``; raise VegaError
        or ClientGone. The deadline counts from ``arrived`` (loop time; now if not given).

        The list is taken over: it is emptied once its instances are decoded. What a JSON
        body parses into (a list per timestep, tracked by the garbage collector) then dies
        before the wait instead of living, and being rescanned, for the whole queue time.
        Collections hold the GIL that the model thread needs after each forward pass
        (docs/tuning.md has the figures). Callers keep no other reference to the parsed
        body while they wait.
        """
        asked = self.models[model]
        loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = deadline_at(deadline_ms, now, arrived)
        if deadline <= now:
            raise VegaError("deadline_exceeded", "deadline passed before the request was read")
        served, costs = self._admit(asked, instances, priority, deadline, now, arrived)
        batcher = served.batcher
        try:
            decoded = decode_all(served.adapter, instances)
            if served is not asked:
                check_lengths(asked.adapter, decoded)
        except VegaError:
            served.admission.refund(costs)
            raise
        instances.clear()
        items = []
        for (sample, length), cost in zip(decoded, costs):
            bucket = batcher.bucket_of(length)
            items.append(Item(sample=sample, length=length,
                              priority=priority, deadline=deadline, future=loop.create_future(),
                              bucket=bucket, cost=cost, gone=gone))
        self._opened()
        try:
            for item in items:
                batcher.enqueue(item)
            answer = await _await_items(items, deadline)
        finally:
            self._closed()
        answer.model, answer.degraded = served.adapter.name, served is not asked
        if answer.degraded:
            self.metrics.degraded.labels(asked.adapter.name, PRIORITY_NAMES[priority]).inc()
        return answer

    def _admit(self, served: Served, instances: Sequence[Any], priority: int, deadline: float,
               now: float, arrived: float | None) -> tuple[Served, list[float]]:
        """Admit on the main model, or on the fallback for a degradable class under pressure.

        Degradable requests go to the fallback once the main model's queue is past
        VEGA_DEGRADE_WATERMARK, and whenever the main model would refuse them; one
        the fallback refuses is still tried on the main model.
        """
        fallback, other = self.fallback, self.fallback_for(served, priority)
        if fallback is None or other is None:
            return served, self._admit_on(served, instances, priority, deadline, now, arrived)
        return first_admitted(fallback.order(served, other, served.batcher.depth()),
                              lambda s: self._admit_on(s, instances, priority, deadline, now,
                                                       arrived))

    @staticmethod
    def _admit_on(served: Served, instances: Sequence[Any], priority: int, deadline: float,
                  now: float, arrived: float | None) -> list[float]:
        buckets = [served.batcher.bucket_of(_length_hint(instance)) for instance in instances]
        return served.admission.admit(priority, buckets, deadline, now, arrived)

    def fallback_for(self, served: Served, priority: int) -> Served | None:
        """The fallback that may serve ``priority`` requests for ``served``, if any."""
        if self.fallback is None or not self.fallback.serves(served.adapter.name, priority):
            return None
        return self.models.get(self.fallback.name)

    @property
    def fallback_model(self) -> str | None:
        """The fallback's name, if one is configured (as /v1/status shows it)."""
        return None if self.fallback is None else self.fallback.name

    def _add_fallback(self) -> Fallback | None:
        """Load the fallback model beside the main one (unless an adapter given has its name)."""
        loaded = load_fallback(self.settings, self._adapters[0])
        if loaded is None:
            return None
        fallback, adapter = loaded
        if all(a.name != adapter.name for a in self._adapters):
            self._adapters.append(adapter)
        return fallback

    def _opened(self) -> None:
        self.active_requests += 1
        self._quiet.clear()

    def _closed(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._quiet.set()

    def _sink(self, batch: Batch) -> Awaitable[None]:
        """Where a formed batch runs: here, or on a peer when the wait here is long. One
        that runs here is handed back as the executor's own future, not a coroutine: the
        executor ends it (batch.on_end starts the next batch) before the handlers it wakes."""
        if self.streams is not None and batch.items[0].priority != JOB:  # jobs move as jobs
            wait_s = self._local_wait_s(batch)
            if self.streams.worth_handing_off(batch, wait_s) and \
                    not self.executor.quarantine.holds(batch):  # a suspect runs here, alone
                return self._offer_or_run(batch, self.streams, wait_s)
        return self._run_local(batch)

    async def _offer_or_run(self, batch: Batch, streams: Streams, wait_s: float) -> None:
        if await streams.offer(batch, wait_s):
            return  # its futures are answered from the reply stream, or taken back
        await self._run_local(batch)

    def _run_local(self, batch: Batch) -> asyncio.Future[None]:
        done = self.executor.run(batch)
        self._local_batches += 1
        done.add_done_callback(functools.partial(self._ran_local, batch))
        return done

    def _ran_local(self, batch: Batch, _done: asyncio.Future[None]) -> None:
        self._local_batches -= 1
        self.metrics.observe_run(batch)

    def _local_wait_s(self, batch: Batch) -> float:
        """Predicted wait before ``batch`` would start here: the queue, then the batches ahead."""
        batcher = self.models[batch.model].batcher
        run_s = batcher.times.predict(batch.bucket, batch.size)
        return batcher.backlog_s() + self._local_batches * run_s / batcher.config.parallelism

    # -- what status and metrics read (vega.status) ----------------------------------

    def refresh_metrics(self) -> None:
        self.reporter.refresh_metrics()

    def status(self) -> dict[str, Any]:
        return self.reporter.status()


async def _await_items(items: list[Item], deadline: float) -> Answer:
    loop = asyncio.get_running_loop()
    # One future for all items: done when all are, or at the first failure.
    answered: asyncio.Future[Any] = (items[0].future if len(items) == 1 else
                                     asyncio.gather(*(item.future for item in items)))
    # Woken by the answer or the deadline, whichever comes first, without the sets and
    # callbacks asyncio.wait builds per call. The waiter never holds the answer's
    # exception, so no traceback of this frame ends up on it (see errors.reraisable).
    waiter: asyncio.Future[None] = loop.create_future()
    answered.add_done_callback(functools.partial(_wake, waiter))
    timer = loop.call_at(deadline, _wake, waiter, None)
    try:
        await waiter
        for item in items:  # plain loops: a generator over a request's few items costs more
            if item.future.cancelled():
                raise ClientGone()  # only a hung-up caller's items are cancelled (Item.live)
        for item in items:  # the first failure in request order is the answer
            if item.future.done() and item.future.exception():
                raise reraisable(item.future.exception())
        if not answered.done():
            raise VegaError("deadline_exceeded", "deadline passed before the answer was ready")
        outputs, queue_s, infer_s = [], 0.0, 0.0
        for item in items:
            outputs.append(item.future.result())
            queue_s = max(queue_s, item.queue_s)
            infer_s = max(infer_s, item.infer_s)
        return Answer(outputs=outputs, queue_s=queue_s, infer_s=infer_s)
    finally:
        timer.cancel()
        for item in items:  # whatever is left is nobody's answer any more
            if not item.future.cancel() and not item.future.cancelled():
                item.future.exception()  # read, so asyncio does not log it as lost
        if answered is not items[0].future:  # finished later, by its items' callbacks
            answered.add_done_callback(lambda done: done.cancelled() or done.exception())
        answered.cancel()


def _wake(waiter: asyncio.Future[None], _done: object) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _length_hint(instance: Any) -> int:
    try:
        return max(1, len(instance))
    except TypeError:
        return 1


def _log_task_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died: %r", task.get_name(), task.exception())
