"""The batch-time predictor (rule 2): lines fitted per bucket, and the drain of a queue."""

from __future__ import annotations

import pytest

from vega.timing import BatchTimes, ServiceRate


def seeded(lines: dict[int, tuple[float, float]], buckets: int) -> BatchTimes:
    """A predictor whose bucket b costs ``fixed + per_item * size`` seconds (exactly)."""
    times = BatchTimes(buckets)
    for bucket, (fixed, per_item) in lines.items():
        for size in (1, 8, 32):
            times.observe(bucket, size, fixed + per_item * size)
    return times


def test_a_line_is_fitted_from_measured_batches() -> None:
    times = seeded({0: (0.002, 0.0001)}, 1)
    assert times.predict(0, 16) == pytest.approx(0.002 + 0.0016)
    line = times.line(0)
    assert line is not None and line.fixed_s == pytest.approx(0.002)


def test_an_unmeasured_bucket_borrows_the_next_longer_line() -> None:
    times = seeded({2: (0.004, 0.001)}, 3)
    assert times.predict(0, 4) == pytest.approx(times.predict(2, 4))


def test_partial_batches_of_several_buckets_pay_one_fixed_cost_per_batch() -> None:
    # Three buckets with 5 items each: they share one batch of up to 32, so the queue
    # costs one fixed part, not three (nor three full batches).
    times = seeded({0: (0.002, 0.0001), 1: (0.002, 0.0002), 2: (0.003, 0.0004)}, 3)
    drained = times.drain_s([5, 5, 5], max_size=32)
    assert drained == pytest.approx(0.003 + 5 * (0.0001 + 0.0002 + 0.0004))
    assert drained < sum(times.predict(b, 5) for b in range(3))


def test_full_batches_are_counted_at_their_size() -> None:
    times = seeded({0: (0.002, 0.0001)}, 1)
    assert times.drain_s([70], max_size=32) == pytest.approx(
        2 * times.predict(0, 32) + 6 * 0.0001 + 0.002)
    assert times.drain_s([0], max_size=32) == 0.0


def test_the_line_follows_the_last_window_of_batches() -> None:
    # The model got twice as slow (a noisy neighbour, a clock change): after a window of
    # new measurements the old ones no longer count.
    times = BatchTimes(1, window=8)
    for size in (1, 8, 32, 16):
        times.observe(0, size, 0.002 + 0.0001 * size)
    for size in (1, 8, 32, 16) * 2:
        times.observe(0, size, 2 * (0.002 + 0.0001 * size))
    line = times.line(0)
    assert line is not None and line.at(16) == pytest.approx(2 * (0.002 + 0.0016))


def test_batches_of_one_size_keep_the_line_s_shape() -> None:
    # Light traffic: a window of batches of one. Through the origin, a batch of 32 would
    # be predicted at 32 of them (and an item's admission cost with it).
    times = seeded({0: (0.010, 0.0001)}, 1)
    for _ in range(64):
        times.observe(0, 1, 0.0121)  # a fifth slower than warm-up saw
    assert times.predict(0, 1) == pytest.approx(0.0121, rel=0.02)
    assert times.predict(0, 32) < 1.5 * times.predict(0, 1)  # not 32 times


def warmed(buckets: int) -> BatchTimes:
    """Lines for ``buckets`` buckets, each batch of size n in bucket b taking (b+1)(2 + n/10)
    ms, as a warm-up and some serving leave them."""
    times = BatchTimes(buckets)
    for bucket in range(buckets):
        for size in (1, 16, 32) * 10:
            times.observe(bucket, size, (bucket + 1) * (0.002 + 0.0001 * size))
    times.settle()
    return times


def test_a_host_slowing_every_bucket_is_seen_within_a_few_batches() -> None:
    # A burst's onset: the loop and the load take two thirds of the model's core, and every
    # batch takes three times its line. Six batches of two buckets tell all the buckets.
    times = warmed(4)
    for bucket in (0, 1) * 3:
        times.observe(bucket, 16, 3 * (bucket + 1) * 0.0036)
    assert times.drift == pytest.approx(3.0, rel=0.15)  # the lines have moved a little too
    assert times.predict(3, 32) == pytest.approx(3 * 4 * 0.0052, rel=0.15)
    assert times.drain_s([0, 0, 0, 32], 32) == pytest.approx(3 * 4 * 0.0052, rel=0.15)
    # And as the host frees up again, so do the predictions.
    for bucket in (2, 3) * 5:
        times.observe(bucket, 16, (bucket + 1) * 0.0036)
    assert times.drift == pytest.approx(1.0, rel=0.1)


def test_one_batch_held_up_moves_no_prediction() -> None:
    # A collection, or the scheduler giving the core away for 100 ms, in one batch.
    times = warmed(2)
    before = times.predict(1, 32)
    times.observe(0, 16, 0.1)
    assert times.drift == 1.0 and times.predict(1, 32) == pytest.approx(before, rel=0.05)


def test_a_line_tilted_by_one_noisy_partial_batch_is_not_trusted() -> None:
    # Full batches at 12 ms and one partial batch that ran fast: the least-squares slope
    # is 4 ms an item (a fixed cost of -116 ms), and 20 queued items would be predicted
    # at 80 ms, most of a CoDel interval, where they cost less than a full batch.
    times = BatchTimes(1)
    for _ in range(30):
        times.observe(0, 32, 0.012)
    times.observe(0, 31, 0.008)
    line = times.line(0)
    assert line is not None and line.fixed_s >= 0
    assert times.drain_s([20], max_size=32) < times.predict(0, 32)
    assert times.predict(0, 32) == pytest.approx(0.012, rel=0.02)


def test_a_cost_that_does_not_grow_with_the_batch_is_predicted_flat() -> None:
    # A GPU below its width, or a model that waits: 40 ms whatever the size, batches of
    # 1..4 with a little noise, so the least-squares slope comes out just below zero.
    # The mean cost per item (16 ms at a mean size of 2.5) would put a full batch of 4
    # at 64 ms, and 8 queued items at 128 ms: past a 100-ms interval at half the load.
    times = BatchTimes(1)
    for size, seconds in [(1, 0.041), (2, 0.040), (3, 0.040), (4, 0.039)] * 5:
        times.observe(0, size, seconds)
    assert times.predict(0, 4) == pytest.approx(0.040, rel=0.03)
    assert times.predict(0, 1) == pytest.approx(0.040, rel=0.03)
    assert times.drain_s([8], max_size=4) == pytest.approx(0.080, rel=0.03)


def test_nothing_measured_predicts_nothing() -> None:
    times = BatchTimes(2)
    assert times.predict(1, 32) == 0.0 and not times.measured()
    times.observe(0, 4, 0.01)
    assert times.measured() and times.predict(1, 4) == pytest.approx(0.01)


def test_service_rate_counts_every_thread_over_a_sliding_window() -> None:
    rate = ServiceRate(parallelism=2, window=2)
    assert rate.items_per_s == 0.0
    rate.observe(items=10, cost=20.0, seconds=0.1)
    rate.observe(items=10, cost=20.0, seconds=0.1)
    assert rate.items_per_s == pytest.approx(200.0) and rate.cost_per_s == pytest.approx(400.0)
    rate.observe(items=30, cost=30.0, seconds=0.1)  # the first batch leaves the window
    assert rate.items_per_s == pytest.approx(2 * 40 / 0.2)
