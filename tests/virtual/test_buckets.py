"""Length buckets cut from measured costs, with made-up cost tables."""

from __future__ import annotations

import pytest

from tests.virtual.test_batcher import (
    RecordingSink,
    config,
    costed,
    formed_once,
    held,
    item,
)
from vega.batcher import Batcher
from vega.buckets import length_bounds, line_at, per_item_s, plan_bounds, shares
from vega.timing import BatchTimes
from vega.warmup import rebucketed, seed_batch_times

BOUNDS = (16, 32, 64, 128, 256, 512)


def table(cost: dict[int, tuple[float, float]]) -> BatchTimes:
    """A predictor whose bucket at bound b costs ``fixed + per_item * size`` seconds."""
    times = BatchTimes(len(BOUNDS))
    for bucket, bound in enumerate(BOUNDS):
        fixed, per_item = cost[bound]
        for size in (1, 16, 32):
            times.observe(bucket, size, fixed + per_item * size)
    return times


def linear(fixed_s: float = 0.001, per_step_s: float = 1e-5) -> BatchTimes:
    """Per-item cost proportional to the window's length."""
    return table({b: (fixed_s, per_step_s * b) for b in BOUNDS})


def test_where_cost_is_flat_one_bucket_holds_every_length() -> None:
    flat = table(dict.fromkeys(BOUNDS, (0.002, 0.0001)))
    assert plan_bounds(BOUNDS, flat, 32, padding=0.25) == (512,)


def test_where_cost_grows_with_length_no_bucket_pads_past_the_allowance() -> None:
    times = linear()
    bounds = plan_bounds(BOUNDS, times, 32, padding=0.25)
    assert bounds[-1] == 512 and len(bounds) > len(BOUNDS)  # finer than powers of two
    assert all(b % 8 == 0 for b in bounds) and list(bounds) == sorted(set(bounds))
    for low, high in zip(bounds, bounds[1:]):
        # The shortest item of bucket (low, high] padded to high costs at most 25% more.
        shortest = low + 1
        cost = per_item_s(BOUNDS, times, shortest, 32)
        assert per_item_s(BOUNDS, times, high, 32) <= 1.25 * cost * (1 + 8 / shortest)


def test_a_looser_allowance_gives_fewer_buckets() -> None:
    times = linear()
    assert len(plan_bounds(BOUNDS, times, 32, 1.0)) < len(plan_bounds(BOUNDS, times, 32, 0.25))


def test_no_bucket_is_cut_below_the_fewest_steps_the_model_takes() -> None:
    times = linear()
    finest = plan_bounds(BOUNDS, times, 32, padding=0.25)
    assert finest[0] < 40  # cut where nothing shorter than 40 steps is ever queued
    least = plan_bounds(BOUNDS, times, 32, padding=0.25, least=40)
    assert least[0] >= 40 and least == tuple(b for b in finest if b >= 40)
    assert length_bounds(BOUNDS, 512, 40) == (64, 128, 256, 512)
    assert length_bounds(BOUNDS, 100, 1) == (16, 32, 64, 100)


@pytest.mark.parametrize("padding", [0.0, -1.0])
def test_no_allowance_keeps_the_configured_bounds(padding: float) -> None:
    assert plan_bounds(BOUNDS, linear(), 32, padding) == BOUNDS


def test_unmeasured_buckets_keep_the_configured_bounds() -> None:
    assert plan_bounds(BOUNDS, BatchTimes(len(BOUNDS)), 32, 0.25) == BOUNDS


def test_lines_between_measured_bounds_are_interpolated_by_length() -> None:
    times = table({16: (0.001, 0.0001), 32: (0.001, 0.0001), 64: (0.001, 0.0001),
                   128: (0.002, 0.001), 256: (0.004, 0.003), 512: (0.004, 0.003)})
    line = line_at(BOUNDS, times, 192)
    assert line.fixed_s == pytest.approx(0.003) and line.per_item_s == pytest.approx(0.002)
    assert line_at(BOUNDS, times, 8).per_item_s == pytest.approx(0.0001)  # below: the first
    assert line_at(BOUNDS, times, 512).fixed_s == pytest.approx(0.004)


