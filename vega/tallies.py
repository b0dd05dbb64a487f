"""Counters and histograms that the event loop keeps as plain numbers.

prometheus_client's own types may be updated from any thread, so every ``inc`` and
``observe`` takes a lock, and a histogram finds its bucket in a Python loop: a few
microseconds per request on the loop, counted three times a request. The metrics that
change once per request or batch are kept here instead: a child is a number (or a list of
bucket counts) added to in place, and Prometheus's samples are built only when scraped.
The exposition is the one prometheus_client writes for its own types (the tests compare
them). Update these from the event loop's thread only: nothing here is locked.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class Count:
    """One labelled counter's value."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class Spread:
    """One labelled histogram's bucket counts (not cumulative) and sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last for values past every bound (+Inf)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bound at or above the value: Prometheus's buckets are "less or equal".
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


Child = TypeVar("Child", Count, Spread)


class _Family(Collector, Generic[Child]):
    """Children by label values, registered as a collector."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def _child(self) -> Child:
        raise NotImplementedError

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = self._child()
        return child

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, self.kind)]


class LoopCounter(_Family[Count]):
    """A labelled counter; ``name`` ends in ``_total``, as prometheus_client's ``Counter``
    is given it."""

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _child(self) -> Count:
        return Count()

    def collect(self) -> Iterable[Metric]:
        family = Metric(self.name, self.documentation, self.kind)
        for values, child in self._children.items():
            labels = dict(zip(self.labelnames, values))
            family.samples += [Sample(f"{self.name}_total", labels, child.value),
                               Sample(f"{self.name}_created", labels, child.created)]
        return [family]


class LoopHistogram(_Family[Spread]):
    """A labelled histogram with fixed bucket bounds (ascending, +Inf implied)."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in buckets if b != math.inf)  # +Inf is always last
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"{name}: bucket bounds must be distinct and ascending")
        self._les = [floatToGoString(b)  # type: ignore[no-untyped-call]
                     for b in self.bounds] + ["+Inf"]
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> Spread:
        return Spread(self.bounds)

    def collect(self) -> Iterable[Metric]:
        family = Metric(self.name, self.documentation, self.kind)
        for values, child in self._children.items():
            labels = dict(zip(self.labelnames, values))
            running = 0
            for le, count in zip(self._les, child.counts):
                running += count
                family.samples.append(Sample(f"{self.name}_bucket", {**labels, "le": le},
                                             float(running)))
            family.samples += [Sample(f"{self.name}_count", labels, float(running)),
                               Sample(f"{self.name}_sum", labels, child.sum),
                               Sample(f"{self.name}_created", labels, child.created)]
        return [family]
