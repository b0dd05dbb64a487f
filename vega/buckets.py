"""Length buckets cut from measured costs: what padding costs against what a pass costs.

Warm-up measures batch times at the configured bounds (``VEGA_LENGTH_BUCKETS``). From
them, ``plan_bounds`` cuts the bounds again so that an item padded to its bucket's
bound costs at most ``padding`` more per item than at its own length, save items less
than ``STEP`` past the bound below (a bound one step higher served 2% less in the
simulator): fine where cost grows steeply with length, one wide bucket where it is
flat. Neighbouring buckets still share a batch when padding costs less than the pass
the items would otherwise need (the batcher), so fine buckets do not leave batches
small at a short queue.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from vega.timing import BatchTimes, Line

STEP = 8  # bounds are multiples of this many steps


def length_bounds(configured: tuple[int, ...], max_length: int,
                  min_length: int = 1) -> tuple[int, ...]:
    """The length buckets served: the configured bounds within the model's shortest and
    longest inputs, and that longest input."""
    return tuple(b for b in configured if min_length <= b < max_length) + (max_length,)


def plan_bounds(bounds: Sequence[int], times: BatchTimes, size: int, padding: float,
                step: int = STEP, least: int = 1) -> tuple[int, ...]:
    """Upper bounds, the longest kept, within ``padding`` of each other's per-item cost.

    ``times`` holds a line per configured bound; ``size`` is the batch size the per-item
    costs are compared at (a full batch). ``padding`` <= 0 keeps the configured bounds.
    No bound is cut below ``least``, the shortest window the model takes.
    """
    if padding <= 0 or not all(times.line(b) is not None for b in range(len(bounds))):
        return tuple(bounds)
    # A longer window never costs less: measurement noise in a flat stretch of the
    # curve must not cut buckets there.
    costs = [per_item_s(bounds, times, bound, size) for bound in bounds]
    costs = [max(costs[: index + 1]) for index in range(len(costs))]

    def cost(length: int) -> float:
        index = bisect.bisect_left(bounds, length)
        if index == 0:
            return costs[0]
        if index == len(bounds):
            return costs[-1]
        share = (length - bounds[index - 1]) / (bounds[index] - bounds[index - 1])
        return costs[index - 1] + share * (costs[index] - costs[index - 1])

    planned = [bounds[-1]]
    high = bounds[-1]
    lowest = max(step, least)
    while True:
        floor = cost(high) / (1 + padding)
        below = (high - 1) // step * step
        while below >= lowest and cost(below) >= floor:
            below -= step
        if below < lowest:
            return tuple(reversed(planned))
        planned.append(below)
        high = below


def line_at(bounds: Sequence[int], times: BatchTimes, length: int) -> Line:
    """The batch-time line at ``length``, interpolated between the measured bounds."""
    index = bisect.bisect_left(bounds, length)
    if index == 0 or index == len(bounds):
        line = times.line(min(index, len(bounds) - 1))
        assert line is not None
        return line
    lower, upper = times.line(index - 1), times.line(index)
    assert lower is not None and upper is not None
    share = (length - bounds[index - 1]) / (bounds[index] - bounds[index - 1])
    return Line(lower.fixed_s + share * (upper.fixed_s - lower.fixed_s),
                lower.per_item_s + share * (upper.per_item_s - lower.per_item_s))


def per_item_s(bounds: Sequence[int], times: BatchTimes, length: int, size: int) -> float:
    return line_at(bounds, times, length).at(size) / size


def shares(bucket: int, depth: Sequence[int], cap: int,
           predict: Callable[[int, int], float]) -> dict[int, int]:
    """How many items each bucket gives the batch formed for ``bucket``.

    ``depth`` is the items queued per bucket, ``cap`` the batch's largest size and
    ``predict(bucket, size)`` a batch's predicted seconds. A partial batch takes in the
    nearest non-empty bucket on either side while adding its items, padded, is predicted
    to cost less than their share of the batch they would join if left (the rest of the
    queue, up to a full batch): measured costs decide.
    """
    size = min(cap, depth[bucket])
    taken = {bucket: size}
    low = high = bucket
    while size < cap:
        best: tuple[float, int, int] | None = None
        below = next((b for b in range(low - 1, -1, -1) if depth[b]), None)
        above = next((b for b in range(high + 1, len(depth)) if depth[b]), None)
        for other in (below, above):
            if other is None:
                continue
            count = min(cap - size, depth[other])
            left = min(cap, max(count, sum(depth) - size))  # the batch they would join
            saved = predict(high, size) + count * predict(other, left) / left \
                - predict(max(high, other), size + count)
            if saved > 0 and (best is None or saved > best[0]):
                best = (saved, other, count)
        if best is None:
            return taken
        _, other, count = best
        taken[other] = count
        size += count
        low, high = min(low, other), max(high, other)
    return taken
