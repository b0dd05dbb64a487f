"""Run reports: per-request records and polled snapshots → one JSON dict and a summary.

The load generator (``vega bench``) and the simulator (``vega simulate``) both feed
their requests and answers through here, so the two write the same report; nothing
here does I/O except ``write_json``, nothing keeps a list of every request, and the
plots drawn from a report are ``vega.lab.plots``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

import orjson

from vega.lab.hdr import Histogram
from vega.records import PRIORITY_NAMES

PRIORITIES = PRIORITY_NAMES  # the request classes, highest first
NO_ANSWER = ("unsent", "timeout", "connection")
REFUSED_STATUSES = frozenset({429, 503})
TIMELINE_PERCENTILES = (50.0, 90.0, 99.0)
SETTLE_S = 1.0  # latency_ms_after_1s: 200s sent from here on (from a bin boundary)


class Record(NamedTuple):
    """One request. ``t_sched``: seconds from the run's start at which it was *scheduled*
    to be sent; ``latency_s``: from ``t_sched`` to its answer (None if none came);
    ``status``: HTTP status, or 0 when no answer came; ``reason``: ``error.code`` of a
    non-200 (``""`` for 200), or for status 0 one of ``NO_ANSWER`` ("unsent": still queued
    client-side at the end, "timeout", "connection"); ``priority``: "critical" | "normal" |
    "sheddable"; ``deadline_s``: the deadline it carried, relative to ``t_sched``."""

    t_sched: float
    latency_s: float | None
    status: int
    reason: str
    priority: str
    deadline_s: float


class Distribution(TypedDict):
    """Batch size or padding ratio: ``le`` upper bounds as text (the last "+Inf"),
    ``counts`` per bucket (not cumulative), ``count`` and ``sum``. Built by
    ``distribution(values, bounds)`` or, from two ``/metrics`` texts, by
    ``distribution_delta(prometheus_histogram(before, name), prometheus_histogram(after,
    name))``."""

    le: list[str]
    counts: list[float]
    count: float
    sum: float


def outcome(status: int, reason: str) -> str:
    """The label an answer is counted under: "200", "429 shed", "504", "no answer: timeout"."""
    if status == 200:
        return "200"
    if status == 0:
        return f"no answer: {reason or 'connection'}"
    if status in (429, 503) and reason:
        return f"{status} {reason}"
    return str(status)


class Tally:
    """Everything a report needs, accumulated one record at a time (``add``): counts,
    goodput, HDR histograms per class and per time bin. Bins are ``bin_s`` wide, by
    ``t_sched`` for offered load and latency, by answer time (``t_sched + latency_s``)
    for answered rates."""

    def __init__(self, bin_s: float = 1.0) -> None:
        if not bin_s > 0:
            raise ValueError("bin_s must be > 0")
        self.bin_s = bin_s
        self.offered: list[int] = []
        self.answered: dict[str, list[int]] = {}
        self.goodput: list[int] = []
        self.latency_bins: dict[str, dict[int, Histogram]] = {p: {} for p in PRIORITIES}
        self.latency_ok = {p: Histogram() for p in PRIORITIES}
        self.latency_refused = {p: Histogram() for p in PRIORITIES}
        self.by_class: dict[str, dict[str, int]] = {p: {} for p in PRIORITIES}
        self.class_offered = dict.fromkeys(PRIORITIES, 0)
        self.class_goodput = dict.fromkeys(PRIORITIES, 0)
        self.deadlines: dict[str, set[float]] = {p: set() for p in PRIORITIES}
        self.span_s = 0.0

    def add(self, r: Record) -> None:
        k = int(r.t_sched / self.bin_s)
        _bump(self.offered, k)
        p = r.priority
        self.class_offered[p] = self.class_offered.get(p, 0) + 1
        if len(self.deadlines[p]) < 8:
            self.deadlines[p].add(r.deadline_s)
        label = outcome(r.status, r.reason)
        counts = self.by_class.setdefault(p, {})
        counts[label] = counts.get(label, 0) + 1
        if r.latency_s is None:
            self.span_s = max(self.span_s, r.t_sched)
            return
        done = r.t_sched + r.latency_s
        self.span_s = max(self.span_s, done)
        kd = int(done / self.bin_s)
        _bump(self.answered.setdefault(label, []), kd)
        if r.status == 200:
            self.latency_ok[p].record(r.latency_s)
            bins = self.latency_bins[p]
            h = bins.get(k)
            if h is None:
                h = bins[k] = Histogram()
            h.record(r.latency_s)
            if r.latency_s <= r.deadline_s:
                _bump(self.goodput, kd)
                self.class_goodput[p] += 1
        elif r.status in REFUSED_STATUSES:
            self.latency_refused[p].record(r.latency_s)


def _bump(series: list[int], index: int) -> None:
    if index >= len(series):
        series.extend([0] * (index + 1 - len(series)))
    series[index] += 1


def auto_bin_s(duration_s: float) -> float:
    """About 30..300 bins whatever the run's length."""
    for bin_s in (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0):
        if duration_s / bin_s <= 300:
            return bin_s
    return 60.0