def test_a_short_queue_s_neighbours_share_a_batch_a_deep_one_s_do_not() -> None:
    # 5 ms a batch, plus 0.1 ms (bucket 0) or 0.2 ms (bucket 1) an item.
    def predict(bucket: int, size: int) -> float:
        return 0.005 + (0.0001, 0.0002)[bucket] * size

    # Four items each: apart, bucket 1's would pay a batch's fixed cost for themselves.
    assert shares(0, [4, 4], 32, predict) == {0: 4, 1: 4}
    # Beside 30 of bucket 0's items, padding those to bucket 1's bound costs more than
    # the pass bucket 1's items would otherwise need.
    assert shares(0, [30, 4], 32, predict) == {0: 30}
    assert shares(1, [0, 4], 32, predict) == {1: 4}  # nothing queued beside it


async def test_a_rebucketed_batcher_predicts_from_the_measured_lines() -> None:
    batcher = Batcher(config(buckets=(64, 512), max_batch_size=4), RecordingSink())
    costed(batcher, {0: (0.001, 0.001), 1: (0.001, 0.009)})
    other = rebucketed(batcher, (64, 288, 512))
    assert other.config.buckets == (64, 288, 512)
    assert other.times.predict(1, 4) == pytest.approx(0.001 + 4 * 0.005)
    assert other.times.predict(2, 4) == pytest.approx(batcher.times.predict(1, 4))
    assert other.rate.items_per_s > 0
    assert other.item_cost(2) == pytest.approx(batcher.item_cost(1))


async def test_an_idle_thread_takes_the_cheapest_group_first_unless_one_is_overdue() -> None:
    def started(long_age_s: float) -> tuple[Batcher, RecordingSink]:
        # Long windows cost 10 ms an item: a batch of them serves 100 items a second,
        # one of the short ones ~1,900.
        batcher, sink = held({0: (0.001, 0.0001), 1: (0.001, 0.0005), 2: (0.001, 0.01)})
        old = item(batcher, length=300)
        old.enqueued_at -= long_age_s
        return batcher, sink

    batcher, sink = started(long_age_s=0.0)
    for _ in range(2):
        item(batcher, length=10)
    batch = await formed_once(batcher, sink)
    assert [i.length for i in batch.items] == [10, 10]
    batcher, sink = started(long_age_s=1.0)  # past two of its own batch times (2 x 41 ms)
    item(batcher, length=10)
    batch = await formed_once(batcher, sink)
    assert [i.length for i in batch.items] == [300]


async def test_a_passed_over_item_goes_first_before_a_standing_queue_would_shed_it() -> None:
    # Long windows cost 100 ms an item: two of their batches' time (0.8 s) is far past
    # the CoDel interval (0.1 s), after which a standing queue sheds a waiting item.
    batcher, sink = held({0: (0.001, 0.0001), 1: (0.001, 0.0005), 2: (0.001, 0.1)})
    old = item(batcher, length=300)
    old.enqueued_at -= 0.03  # past a quarter of the interval: two batches still fit in it
    item(batcher, length=10)
    batch = await formed_once(batcher, sink)
    assert [i.length for i in batch.items] == [300]


def test_warm_up_on_a_machine_that_slows_down_skews_no_bucket_against_another() -> None:
    # The machine slows steadily, to half speed by the end of warm-up. Timed shape by
    # shape, the last buckets would look ~2x as dear as the first against their cost.
    batcher = Batcher(config(buckets=BOUNDS, max_batch_size=32), RecordingSink())
    calls: list[tuple[int, int]] = []
    shapes_timed = len(BOUNDS) * 3  # sizes 1, 16 and 32

    def cost(bound: int, size: int) -> float:
        return 0.001 + 1e-5 * bound * size

    def measure(bound: int, size: int) -> float:
        calls.append((bound, size))
        return (1 + len(calls) / (3 * shapes_timed)) * cost(bound, size)

    seed_batch_times(batcher, 2, measure)
    assert len(calls) == 3 * shapes_timed  # one untimed call per shape, then two passes
    skew = [batcher.times.predict(bucket, size) / cost(bound, size)
            for bucket, bound in enumerate(BOUNDS) for size in (1, 32)]
    assert max(skew) / min(skew) == pytest.approx(1.0, abs=0.01)
