"""A small HDR-style (log-linear) histogram of non-negative durations, in seconds.

Values are counted in integer ticks of ``unit_s`` (1 µs by default). Below
``2 * 2**bits`` ticks every tick has its own bucket (exact); above, each power of
two is split into ``2**bits`` equal buckets, so a bucket is never wider than
``2**-bits`` of its lower bound. A percentile is reported as the middle of its
bucket, hence within ``RELATIVE_ERROR = 2**-(bits+1)`` (0.39% at the default
``bits=7``) of the exact order statistic, plus half a tick for tiny values.

Memory is a dict of the buckets that were hit (a few hundred at most for
latencies), so thousands of per-second histograms are cheap; ``merge`` adds
another histogram with the same ``bits`` and ``unit_s``. Nothing here sorts
the recorded values.

    h = Histogram()
    h.record(0.0123)
    h.percentile(99)       # seconds
    h.summary_ms()         # {"count", "min", "mean", "p50", "p90", "p99", "p999", "max"} in ms
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

DEFAULT_BITS = 7
DEFAULT_UNIT_S = 1e-6
SUMMARY_PERCENTILES = (50.0, 90.0, 99.0, 99.9)


class Histogram:
    """Counts of durations in log-linear buckets; percentile queries and merge."""

    __slots__ = ("_linear", "_sub", "bits", "count", "counts", "max_s", "min_s", "total_s",
                 "unit_s")

    def __init__(self, bits: int = DEFAULT_BITS, unit_s: float = DEFAULT_UNIT_S) -> None:
        if not 1 <= bits <= 16 or unit_s <= 0:
            raise ValueError("bits must be in 1..16 and unit_s > 0")
        self.bits = bits
        self.unit_s = unit_s
        self.counts: dict[int, int] = {}
        self.count = 0
        self.total_s = 0.0
        self.min_s = float("inf")
        self.max_s = 0.0
        self._sub = 1 << bits
        self._linear = 2 << bits

    @property
    def relative_error(self) -> float:
        """Largest relative error of a reported percentile (above the linear range)."""
        return 2.0 ** -(self.bits + 1)

    def record(self, value_s: float, n: int = 1) -> None:
        """Count ``value_s`` (clamped at 0) ``n`` times."""
        value_s = max(value_s, 0.0)
        ticks = int(value_s / self.unit_s)
        if ticks < self._linear:
            index = ticks
        else:
            shift = ticks.bit_length() - self.bits - 1
            index = shift * self._sub + (ticks >> shift)
        counts = self.counts
        counts[index] = counts.get(index, 0) + n
        self.count += n
        self.total_s += value_s * n
        self.min_s = min(self.min_s, value_s)
        self.max_s = max(self.max_s, value_s)

    def _bounds(self, index: int) -> tuple[int, int]:
        """[low, high) in ticks of bucket ``index``."""
        if index < self._linear:
            return index, index + 1
        shift, mantissa = divmod(index, self._sub)
        shift -= 1
        low = (mantissa + self._sub) << shift
        return low, low + (1 << shift)

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) in seconds; 0.0 when empty."""
        if self.count == 0:
            return 0.0
        # the smallest value with at least q% of the counts at or below it (nearest rank)
        rank = max(1, min(self.count, math.ceil(round(q / 100.0 * self.count, 9))))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                low, high = self._bounds(index)
                middle = (low + high) / 2.0 * self.unit_s
                return min(max(middle, self.min_s), self.max_s)
        return self.max_s  # unreachable: counts sum to count

    def percentiles(self, qs: Iterable[float]) -> list[float]:
        return [self.percentile(q) for q in qs]

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0

    def merge(self, other: Histogram) -> Histogram:
        """Add ``other``'s counts into this one (same bits and unit); returns self."""
        if other.bits != self.bits or other.unit_s != self.unit_s:
            raise ValueError("cannot merge histograms with different bits or unit_s")
        for index, n in other.counts.items():
            self.counts[index] = self.counts.get(index, 0) + n
        self.count += other.count
        self.total_s += other.total_s
        self.min_s = min(self.min_s, other.min_s)
        self.max_s = max(self.max_s, other.max_s)
        return self

    def summary_ms(self) -> dict[str, float]:
        """Count, min, mean, p50/p90/p99/p99.9 and max, in milliseconds (rounded to 1 µs)."""
        if self.count == 0:
            return {"count": 0}
        out: dict[str, float] = {"count": self.count, "min": round(1000 * self.min_s, 3),
                                 "mean": round(1000 * self.mean_s, 3)}
        for q in SUMMARY_PERCENTILES:
            key = "p" + f"{q:g}".replace(".", "")
            out[key] = round(1000 * self.percentile(q), 3)
        out["max"] = round(1000 * self.max_s, 3)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form; ``from_dict`` reads it back."""
        return {"bits": self.bits, "unit_s": self.unit_s, "count": self.count,
                "total_s": self.total_s, "min_s": self.min_s if self.count else 0.0,
                "max_s": self.max_s, "counts": {str(k): v for k, v in sorted(self.counts.items())}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Histogram:
        h = cls(int(data["bits"]), float(data["unit_s"]))
        h.counts = {int(k): int(v) for k, v in data["counts"].items()}
        h.count = int(data["count"])
        h.total_s = float(data["total_s"])
        h.min_s = float(data["min_s"]) if h.count else float("inf")
        h.max_s = float(data["max_s"])
        return h
