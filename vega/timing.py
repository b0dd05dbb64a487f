"""Measured batch times: a predictor per length bucket and the service rate.

Rule 2 of DESIGN.md: predict batch time per (length bucket, batch size) from recent
measurements, never from a constant. Each bucket keeps its last ``window`` batches
and fits ``seconds = fixed + per_item * size`` by least squares (BentoML's
dispatcher does the same), held to a line that can be true (neither falling nor below
the origin); with one distinct size it scales the line it had to that size's mean.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    fixed_s: float
    per_item_s: float

    def at(self, size: int) -> float:
        return max(0.0, self.fixed_s + self.per_item_s * size)


DRIFT_BATCHES = 9  # the drift is the median over this many recent batches, of any bucket
DRIFT_CAP = 8.0


class BatchTimes:
    """Least-squares batch time per bucket over a sliding window of measurements, times
    the drift: what the recent batches of every bucket took against their lines.

    A bucket's line turns over in ``window`` of its own batches, seconds when the batches
    spread over many buckets; a host whose cores suddenly go to other work (a burst's
    onset, the loop and the load beside the model) slows every bucket at once, and the
    drift sees that within a few batches of any of them. The median: one batch held up
    by a collection or a preemption moves nothing."""

    def __init__(self, buckets: int, window: int = 64) -> None:
        self._samples: list[deque[tuple[int, float]]] = [deque(maxlen=window)
                                                         for _ in range(buckets)]
        self._lines: list[Line | None] = [None] * buckets
        self._ratios: deque[float] = deque(maxlen=DRIFT_BATCHES)
        self.drift = 1.0
        self.settle()

    def observe(self, bucket: int, size: int, seconds: float) -> None:
        expected_s = line.at(size) if (line := self._lines[bucket]) is not None else 0.0
        if expected_s > 0:
            self._ratios.append(min(DRIFT_CAP, seconds / expected_s))
            self.drift = sorted(self._ratios)[len(self._ratios) // 2]
            # Capped as the drift is: one batch held up 10 s would lift its bucket's line
            # until a window of batches passed, and none passes while that line refuses
            # every request of the bucket.
            seconds = min(seconds, DRIFT_CAP * expected_s)
        samples = self._samples[bucket]
        samples.append((size, seconds))
        self._lines[bucket] = _fit(samples, self._lines[bucket])

    def settle(self) -> None:
        """Start the drift afresh (the lines were just seeded by a warm-up, not served):
        batches as their lines say, until served ones say otherwise."""
        self._ratios.extend([1.0] * DRIFT_BATCHES)
        self.drift = 1.0

    def line(self, bucket: int) -> Line | None:
        return self._lines[bucket]

    def predict(self, bucket: int, size: int) -> float:
        """Seconds for a batch of ``size`` in ``bucket``; borrows from neighbours if unmeasured."""
        line = self._lines[bucket]
        if line is None:
            line = self._nearest(bucket)
        return line.at(size) * self.drift if line is not None else 0.0

    def drain_s(self, counts: list[int], max_size: int) -> float:
        """Seconds to run ``counts[bucket]`` items of each bucket in batches of up to ``max_size``.

        Full batches at their size; the partial ones that are left share batches (the
        batcher leaves them to share the fixed cost of a batch with the rest of the queue),
        so their fixed cost is paid once per ``max_size`` of them, not once per bucket.
        """
        seconds = fixed = 0.0
        rest_total = 0
        for bucket, items in enumerate(counts):
            if not items:
                continue
            line = self._lines[bucket] or self._nearest(bucket)
            if line is None:
                continue
            full, rest = divmod(items, max_size)
            seconds += full * line.at(max_size) + rest * line.per_item_s
            if rest:
                rest_total += rest
                fixed = max(fixed, line.fixed_s)
        return (seconds + fixed * -(-rest_total // max_size)) * self.drift

    def per_item_s(self, bucket: int, size: int) -> float:
        return self.predict(bucket, size) / max(1, size)

    def measured(self) -> bool:
        return any(line is not None for line in self._lines)

    def _nearest(self, bucket: int) -> Line | None:
        # A longer bucket's line over-predicts a shorter one: the safe side for deadlines.
        for other in list(range(bucket + 1, len(self._lines))) + list(range(bucket - 1, -1, -1)):
            if self._lines[other] is not None:
                return self._lines[other]
        return None


def _fit(samples: deque[tuple[int, float]], before: Line | None = None) -> Line:
    n = len(samples)
    mean_x = sum(size for size, _ in samples) / n
    mean_y = sum(seconds for _, seconds in samples) / n
    var_x = sum((size - mean_x) ** 2 for size, _ in samples)
    if var_x == 0:
        # One size says nothing of the slope: keep the line's shape (light traffic runs
        # batches of one; through the origin, a full batch would cost 32 of them).
        if before is not None and (expected := before.at(int(mean_x))) > 0:
            scale = mean_y / expected
            return Line(before.fixed_s * scale, before.per_item_s * scale)
        return Line(0.0, mean_y / mean_x)
    slope = sum((size - mean_x) * (seconds - mean_y) for size, seconds in samples) / var_x
    fixed = mean_y - slope * mean_x
    # The nearest line that can be true: a batch never gets cheaper with more items, and
    # never costs less than nothing to start. A falling line is a cost that does not grow
    # with the batch (a GPU below its width, a fixed wait): flat at the mean, as the mean
    # cost per item would charge a full batch max/mean-size times what it costs. A line
    # below the origin is a noisy partial batch among full ones (their sizes barely vary):
    # the mean cost per item, or a queued partial item costs many times its share.
    if slope <= 0:
        return Line(mean_y, 0.0)
    if fixed < 0:
        return Line(0.0, mean_y / mean_x)
    return Line(fixed, slope)


class ServiceRate:
    """Items and cost units completed per second of executor time, over recent batches."""

    def __init__(self, parallelism: int, window: int = 128) -> None:
        self.parallelism = parallelism
        self._batches: deque[tuple[int, float, float]] = deque(maxlen=window)
        self._items = 0
        self._cost = 0.0
        self._seconds = 0.0

    def observe(self, items: int, cost: float, seconds: float) -> None:
        if len(self._batches) == self._batches.maxlen:
            old_items, old_cost, old_seconds = self._batches[0]
            self._items -= old_items
            self._cost -= old_cost
            self._seconds -= old_seconds
        self._batches.append((items, cost, seconds))
        self._items += items
        self._cost += cost
        self._seconds += seconds

    @property
    def items_per_s(self) -> float:
        return self.parallelism * self._items / self._seconds if self._seconds > 0 else 0.0

    @property
    def cost_per_s(self) -> float:
        return self.parallelism * self._cost / self._seconds if self._seconds > 0 else 0.0
