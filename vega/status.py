"""What ``/v1/status``, ``/metrics`` and the capacity signal read of a runtime.

Read-only: nothing here changes how requests are served; it turns the runtime's
values into the status document, the Prometheus gauges and the capacity sample.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from vega.pressure.capacity import Sample
from vega.records import PRIORITY_BY_NAME, PRIORITY_NAMES

if TYPE_CHECKING:
    from vega.runtime import Runtime, Served


class Reporter:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._restarts_counted = 0  # counters are fed the change since the last refresh
        self._refused_counted: dict[str, int] = {}
        self._loop_refused_counted = 0
        self._quarantine_refusals_counted = 0
        self._exits_counted = 0

    def refresh_metrics(self) -> None:
        self.rt.metrics.ready.set(1 if self.rt.ready and not self.rt.draining else 0)
        lag = self.rt.lag
        self.rt.metrics.loop_lag.set(lag.lag_s)
        self.rt.metrics.loop_refused_share.set(lag.share)
        self.rt.metrics.loop_refused.inc(lag.refused - self._loop_refused_counted)
        self._loop_refused_counted = lag.refused
        executor = self.rt.executor
        self.rt.metrics.model_processes_up.set(sum(p.up for p in executor.processes))
        self.rt.metrics.model_process_restarts.inc(executor.restarts - self._restarts_counted)
        self._restarts_counted = executor.restarts
        self.rt.metrics.model_process_exits.inc(executor.exits - self._exits_counted)
        self._exits_counted = executor.exits
        self.rt.metrics.quarantined.set(executor.quarantine.refused)
        self.rt.metrics.quarantine_refusals.inc(
            executor.quarantine.refusals - self._quarantine_refusals_counted)
        self._quarantine_refusals_counted = executor.quarantine.refusals
        self.rt.metrics.inflight.set(sum(s.batcher.inflight for s in self.rt.models.values()))
        self.rt.jobs.refresh_metrics()
        for name, served in self.rt.models.items():
            self.rt.metrics.peer_lent.labels(name).set(self.rt.lent(name))
            refused = served.admission.refused_with_room
            self.rt.metrics.refused_with_room.labels(name).inc(
                refused - self._refused_counted.get(name, 0))
            self._refused_counted[name] = refused
            for index, bound in enumerate(served.batcher.config.buckets):
                self.rt.metrics.bucket_bound.labels(name, str(index)).set(bound)
            depths = [served.batcher.depth(p) for p in range(len(PRIORITY_NAMES))]
            self.rt.metrics.set_queue(name, depths, served.batcher.rate.items_per_s)
            for priority, age_s in self.queue_ages(served).items():
                self.rt.metrics.queue_age.labels(name, priority).set(age_s)
        view = self.rt.capacity
        self.rt.metrics.utilisation.set(view.utilisation)
        self.rt.metrics.suggested_processes.set(view.suggested or 1)
        for reason, rate in view.refusal_rate.items():
            self.rt.metrics.refusal_rate.labels(reason).set(rate)

    def status(self) -> dict[str, Any]:
        models = {}
        now = asyncio.get_running_loop().time()
        for name, served in self.rt.models.items():
            b = served.batcher
            models[name] = {
                "depth": {p: b.depth(i) for i, p in enumerate(PRIORITY_NAMES)},
                "inflight_batches": b.inflight,
                "service_rate_items_per_s": round(b.rate.items_per_s, 1),
                "service_rate_cost_per_s": round(b.rate.cost_per_s, 1),  # VEGA_RATE_LIMIT's unit
                "backlog_ms": round(1000 * b.backlog_s(), 2),
                "batch_time_drift": round(b.times.drift, 3),  # recent batches vs their lines
                "standing_queue": b.standing(now),
                "queue_interval_ms": round(1000 * b.standing_after_s, 1),  # rule 5, in force
                "queue_behind": b.behind(now),  # sheds what waited out the interval
                "peer_threads_lent": self.rt.lent(name),
                "refused_while_peers_had_room": served.admission.refused_with_room,
                "length_buckets": list(b.config.buckets),
                "padding_share": self.padding_share(name),
                "queue_age_ms": {p: round(1000 * age, 1)
                                 for p, age in self.queue_ages(served).items()},
                "jobs": self.rt.jobs.status(name),
            }
        executor = self.rt.executor
        return {"node": self.rt.node_id, "ready": self.rt.ready, "draining": self.rt.draining,
                "device": self.rt.device,
                "executor": {"kind": executor.kind, "threads": executor.threads,
                             "processes_up": sum(p.up for p in executor.processes),
                             "restarts": executor.restarts, "exits": executor.exits,
                             "quarantined_inputs": executor.quarantine.refused,
                             "pids": [p.pid if p.up else None for p in executor.processes],
                             "standby_pids": [p.standby.pid for p in executor.processes]},
                "active_requests": self.rt.active_requests, "loop": self.rt.lag.status(),
                "models": models, "outcomes": self.outcomes(),
                "redis_up": self.rt.streams is not None and self.rt.streams.up,
                "peers": self.rt.streams.peers if self.rt.streams is not None else [],
                "fallback_model": self.rt.fallback_model, "capacity": self.rt.capacity.view()}

    def padding_share(self, model: str) -> float:
        """Of the timesteps run through ``model`` so far, the share that was padding (the
        counters /metrics exports)."""
        metrics = self.rt.metrics
        steps = metrics.batch_steps.labels(model).value
        return round(metrics.padded_steps.labels(model).value / steps, 4) if steps else 0.0

    def queue_ages(self, served: Served) -> dict[str, float]:
        now = asyncio.get_running_loop().time()
        ages = {}
        for index, name in enumerate(PRIORITY_NAMES):
            oldest = served.batcher.oldest(index)
            ages[name] = 0.0 if oldest is None else max(0.0, now - oldest)
        return ages

    def capacity_sample(self) -> Sample:
        """The runtime's values as the capacity signal reads them."""
        depth = dict.fromkeys(PRIORITY_NAMES, 0)
        ages = dict.fromkeys(PRIORITY_NAMES, 0.0)
        for served in self.rt.models.values():
            for name, age in self.queue_ages(served).items():
                depth[name] += served.batcher.depth(PRIORITY_BY_NAME[name])
                ages[name] = max(ages[name], age)
        main = self.rt.models[self.rt.default_model].batcher
        refusals = _sum_by(self.rt.metrics.rejections, "reason")
        streams = self.rt.streams
        peers = sum(self.rt.default_model in peer.get("models", ()) for peer in streams.peers) \
            if streams is not None and streams.up else 0  # not another deployment's nodes
        return Sample(at=asyncio.get_running_loop().time(), busy_s=self.rt.executor.busy_s,
                      threads=self.rt.executor.threads, depth=depth, oldest_age_s=ages,
                      refusals=refusals,
                      item_s=main.times.per_item_s(0, main.config.max_batch_size),
                      processes=1 + peers,
                      backlog_s=sum(s.batcher.backlog_s() for s in self.rt.models.values()),
                      overflow=dict(streams.counts) if streams is not None else {},
                      job_items=self.rt.jobs.backlog_items())

    def outcomes(self) -> dict[str, int]:
        return {outcome: int(count)
                for outcome, count in _sum_by(self.rt.metrics.requests, "outcome").items()}


def _sum_by(counter: Any, label: str) -> dict[str, float]:
    """A counter's totals summed over every label but ``label``."""
    sums: dict[str, float] = {}
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                value = sample.labels[label]
                sums[value] = sums.get(value, 0.0) + sample.value
    return sums
