"""The statistics extension (``/v2/models[/{name}]/stats``), read from the process's metrics.

Triton's perf_analyzer asks for these before and after a run, and stops when they
are missing. Nothing is counted twice: every figure is a total of a Prometheus
metric the process keeps anyway (so ``/v1`` traffic is included). Only the
stages Vega measures are filled; the others stay zero.
"""

from __future__ import annotations

from typing import Any

from vega.metrics import Metrics
from vega.models import ModelAdapter

STAGES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
          "cache_hit", "cache_miss")


def model_stats(metrics: Metrics, adapter: ModelAdapter) -> dict[str, Any]:
    """One entry of ``model_stats`` in the shape Triton's clients parse."""
    name = adapter.name
    ok = failed = 0.0
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == name:
                if sample.labels.get("outcome") == "ok":
                    ok += sample.value
                else:
                    failed += sample.value
    requests = _totals(metrics.request_seconds, name)
    queue = _totals(metrics.queue_wait, name)
    infer = _totals(metrics.inference, name)
    batches = _totals(metrics.batch_size, name)
    stats = {stage: {"count": 0, "ns": 0} for stage in STAGES}
    stats["success"] = {"count": int(ok), "ns": _ns(requests["_sum"])}
    stats["fail"] = {"count": int(failed), "ns": 0}
    stats["queue"] = {"count": int(queue["_count"]), "ns": _ns(queue["_sum"])}
    stats["compute_infer"] = {"count": int(infer["_count"]), "ns": _ns(infer["_sum"])}
    return {
        "name": name, "version": adapter.version,
        "last_inference": metrics.last_batch_ms.get(name, 0),  # epoch ms
        "inference_count": int(batches["_sum"]), "execution_count": int(batches["_count"]),
        "inference_stats": stats, "batch_stats": [],
    }


def _totals(metric: Any, model: str) -> dict[str, float]:
    """A histogram's ``_count`` and ``_sum`` for ``model``."""
    totals = {"_count": 0.0, "_sum": 0.0}
    for family in metric.collect():
        for sample in family.samples:
            suffix = sample.name[len(family.name):]
            if suffix in totals and sample.labels.get("model") == model:
                totals[suffix] += sample.value
    return totals


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)
