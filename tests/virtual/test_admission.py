"""Admission against a real batcher whose measurements and queue are set up by hand."""

from __future__ import annotations

import asyncio

import pytest

from vega.admission import Admission, AdmissionConfig, TokenBucket
from vega.batcher import Batcher, BatcherConfig
from vega.errors import VegaError
from vega.records import CRITICAL, NORMAL, SHEDDABLE, Batch, Item


async def _never(batch: Batch) -> None:
    raise AssertionError("the batch loop is not running in these tests")


def make(capacity: int = 10, rate_limit: float = 0.0, burst: float = 0.0,
         per_item_ms: float = 1.0, interval_s: float = 0.1) -> tuple[Admission, Batcher]:
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 512), max_batch_size=4,
                                    max_wait_s=0.005, max_inflight=1,
                                    standing_after_s=interval_s), _never)
    # As warm-up would: the short bucket costs per_item_ms an item, the long one 8x that.
    for size in (1, 4):
        batcher.times.observe(0, size, size * per_item_ms / 1000)
        batcher.times.observe(1, size, size * 8 * per_item_ms / 1000)
        batcher.rate.observe(size, size, size * per_item_ms / 1000)
    config = AdmissionConfig(queue_capacity=capacity, shed_watermark=0.5,
                             normal_watermark=0.8, rate_limit=rate_limit, burst=burst,
                             margin_s=0.0)
    return Admission(config, batcher, now=0.0), batcher


def fill(batcher: Batcher, count: int, priority: int = NORMAL, bucket: int = 0) -> None:
    loop = asyncio.get_running_loop()
    for _ in range(count):
        batcher.enqueue(Item(sample=None, length=1, priority=priority,
                             deadline=loop.time() + 60, future=loop.create_future(),
                             bucket=bucket, cost=batcher.item_cost(bucket)))


async def test_costs_are_charged_in_compute_not_requests() -> None:
    admission, batcher = make()
    assert batcher.item_cost(0) == pytest.approx(1.0)
    assert batcher.item_cost(1) == pytest.approx(8.0)
    assert admission.admit(NORMAL, [0, 1], deadline=10.0, now=0.0) == pytest.approx([1.0, 8.0])


async def test_watermarks_refuse_sheddable_first_then_normal_then_critical() -> None:
    admission, batcher = make(capacity=10)
    fill(batcher, 5)
    with pytest.raises(VegaError) as shed:
        admission.admit(SHEDDABLE, [0], deadline=100.0, now=0.0)
    assert shed.value.code == "shed" and shed.value.status == 429
    admission.admit(NORMAL, [0], deadline=100.0, now=0.0)
    fill(batcher, 3)  # 8 queued: normal's limit
    with pytest.raises(VegaError) as full:
        admission.admit(NORMAL, [0], deadline=100.0, now=0.0)
    assert full.value.code == "queue_full"
    admission.admit(CRITICAL, [0, 0], deadline=100.0, now=0.0)  # headroom kept for critical
    fill(batcher, 2, CRITICAL)
    with pytest.raises(VegaError) as bound:
        admission.admit(CRITICAL, [0], deadline=100.0, now=0.0)
    assert bound.value.code == "queue_full"


async def test_deadline_refused_when_the_backlog_ahead_cannot_finish_in_time() -> None:
    admission, batcher = make(capacity=1000, interval_s=1.0)  # may buffer a second of work
    fill(batcher, 100)  # 100 short items at 1 ms each: ~100 ms of work
    with pytest.raises(VegaError) as caught:
        admission.admit(NORMAL, [0], deadline=0.05, now=0.0)
    assert caught.value.code == "deadline_unmeetable"
    # About the backlog ahead (100 ms), not a constant.
    assert caught.value.retry_after_ms is not None and 80 <= caught.value.retry_after_ms <= 120
    admission.admit(NORMAL, [0], deadline=0.2, now=0.0)
    # Critical is served ahead of the queued normal items, so its short deadline is feasible.
    admission.admit(CRITICAL, [0], deadline=0.05, now=0.0)


