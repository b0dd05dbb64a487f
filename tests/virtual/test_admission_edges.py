"""Admission at its edges (virtual clock): one held-up batch, a request larger than a
batch or than its class may queue, the loop lag after a quiet spell, what a queued
long window costs in the capacity signal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from vega.admission import Admission, AdmissionConfig
from vega.batcher import Batcher, BatcherConfig
from vega.errors import VegaError
from vega.records import NORMAL, SHEDDABLE, Batch, Item
from vega.warmup import seed_batch_times


class Model:
    """A model whose batch takes 2 ms + 0.1 ms an item; ``pause_s`` is added to the next
    batch only (a collection, a preemption, a swapped-out page)."""

    def __init__(self, fixed_s: float = 0.002, per_item_s: float = 0.0001) -> None:
        self.fixed_s, self.per_item_s = fixed_s, per_item_s
        self.pause_s = 0.0
        self.batches = 0
        self.items = 0

    def seconds(self, size: int) -> float:
        return self.fixed_s + self.per_item_s * size

    async def __call__(self, batch: Batch) -> None:
        seconds = self.seconds(batch.size) + self.pause_s
        self.pause_s = 0.0
        await asyncio.sleep(seconds)
        batch.infer_s = seconds
        self.batches += 1
        self.items += batch.size
        for item in batch.items:
            if not item.future.done():
                item.future.set_result(None)


@pytest.fixture
def model() -> Model:
    return Model()


@pytest.fixture
async def served(model: Model) -> AsyncIterator[tuple[Admission, Batcher, Model]]:
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 512), max_batch_size=4,
                                    max_wait_s=0.005, max_inflight=2, dispatch_when_idle=True,
                                    standing_after_s=0.1), model)
    seed_batch_times(batcher, 2, lambda _bound, size: model.seconds(size))
    loop = asyncio.get_running_loop()
    admission = Admission(AdmissionConfig(queue_capacity=100, shed_watermark=0.5,
                                          normal_watermark=0.9, rate_limit=0.0, burst=0.0,
                                          margin_s=0.002), batcher, now=loop.time())
    task = asyncio.create_task(batcher.run())
    yield admission, batcher, model
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def request(admission: Admission, batcher: Batcher, length: int,
                  deadline_s: float) -> str:
    """One request through admission and the batcher, as Runtime.infer does: its outcome."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    bucket = batcher.bucket_of(length)
    try:
        costs = admission.admit(NORMAL, [bucket], now + deadline_s, now)
    except VegaError as error:
        return error.code
    item = Item(sample=None, length=length, priority=NORMAL,
                deadline=now + deadline_s, future=loop.create_future(), bucket=bucket,
                cost=costs[0])
    batcher.enqueue(item)
    try:
        await item.future
    except VegaError as error:
        return error.code
    return "ok"


@pytest.mark.parametrize("served_before, deadline_s", [
    (100, 0.1),  # a full window of served batches; callers ask 100 ms (50x a batch)
    (0, 1.0),  # the bucket's first served batch after warm-up; the default 1-s deadline
])
async def test_one_slow_batch_does_not_refuse_its_bucket_for_good(
        served: tuple[Admission, Batcher, Model], served_before: int,
        deadline_s: float) -> None:
    admission, batcher, model = served
    for _ in range(served_before):
        assert await request(admission, batcher, 100, deadline_s) == "ok"
        await asyncio.sleep(0.01)
    model.pause_s = 10.0  # one batch held up 10 s (a collection, a preemption)
    assert await request(admission, batcher, 100, 20.0) == "ok"
    # The model is back to 2 ms a batch. One caller a second for ten minutes, each
    # honouring Retry-After (1 s): the docs say one held-up batch moves nothing.
    outcomes = []
    for _ in range(600):
        outcomes.append(await request(admission, batcher, 100, deadline_s))
        await asyncio.sleep(1.0)
    assert outcomes.count("ok") > 500


async def test_a_hiccup_after_an_idle_hour_is_still_one_late_turn() -> None:
    # docs/pressure.md: "The share grows only from the second late turn in a row: one late
    # turn is a hiccup". Two hiccups an hour apart are not two late turns in a row.
    from vega.pressure.looplag import LoopLag
    loop = asyncio.get_running_loop()
    lag = LoopLag(deadline_s=0.8)  # turns past 100 ms are late

    async def one_late_turn() -> None:
        lag.touch()  # one request: the probe is armed
        loop.advance(0.15)  # type: ignore[attr-defined]  # the turn is held 150 ms
        for _ in range(3):
            await asyncio.sleep(0)

    await one_late_turn()
    assert lag.lag_s > 0.1 and lag.share == 0.0  # a hiccup
    await asyncio.sleep(3600)  # an idle hour: no request, no probe
    assert not lag.armed
    await one_late_turn()
    refused = 0
    for _ in range(20):
        try:
            lag.check(NORMAL)
        except VegaError:
            refused += 1
    assert lag.share == 0.0 and refused == 0, (lag.share, refused)