def build_report(records: Tally | Iterable[Record], *,
                 snapshots: Sequence[Mapping[str, Any]] = (),
                 batches: Mapping[str, Distribution] | None = None,
                 meta: Mapping[str, Any] | None = None,
                 duration_s: float | None = None, bin_s: float | None = None
                 ) -> dict[str, Any]:
    """The JSON report. ``records`` is a Tally or any iterable of Record; ``snapshots``
    are ``{"t": seconds, "depth": {class: n}, ...}`` polled during the run (keys past
    those two are kept, not plotted); ``batches`` maps "size" and "padding" to a
    Distribution; ``meta`` is copied as is (the run's settings). Goodput is answers with
    status 200 within their deadline, per second (DESIGN.md rule 10); latencies in the
    report are milliseconds."""
    if isinstance(records, Tally):
        tally = records
    else:
        listed = list(records)
        if bin_s is None:
            bin_s = auto_bin_s(max((r.t_sched + (r.latency_s or 0.0) for r in listed),
                                   default=1.0))
        tally = Tally(bin_s)
        for r in listed:
            tally.add(r)
    span = duration_s if duration_s is not None else tally.span_s
    span = span if span > 0 else 1.0
    return {
        "meta": dict(meta or {}),
        "summary": _summary(tally, span),
        "classes": _classes(tally, span),
        "timeline": _timeline(tally),
        "queue": _queue(snapshots),
        "batches": {k: dict(v) for k, v in batches.items()} if batches else None,
        "hdr": {"relative_error": Histogram().relative_error, "unit_s": Histogram().unit_s},
    }


def _summary(t: Tally, span: float) -> dict[str, Any]:
    outcomes: dict[str, int] = {}
    for counts in t.by_class.values():
        for label, n in counts.items():
            outcomes[label] = outcomes.get(label, 0) + n
    by_status: dict[str, int] = {}
    for label, n in outcomes.items():
        if label != "no answer: unsent":
            key = "none" if label.startswith("no answer") else label.split(" ", 1)[0]
            by_status[key] = by_status.get(key, 0) + n
    offered = sum(t.class_offered.values())
    unsent = outcomes.get("no answer: unsent", 0)
    answered = sum(n for k, n in by_status.items() if k != "none")
    ok = Histogram()
    for h in t.latency_ok.values():
        ok.merge(h)
    # A closed loop opens with every connection sending at once; the tail of that onset
    # and the tail once the run has settled are different questions, answered apart.
    settled = Histogram()
    first = math.ceil(SETTLE_S / t.bin_s - 1e-9)
    for bins in t.latency_bins.values():
        for k, h in bins.items():
            if k >= first:
                settled.merge(h)
    good = sum(t.class_goodput.values())
    return {
        "duration_s": round(span, 3),
        "offered": offered, "sent": offered - unsent, "unsent": unsent, "answered": answered,
        "ok": by_status.get("200", 0), "in_deadline": good,
        "offered_rate": round(offered / span, 1), "throughput": round(answered / span, 1),
        "ok_rate": round(by_status.get("200", 0) / span, 1), "goodput": round(good / span, 1),
        "goodput_ratio": round(good / offered, 4) if offered else 0.0,
        "counts_by_status": dict(sorted(by_status.items())),
        "counts_by_outcome": dict(sorted(outcomes.items())),
        "latency_ms": ok.summary_ms(),
        "latency_ms_after_1s": settled.summary_ms(),
    }


