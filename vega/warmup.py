"""Warm-up: time every batch shape to seed the predictor, then cut the length buckets
from what was measured. The runtime and the simulator both start a model this way."""

from __future__ import annotations

import logging
from collections.abc import Callable

from vega.batcher import Batcher
from vega.buckets import plan_bounds
from vega.config import Settings

log = logging.getLogger("vega.warmup")


def planned(batcher: Batcher, s: Settings) -> Batcher:
    """The warmed-up batcher, its length buckets cut again from what warm-up measured."""
    bounds = plan_bounds(batcher.config.buckets, batcher.times, s.max_batch_size,
                         s.bucket_padding)
    if bounds == batcher.config.buckets:
        return batcher
    log.info("model %s: length buckets %s from the measured costs",
             batcher.config.model, ",".join(map(str, bounds)))
    return batcher.rebucketed(bounds)


def seed_batch_times(batcher: Batcher, passes: int,
                     measure: Callable[[int, int], float]) -> None:
    """Warm-up: time every (bucket, size in {1, half, max}) shape ``passes`` times.

    ``measure(bound, size)`` runs one batch and returns its seconds; its first call per
    shape is untimed (lazy initialisation), the others seed the predictor and the rate.
    """
    if passes == 0:
        return
    top = batcher.config.max_batch_size
    for bucket, bound in enumerate(batcher.config.buckets):
        for size in sorted({1, max(1, top // 2), top}):
            measure(bound, size)
            for _ in range(passes):
                seconds = measure(bound, size)
                batcher.times.observe(bucket, size, seconds)
                batcher.rate.observe(size, size * batcher.item_cost(bucket), seconds)