async def requests(admission: Admission, batcher: Batcher, count: int, length: int,
                   deadline_s: float) -> str:
    """One request of ``count`` instances, as Runtime.infer admits and awaits it."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    bucket = batcher.bucket_of(length)
    try:
        costs = admission.admit(NORMAL, [bucket] * count, now + deadline_s, now)
    except VegaError as error:
        return f"refused at admission: {error.code}"
    items = [Item(sample=None, length=length, priority=NORMAL,
                  deadline=now + deadline_s, future=loop.create_future(), bucket=bucket,
                  cost=cost) for cost in costs]
    for item in items:
        batcher.enqueue(item)
    try:
        await asyncio.gather(*(item.future for item in items))
    except VegaError as error:
        return f"admitted, then {error.code}"
    return "ok"


@pytest.mark.parametrize("model", [Model(fixed_s=0.002, per_item_s=0.001)])
async def test_a_request_is_not_admitted_when_its_own_items_cannot_end_in_time(
        served: tuple[Admission, Batcher, Model]) -> None:
    # Idle server; batches of 4 take 6 ms. A request of 32 instances needs 8 batches
    # (48 ms); it asks 20 ms. Rule 1: refuse early and cheaply, not after running some.
    admission, batcher, model = served
    outcome = await requests(admission, batcher, 32, 100, 0.02)
    await asyncio.sleep(1.0)
    assert outcome.startswith("refused at admission") and model.items == 0


async def test_capacity_counts_queued_work_in_executor_seconds() -> None:
    # docs/pressure.md: demand is "its utilisation, plus the work it refused and the work
    # queued (spread over the grow window), in executor-seconds per second".
    from types import SimpleNamespace

    from vega.metrics import Metrics
    from vega.pressure.capacity import Capacity, CapacityConfig
    from vega.status import Reporter

    loop = asyncio.get_running_loop()
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 512), max_batch_size=4,
                                    max_wait_s=0.005, max_inflight=1), Model())
    for size in (1, 4):  # a 512-step window costs 8 times a 16-step one
        batcher.times.observe(0, size, size * 0.001)
        batcher.times.observe(1, size, size * 0.008)
    for _ in range(100):  # 100 long windows queued: 0.8 executor-seconds of work
        batcher.enqueue(Item(sample=None, length=500, priority=NORMAL,
                             deadline=loop.time() + 60, future=loop.create_future(),
                             bucket=1, cost=8.0))
    runtime = SimpleNamespace(
        models={"m": SimpleNamespace(batcher=batcher)}, default_model="m", metrics=Metrics(),
        streams=None, executor=SimpleNamespace(busy_s=0.0, threads=1),
        jobs=SimpleNamespace(backlog_items=lambda: 0))
    reporter = Reporter(runtime)  # type: ignore[arg-type]
    capacity = Capacity(CapacityConfig(grow_after_s=5.0))
    capacity.observe(reporter.capacity_sample())
    await asyncio.sleep(1.0)
    capacity.observe(reporter.capacity_sample())
    queued_s = batcher.backlog_s()
    assert queued_s == pytest.approx(0.8)
    assert capacity.demand == pytest.approx(queued_s / 5.0, rel=0.1)  # idle executor


async def test_a_request_larger_than_its_class_may_queue_is_not_told_to_retry() -> None:
    # VEGA_QUEUE_CAPACITY=256 (a setting docs/tuning.md tries) with the default
    # VEGA_MAX_INSTANCES=256: normal may queue 230 items, sheddable 128. A normal request
    # of 240 instances on an EMPTY queue gets 429 queue_full with a Retry-After, and gets it
    # again on every retry: no amount of waiting admits it.
    loop = asyncio.get_running_loop()
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 512), max_batch_size=32,
                                    max_wait_s=0.005, max_inflight=2), Model())
    seed_batch_times(batcher, 2, lambda _bound, size: 0.002 + 0.0001 * size)
    admission = Admission(AdmissionConfig(queue_capacity=256, shed_watermark=0.5,
                                          normal_watermark=0.9, rate_limit=0.0, burst=0.0,
                                          margin_s=0.002), batcher, now=loop.time())
    assert batcher.depth() == 0
    with pytest.raises(VegaError) as refused:
        admission.admit(NORMAL, [0] * 240, loop.time() + 30.0, loop.time())
    assert (refused.value.code, refused.value.retry_after_ms) == ("invalid_input", None)
    assert "(230)" in refused.value.message


async def test_a_deadline_shorter_than_its_own_batch_is_not_told_to_retry(
        served: tuple[Admission, Batcher, Model]) -> None:
    # Batches take 2 ms + 0.1 ms an item and a partial one waits out the 5-ms window. On an
    # empty queue a 3-ms deadline cannot be met, now or after any wait: 422, no Retry-After.
    admission, batcher, _ = served
    loop = asyncio.get_running_loop()
    now = loop.time()
    with pytest.raises(VegaError) as never:
        admission.admit(NORMAL, [batcher.bucket_of(100)], now + 0.003, now)
    assert (never.value.code, never.value.retry_after_ms) == ("invalid_input", None)
    # 15 ms is met on an empty queue; behind a backlog it is refused for now, with a retry.
    for _ in range(40):
        admission.admit(NORMAL, [batcher.bucket_of(100)], now + 30.0, now)
        batcher.enqueue(Item(sample=None, length=100, priority=NORMAL,
                             deadline=now + 30.0, future=loop.create_future(),
                             bucket=batcher.bucket_of(100), cost=1.0))
    with pytest.raises(VegaError) as later:
        admission.admit(NORMAL, [batcher.bucket_of(100)], now + 0.015, now)
    assert later.value.code == "deadline_unmeetable" and (later.value.retry_after_ms or 0) >= 50
    assert await request(admission, batcher, 100, 0.015) == "deadline_unmeetable"
    await asyncio.sleep(1.0)  # the backlog served
    assert await request(admission, batcher, 100, 0.015) == "ok"


async def test_a_deadline_an_idle_server_meets_is_admitted(
        served: tuple[Admission, Batcher, Model]) -> None:
    # A batch of one takes 2.1 ms, the margin is 2 ms: a 7-ms deadline is met on an idle
    # server, whose free thread takes the item at once (no 5-ms window to wait out).
    admission, batcher, _ = served
    for _ in range(3):
        assert await request(admission, batcher, 100, 0.007) == "ok"
        await asyncio.sleep(0.1)
    # A slow upload spent 4 of its 7 ms: not met now, but a retry could be: 429, not 422.
    loop = asyncio.get_running_loop()
    now = loop.time()
    with pytest.raises(VegaError) as late:
        admission.admit(NORMAL, [batcher.bucket_of(100)], now + 0.003, now, arrived=now - 0.004)
    assert late.value.code == "deadline_unmeetable" and late.value.retry_after_ms is not None


async def test_one_held_up_batch_barely_moves_what_a_long_window_costs() -> None:
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 512), max_batch_size=4,
                                    max_wait_s=0.005, max_inflight=2), Model())
    seed_batch_times(batcher, 2, lambda bound, size: (0.002 + 0.001 * size) * bound / 16)
    before = batcher.item_cost(1)
    for _ in range(60):  # served short-window batches, as warm-up measured them
        batcher.times.observe(0, 4, 0.006)
    batcher.times.observe(0, 4, 10.0)  # one of them held up 10 s
    assert before > 20 and batcher.item_cost(1) == pytest.approx(before, rel=0.2)


async def test_watermark_limit_is_not_cut_by_float_rounding() -> None:
    # VEGA_QUEUE_CAPACITY=100, VEGA_NORMAL_WATERMARK=0.29, VEGA_SHED_WATERMARK=0.57:
    # normal may fill 29 items, sheddable 57 (100 x 0.29 = 28.999999999999996 in floats).
    batcher = Batcher(BatcherConfig(model="m", buckets=(16,), max_batch_size=4,
                                    max_wait_s=0.005, max_inflight=2), Model())
    admission = Admission(AdmissionConfig(queue_capacity=100, shed_watermark=0.57,
                                          normal_watermark=0.29, rate_limit=0.0, burst=0.0,
                                          margin_s=0.002), batcher, now=0.0)
    assert (admission.limits[NORMAL], admission.limits[SHEDDABLE]) == (29, 57)