async def test_deadline_uses_the_items_own_bucket_batch_time() -> None:
    admission, _ = make()
    admission.admit(NORMAL, [0], deadline=0.007, now=0.0)  # wait window 5 ms + 1 ms batch
    with pytest.raises(VegaError) as caught:
        admission.admit(NORMAL, [1], deadline=0.007, now=0.0)  # 5 ms + 8 ms batch
    # Even alone it could not end in time: no retry would, so it is not told to retry.
    assert (caught.value.code, caught.value.retry_after_ms) == ("invalid_input", None)


async def test_retry_after_for_a_full_queue_follows_backlog_and_service_rate() -> None:
    admission, batcher = make(capacity=10, per_item_ms=100.0)  # 10 items/s measured
    fill(batcher, 10, CRITICAL)
    with pytest.raises(VegaError) as caught:
        admission.admit(CRITICAL, [0], deadline=100.0, now=0.0)
    assert caught.value.retry_after_ms == pytest.approx(100.0)  # one item over, at 10/s
    assert caught.value.headers() == {"Retry-After": "1"}
    with pytest.raises(VegaError) as normal:
        admission.admit(NORMAL, [0], deadline=100.0, now=0.0)
    assert normal.value.retry_after_ms == pytest.approx(300.0)  # 3 over normal's limit of 8


async def test_token_bucket_limits_cost_per_second() -> None:
    admission, _ = make(capacity=1000, rate_limit=10.0, burst=10.0)
    admission.admit(NORMAL, [1], deadline=100.0, now=0.0)  # costs 8 of 10 tokens
    with pytest.raises(VegaError) as caught:
        admission.admit(NORMAL, [1], deadline=100.0, now=0.0)
    assert caught.value.code == "rate_limited"
    # 2 tokens left; 8 more plus the critical reserve of 2 are needed: 8 tokens at 10/s.
    assert caught.value.retry_after_ms == pytest.approx(800.0)
    admission.admit(NORMAL, [1], deadline=100.0, now=1.0)  # refilled after a second


async def test_refused_requests_take_no_tokens() -> None:
    admission, batcher = make(capacity=1, rate_limit=10.0, burst=10.0)
    fill(batcher, 1, CRITICAL)
    with pytest.raises(VegaError):
        admission.admit(NORMAL, [0], deadline=100.0, now=0.0)
    assert admission.bucket is not None and admission.bucket.tokens == pytest.approx(10.0)


def test_token_bucket_keeps_a_reserve_for_critical() -> None:
    bucket = TokenBucket(rate=1.0, size=10.0, reserve=2.0, now=0.0)
    assert bucket.take(8.0, critical=False, now=0.0) == 0.0
    assert bucket.take(1.0, critical=False, now=0.0) == pytest.approx(1.0)
    assert bucket.take(2.0, critical=True, now=0.0) == 0.0
    bucket.refund(3.0)
    assert bucket.tokens == pytest.approx(3.0)


def test_a_request_dearer_than_the_bucket_goes_when_it_is_full_and_leaves_a_debt() -> None:
    # VEGA_BURST below one long window's cost: refused, it would be refused forever.
    bucket = TokenBucket(rate=10.0, size=5.0, reserve=0.5, now=0.0)
    assert bucket.take(21.0, critical=False, now=0.0) == 0.0
    wait = bucket.take(1.0, critical=False, now=0.0)
    assert wait == pytest.approx((16.0 + 1.0 + 0.5) / 10)  # the debt is repaid first
    assert bucket.take(1.0, critical=False, now=wait) == 0.0  # as Retry-After said
    dear = bucket.take(21.0, critical=False, now=wait)
    assert dear == pytest.approx((5.0 - 0.5) / 10)  # until the bucket is full again
    assert bucket.take(21.0, critical=False, now=wait + dear) == 0.0