def _classes(t: Tally, span: float) -> dict[str, Any]:
    out = {}
    for p in PRIORITIES:
        if not t.class_offered.get(p):
            continue
        out[p] = {
            "offered": t.class_offered[p],
            "counts_by_outcome": dict(sorted(t.by_class[p].items())),
            "in_deadline": t.class_goodput[p],
            "goodput": round(t.class_goodput[p] / span, 1),
            "goodput_ratio": round(t.class_goodput[p] / t.class_offered[p], 4),
            "deadline_ms": sorted(round(1000 * d, 3) for d in t.deadlines[p]),
            "latency_ms": t.latency_ok[p].summary_ms(),
            "refusal_latency_ms": t.latency_refused[p].summary_ms(),
        }
    return out


def _timeline(t: Tally) -> dict[str, Any]:
    n = max([len(t.offered), len(t.goodput)] + [len(v) for v in t.answered.values()]
            + [max(b) + 1 for b in t.latency_bins.values() if b])
    rate = 1.0 / t.bin_s

    def rates(series: list[int]) -> list[float]:
        return [round(c * rate, 2) for c in series] + [0.0] * (n - len(series))

    latency: dict[str, dict[str, list[float | None]]] = {}
    for p, bins in t.latency_bins.items():
        if not bins:
            continue
        latency[p] = {}
        for q in TIMELINE_PERCENTILES:
            latency[p]["p" + f"{q:g}"] = [
                round(1000 * bins[k].percentile(q), 3) if k in bins else None for k in range(n)]
    return {
        "bin_s": t.bin_s, "t": [round(k * t.bin_s, 3) for k in range(n)],
        "offered": rates(t.offered),
        "answered": {label: rates(series) for label, series in sorted(t.answered.items())},
        "goodput": rates(t.goodput),
        "latency_ms": latency,
    }


