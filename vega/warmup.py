"""Warm-up: time every batch shape to seed the predictor, then cut the length buckets
from what was measured. The runtime and the simulator both start a model this way."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from vega.batcher import Batcher
from vega.buckets import line_at, plan_bounds
from vega.config import Settings
from vega.errors import VegaError
from vega.modelproc.handle import ModelRaised
from vega.models import ModelAdapter, min_length
from vega.models.loader import ModelLoadError

log = logging.getLogger("vega.warmup")

T = TypeVar("T")


def planned(batcher: Batcher, s: Settings) -> Batcher:
    """The warmed-up batcher, its length buckets cut again from what warm-up measured."""
    bounds = plan_bounds(batcher.config.buckets, batcher.times, s.max_batch_size,
                         s.bucket_padding, least=batcher.config.min_length)
    if bounds == batcher.config.buckets:
        return batcher
    log.info("model %s: length buckets %s from the measured costs",
             batcher.config.model, ",".join(map(str, bounds)))
    return rebucketed(batcher, bounds)


def seed_batch_times(batcher: Batcher, passes: int,
                     measure: Callable[[int, int], float]) -> None:
    """Warm-up: time every (bucket, size in {1, half, max}) shape ``passes`` times.

    ``measure(bound, size)`` runs one batch and returns its seconds; its first call per
    shape is untimed (lazy initialisation), the others seed the predictor and the rate.
    The passes go ``in_turn``: the buckets are cut from what shapes cost relative to each
    other, not from when each was timed.
    """
    if passes == 0:
        return
    top = batcher.config.max_batch_size
    shapes = [(bucket, bound, size) for bucket, bound in enumerate(batcher.config.buckets)
              for size in sorted({1, max(1, top // 2), top})]
    for _bucket, bound, size in shapes:
        measure(bound, size)
    for bucket, bound, size in in_turn(shapes, passes):
        seconds = measure(bound, size)
        batcher.times.observe(bucket, size, seconds)
        batcher.rate.observe(size, size * batcher.item_cost(bucket), seconds)
    settle(batcher)


def warm_up_failed(adapter: ModelAdapter, bound: int, size: int,
                   error: Exception) -> Exception:
    """What stops the start when the model raised on a warm-up batch: the shape it was
    given, and the setting that may fix it (a draining stop passes as it is)."""
    if isinstance(error, VegaError):
        return error
    if size == 1:
        hint = (f"windows of {min_length(adapter)}..{adapter.max_length} steps are accepted; "
                "a module that takes fewer says so with vega_max_length (and vega_min_length)")
    else:
        hint = (f"a lone window of {bound} steps ran: VEGA_MAX_BATCH_SIZE may be more than "
                "it can take")
    raised = str(error) if isinstance(error, ModelRaised) else f"{type(error).__name__}: {error}"
    return ModelLoadError(f"model {adapter.name!r} failed warming up on a batch of {size} x "
                          f"{bound} steps ({raised}): {hint}")


def in_turn(shapes: Sequence[T], passes: int) -> Iterator[T]:
    """``passes`` passes over ``shapes``, every other one in reverse: a machine that speeds
    up or slows down while they are timed moves every shape alike (a steady drift cancels)."""
    for number in range(passes):
        yield from shapes if number % 2 == 0 else reversed(shapes)


def rebucketed(batcher: Batcher, bounds: tuple[int, ...]) -> Batcher:
    """``batcher`` with other length bounds, before it runs; the new buckets'
    predictor and service rate are seeded from this one's lines, by length."""
    assert not batcher.inflight and not batcher.depth(), "rebucket before serving"
    other = batcher.with_config(dataclasses.replace(batcher.config, buckets=bounds))
    top = batcher.config.max_batch_size
    lines = [line_at(batcher.config.buckets, batcher.times, bound) for bound in bounds]
    sizes = sorted({1, max(1, top // 2), top})
    for bucket, line in enumerate(lines):
        for size in sizes:
            other.times.observe(bucket, size, line.at(size))
    for bucket, line in enumerate(lines):
        for size in sizes:
            other.rate.observe(size, size * other.item_cost(bucket), line.at(size))
    settle(other)
    return other


def settle(batcher: Batcher) -> None:
    """Seeded: served batches take over the drift, and the interval starts from the
    least a batch takes (one item of the shortest bucket)."""
    batcher.times.settle()
    batcher.fit_interval(batcher.times.predict(0, 1), weight=1.0)