async def test_queue_buffers_at_most_an_interval_of_non_critical_work() -> None:
    admission, batcher = make(capacity=1000)  # 1 ms an item, interval 100 ms
    now = asyncio.get_running_loop().time()
    fill(batcher, 90)
    assert not batcher.standing(now)
    admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)  # 90 ms ahead: joins
    fill(batcher, 60)  # 150 ms of work: more than the interval, not standing yet
    with pytest.raises(VegaError) as full:
        admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)
    assert full.value.code == "queue_full" and full.value.status == 429
    assert full.value.retry_after_ms == pytest.approx(50.0)  # until it fits again
    with pytest.raises(VegaError) as shed:
        admission.admit(SHEDDABLE, [0], deadline=now + 100.0, now=now)
    assert shed.value.code == "shed"
    admission.admit(CRITICAL, [0], deadline=now + 100.0, now=now)  # critical is not capped
    assert batcher.depth() == 150  # a refusal queues nothing


async def test_a_model_slower_than_the_interval_may_queue_two_of_its_batches() -> None:
    # Batches of 0.5 s or more against an interval of 0.1 s: the interval in force is two
    # batch times, so a partial batch's worth queued behind the running one does not
    # refuse the next caller, and a queue past two batches still does.
    admission, batcher = make(capacity=1000, per_item_ms=500.0)
    now = asyncio.get_running_loop().time()
    fill(batcher, 1)
    with pytest.raises(VegaError):  # the configured interval: 0.5 s of work is too much
        admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)
    batcher.fit_interval(0.5, weight=1.0)  # what warm-up measures
    admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)
    fill(batcher, 8)  # three batches of work
    with pytest.raises(VegaError) as full:
        admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)
    assert full.value.code == "queue_full"


async def test_standing_queue_keeps_non_critical_to_a_few_batches_of_work() -> None:
    admission, batcher = make(capacity=1000)
    # Read before filling: a collection during the fill (this process may hold torch by
    # now) can take longer than the 100 ms interval, and the queue would look standing.
    now = asyncio.get_running_loop().time()
    fill(batcher, 100)  # 100 ms of work ahead
    admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)  # not standing yet: fine
    later = now + 1.0  # the queue has not emptied for a second: standing
    assert batcher.standing(later)
    with pytest.raises(VegaError) as caught:
        admission.admit(NORMAL, [0], deadline=later + 100.0, now=later)
    # One bucket queued: one full batch of it is kept (4 ms), or VEGA_CODEL_TARGET_MS
    # (5 ms) where that is more; the rest is refused now.
    assert caught.value.code == "queue_full"
    assert caught.value.retry_after_ms == pytest.approx(100 - 5, abs=1)
    with pytest.raises(VegaError) as shed:
        admission.admit(SHEDDABLE, [0], deadline=later + 100.0, now=later)
    assert shed.value.code == "shed"
    admission.admit(CRITICAL, [0], deadline=later + 100.0, now=later)  # critical still joins


async def test_a_standing_queue_keeps_one_full_batch_of_one_bucket_two_of_several() -> None:
    # 7 short items queued (1.75 batches, 70 ms): a request for the same bucket would
    # make the queue longer than the one batch that keeps its pipeline; one for the
    # long bucket brings a second kind, whose batch forms apart, and two are kept.
    admission, batcher = make(capacity=100, per_item_ms=10.0)
    fill(batcher, 7, bucket=0)
    now = asyncio.get_running_loop().time() + 1.0
    assert batcher.standing(now)
    with pytest.raises(VegaError) as refused:
        admission.admit(NORMAL, [0], deadline=now + 100.0, now=now)
    assert refused.value.code == "queue_full" and "kept short" in refused.value.message
    admission.admit(NORMAL, [1], deadline=now + 100.0, now=now)
    admission.admit(NORMAL, [0, 1], deadline=now + 100.0, now=now)


