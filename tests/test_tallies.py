"""vega/tallies.py: the loop-kept counters and histograms expose what prometheus_client's
own types would, given the same updates."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vega.metrics import LATENCY_BUCKETS, RATIO_BUCKETS
from vega.tallies import LoopCounter, LoopHistogram

# Values on, between and past the bounds, and at zero.
AMOUNTS = (0.0, 0.0005, 0.0007, 0.001, 0.05, 0.3, 1.0, 29.9, 30.0, 31.0, 1e9)


def exposition(registry: CollectorRegistry) -> str:
    """The text Prometheus scrapes, creation times masked (each type stamps its own)."""
    text = generate_latest(registry).decode()
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", text)


def test_a_counter_exposes_what_prometheus_client_s_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopCounter("vega_things_total", "Things, by kind", ["model", "kind"], ours)
    reference = Counter("vega_things_total", "Things, by kind", ["model", "kind"],
                        registry=theirs)
    for labels, amount in ((("a", "x"), 1.0), (("a", "y"), 2.5), (("a", "x"), 3.0),
                           (("b", "x"), 0.0)):
        mine.labels(*labels).inc(amount)
        reference.labels(*labels).inc(amount)
    assert exposition(ours) == exposition(theirs)
    assert 'vega_things_total{kind="x",model="a"} 4.0' in exposition(ours)


@pytest.mark.parametrize("bounds", [LATENCY_BUCKETS, RATIO_BUCKETS, (1, 2, 4, 1024),
                                    (0.5, float("inf"))])
def test_a_histogram_exposes_what_prometheus_client_s_does(bounds: tuple[float, ...]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("vega_waits_seconds", "Waits", ["model"], ours, bounds)
    reference = Histogram("vega_waits_seconds", "Waits", ["model"], buckets=bounds,
                          registry=theirs)
    for index, amount in enumerate(AMOUNTS):
        model = "ab"[index % 2]
        mine.labels(model).observe(amount)
        reference.labels(model).observe(amount)
    assert exposition(ours) == exposition(theirs)


def test_families_with_no_children_expose_their_help_alone() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    LoopCounter("vega_none_total", "None yet", ["model"], ours)
    LoopHistogram("vega_none_seconds", "None yet", ["model"], ours, (0.1, 1.0))
    Counter("vega_none_total", "None yet", ["model"], registry=theirs)
    Histogram("vega_none_seconds", "None yet", ["model"], buckets=(0.1, 1.0), registry=theirs)
    assert exposition(ours) == exposition(theirs)


def test_misuse_is_refused_as_prometheus_client_refuses_it() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("vega_things_total", "Things", ["model"], registry)
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError):
        counter.labels("a", "b")
    with pytest.raises(ValueError):  # the name is taken
        LoopCounter("vega_things_total", "Things", ["model"], registry)
    with pytest.raises(ValueError):
        LoopHistogram("vega_waits_seconds", "Waits", ["model"], registry, (1.0, 0.5))
    assert counter.labels("a").value == 0.0