def _queue(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    if not snapshots:
        return None
    classes = [p for p in PRIORITIES if any(p in s.get("depth", {}) for s in snapshots)]
    depth = {p: [int(s.get("depth", {}).get(p, 0)) for s in snapshots] for p in classes}
    return {"t": [round(float(s["t"]), 3) for s in snapshots], "depth": depth,
            "max_depth": {p: max(v) for p, v in depth.items()},
            "extra": [{k: v for k, v in s.items() if k not in ("t", "depth")}
                      for s in snapshots] if any(len(s) > 2 for s in snapshots) else None}


def distribution(values: Iterable[float], bounds: Sequence[float]) -> Distribution:
    """Bucket ``values`` under upper bounds ``bounds`` (ascending) and +Inf."""
    counts = [0.0] * (len(bounds) + 1)
    total = 0.0
    for v in values:
        i = next((i for i, b in enumerate(bounds) if v <= b), len(bounds))
        counts[i] += 1
        total += v
    return {"le": [f"{b:g}" for b in bounds] + ["+Inf"], "counts": counts,
            "count": sum(counts), "sum": total}


def prometheus_text(text: str) -> bool:
    """Whether ``text`` reads as Prometheus's text format."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for _family in text_string_to_metric_families(text):
            pass
    except (ValueError, IndexError, KeyError):
        return False
    return True


def prometheus_histogram(text: str, name: str) -> Distribution | None:
    """Histogram ``name`` from Prometheus text, summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    cumulative: dict[float, float] = {}
    count = total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            found = True
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + s.value
            elif s.name == name + "_count":
                count += s.value
            elif s.name == name + "_sum":
                total += s.value
    if not found:
        return None
    bounds = sorted(cumulative)
    counts, previous = [], 0.0
    for b in bounds:
        counts.append(cumulative[b] - previous)
        previous = cumulative[b]
    return {"le": [f"{b:g}" if math.isfinite(b) else "+Inf" for b in bounds],
            "counts": counts, "count": count, "sum": total}


def distribution_delta(before: Distribution | None, after: Distribution | None
                       ) -> Distribution | None:
    """What was added between two readings of the same histogram."""
    if after is None:
        return None
    if before is None or before["le"] != after["le"]:
        return after
    return {"le": after["le"],
            "counts": [a - b for a, b in zip(after["counts"], before["counts"])],
            "count": after["count"] - before["count"], "sum": after["sum"] - before["sum"]}


JOB_ENDS = ("done", "failed", "expired", "cancelled")  # a job's final states


def jobs_section(share: float, accepted: int, ended: Mapping[str, int],
                 last_finished_s: float | None, load_s: float, latency: Histogram,
                 **extra: Any) -> dict[str, Any]:
    """The report's ``jobs``: requests that could wait (``share`` of them) and became jobs.

    ``ended`` counts jobs by final state (``JOB_ENDS``); ``lost`` is what was accepted
    and never reached one. ``last_finished_s`` is when the last job that ran (done or
    failed) finished, from the run's start; ``load_s`` is when the load ended (the last
    scheduled send); ``latency`` holds done jobs' times from scheduled send to finish."""
    counts = {state: int(ended.get(state, 0)) for state in JOB_ENDS}
    last = None if last_finished_s is None else round(last_finished_s, 3)
    return {"can_wait": share, "accepted": accepted, **counts,
            "lost": accepted - sum(counts.values()), "last_finished_s": last,
            "last_finished_after_load_s": None if last is None else round(last - load_s, 3),
            "latency_ms": latency.summary_ms(), **extra}


def write_json(report: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return path


def format_summary(report: Mapping[str, Any]) -> str:
    """A few lines for a terminal: rates, latency percentiles, counts by outcome."""
    s = report["summary"]
    lat = s["latency_ms"]
    lines = [
        (f"duration {s['duration_s']}s  offered {s['offered']} ({s['offered_rate']}/s)  "
         f"sent {s['sent']}  unsent {s['unsent']}"),
        (f"throughput {s['throughput']}/s  ok {s['ok_rate']}/s  goodput {s['goodput']}/s "
         f"({100 * s['goodput_ratio']:.1f}% of offered within deadline)"),
    ]
    if lat.get("count"):
        lines.append(f"latency of 200s (ms, from scheduled send): p50 {lat['p50']}  "
                     f"p90 {lat['p90']}  p99 {lat['p99']}  max {lat['max']}")
        settled = s.get("latency_ms_after_1s", {})  # reports written before it: absent
        if settled.get("count") and settled["count"] != lat["count"]:
            lines.append(f"  of those sent after the first second: p50 {settled['p50']}  "
                         f"p90 {settled['p90']}  p99 {settled['p99']}  max {settled['max']}")
    lines.append("by status: " + "  ".join(f"{k}: {v}" for k, v in
                                           s["counts_by_status"].items()))
    lines.append("by outcome: " + "  ".join(f"{k}: {v}" for k, v in
                                            s["counts_by_outcome"].items()))
    for p, c in report["classes"].items():
        lat = c["latency_ms"]
        tail = f"p50 {lat['p50']} p99 {lat['p99']} ms" if lat.get("count") else "no 200s"
        lines.append(f"  {p:<9} offered {c['offered']:<8} goodput {c['goodput']}/s "
                     f"({100 * c['goodput_ratio']:.1f}%)  {tail}")
    jobs = report.get("jobs")
    if jobs:
        lines.append(f"jobs ({100 * jobs['can_wait']:g}% could wait): accepted "
                     f"{jobs['accepted']}  " + "  ".join(f"{state} {jobs[state]}" for state
                                                          in JOB_ENDS) + f"  lost {jobs['lost']}")
        if jobs["last_finished_s"] is not None:
            lat = jobs["latency_ms"]
            tail = (f"; done jobs from send to finish: p50 {lat['p50'] / 1000:.1f} s  p99 "
                    f"{lat['p99'] / 1000:.1f} s" if lat.get("count") else "")
            lines.append(f"  last job finished {jobs['last_finished_after_load_s']} s after "
                         f"the load ended{tail}")
    return "\n".join(lines)