def mixed(interval_s: float = 0.1) -> tuple[Admission, Batcher]:
    """Five buckets whose batches cost 2 ms fixed plus a per-item part growing with length."""
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 32, 64, 128, 256),
                                    max_batch_size=32, max_wait_s=0.005, max_inflight=1,
                                    standing_after_s=interval_s), _never)
    for bucket, per_item_ms in enumerate((0.05, 0.05, 0.13, 0.4, 0.9)):
        for size in (1, 16, 32):
            seconds = (2.0 + per_item_ms * size) / 1000
            batcher.times.observe(bucket, size, seconds)
            batcher.rate.observe(size, size * batcher.item_cost(bucket), seconds)
    config = AdmissionConfig(queue_capacity=1024, shed_watermark=0.5, normal_watermark=0.9,
                             rate_limit=0.0, burst=0.0, margin_s=0.002)
    return Admission(config, batcher, now=0.0), batcher


async def test_short_partial_batches_over_several_buckets_are_not_refused() -> None:
    # 64 closed-loop callers at mixed lengths: a dozen items in each bucket, a queue the
    # server works through in a few batches. Neither the interval cap nor, once the
    # queue stands, the kept-short rule may take it for a long one.
    admission, batcher = mixed()
    for bucket in range(5):
        fill(batcher, 12, bucket=bucket)
    assert batcher.backlog_s() < 0.03
    loop = asyncio.get_running_loop()
    now = loop.time()
    for bucket in range(5):
        admission.admit(NORMAL, [bucket], deadline=now + 1.0, now=now)
    standing = now + 0.2  # the queue has not emptied for two intervals
    assert batcher.standing(standing)
    admission.admit(NORMAL, [0], deadline=standing + 1.0, now=standing)


async def test_a_truly_long_backlog_over_several_buckets_is_still_refused() -> None:
    admission, batcher = mixed()
    for bucket in range(5):
        fill(batcher, 100, bucket=bucket)  # ~150 ms of work, past the 100-ms interval
    assert batcher.backlog_s() > 0.1
    now = asyncio.get_running_loop().time()
    with pytest.raises(VegaError) as refused:
        admission.admit(NORMAL, [0], deadline=now + 1.0, now=now)
    assert refused.value.code == "queue_full" and refused.value.status == 429
    admission.admit(CRITICAL, [0], deadline=now + 1.0, now=now)  # critical is not capped


async def test_under_a_standing_queue_two_full_batches_of_items_are_always_kept() -> None:
    # The short bucket's batches have a large fixed cost, so the predicted work of a
    # queue under two batches of items passes two batch times of the longest bucket:
    # still admitted (the pipeline needs them); one item more is refused.
    batcher = Batcher(BatcherConfig(model="m", buckets=(16, 512), max_batch_size=4,
                                    max_wait_s=0.005, max_inflight=1,
                                    standing_after_s=0.1), _never)
    for size in (1, 4):
        batcher.times.observe(0, size, 0.050 + 0.0001 * size)
        batcher.times.observe(1, size, 0.001 + 0.001 * size)
    config = AdmissionConfig(queue_capacity=100, shed_watermark=0.5, normal_watermark=0.9,
                             rate_limit=0.0, burst=0.0, margin_s=0.0)
    admission = Admission(config, batcher, now=0.0)
    fill(batcher, 3, bucket=0)
    fill(batcher, 4, bucket=1)
    now = asyncio.get_running_loop().time() + 0.2
    assert batcher.standing(now) and batcher.backlog_s() > 2 * batcher.times.predict(1, 4)
    admission.admit(NORMAL, [0], deadline=now + 10, now=now)  # the 8th item: two batches
    fill(batcher, 1, bucket=0)
    with pytest.raises(VegaError) as refused:
        admission.admit(NORMAL, [0], deadline=now + 10, now=now)
    assert refused.value.code == "queue_full"
