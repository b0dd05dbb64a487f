"""Every Prometheus metric of a process, defined once, in a registry of its own."""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from vega.records import PRIORITY_NAMES, Batch
from vega.tallies import Count, LoopCounter, LoopHistogram, Spread

# 0.8: the VegaLatencyNearDeadline threshold (80% of the default deadline) is a bound, so
# the p99 crosses it only when 1% of answers do, not by interpolation between 0.5 and 1.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8,
                   1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OVERFLOW_EVENTS = ("taken_back", "reclaimed", "dead_lettered", "declined", "late_reply",
                   "malformed", "expired", "stalled")
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._answers: dict[tuple[str, str, str], tuple[Count, Count | None, Spread]] = {}
        self.last_batch_ms: dict[str, int] = {}  # wall clock, per model (/v2 statistics)
        # Those counted once per request or batch are kept by the loop (vega/tallies.py).
        self.requests = LoopCounter("vega_requests_total", "Requests answered, by outcome",
                                    ["model", "priority", "outcome"], r)
        self.rejections = LoopCounter("vega_rejections_total", "Requests refused, by reason",
                                      ["model", "priority", "reason"], r)
        self.request_seconds = LoopHistogram("vega_request_seconds",
                                             "Time from arrival to answer", ["model"], r,
                                             LATENCY_BUCKETS)
        self.queue_wait = LoopHistogram("vega_queue_wait_seconds",
                                        "Time an item waited to be batched", ["model"], r,
                                        LATENCY_BUCKETS)
        self.batch_size = LoopHistogram("vega_batch_size", "Items per batch", ["model"], r,
                                        SIZE_BUCKETS)
        self.padding = LoopHistogram("vega_batch_padding_ratio",
                                     "Share of a batch tensor that is padding", ["model"], r,
                                     RATIO_BUCKETS)
        self.padded_steps = LoopCounter("vega_padded_steps_total",
                                        "Timesteps of padding run through the model", ["model"],
                                        r)
        self.batch_steps = LoopCounter("vega_batch_steps_total",
                                       "Timesteps run through the model, padding included",
                                       ["model"], r)
        self.inference = LoopHistogram("vega_inference_seconds", "Forward pass time per batch "
                                       "run here, stolen ones included (a failed one is not "
                                       "timed)", ["model"], r, LATENCY_BUCKETS)

        self.paced = Counter("vega_refusals_paced_total",
                             "Refusals held for their turn (VEGA_REFUSAL_RATE)", ["model"],
                             registry=r)
        self.queue_depth = Gauge("vega_queue_depth", "Items queued", ["model", "priority"],
                                 registry=r)
        self.bucket_bound = Gauge("vega_length_bucket_upper_steps",
                                  "Upper length bound of each length bucket (after planning)",
                                  ["model", "bucket"], registry=r)
        self.inflight = Gauge("vega_inflight_batches", "Batches formed and not yet finished",
                              registry=r)
        self.service_rate = Gauge("vega_service_rate_items_per_second",
                                  "Measured items per second of executor time", ["model"],
                                  registry=r)
        self.overflow = Counter("vega_overflow_batches_total",
                                "Batches sent to or taken from peers",
                                ["direction"], registry=r)
        self.redis_up = Gauge("vega_redis_up", "1 while Redis answers, 0 when it does not",
                              registry=r)
        self.ready = Gauge("vega_ready", "1 once warm and not draining", registry=r)
        self.loop_lag = Gauge("vega_loop_lag_seconds", "How late the event loop last ran a "
                              "timer (vega/pressure/looplag.py)", registry=r)
        self.loop_refused_share = Gauge(
            "vega_loop_refused_share", "Share of non-critical requests refused while the "
            "event loop runs late", registry=r)
        self.loop_refused = Counter(
            "vega_loop_refused_total", "Non-critical requests refused while the event loop "
            "ran late (also in vega_rejections_total as queue_full or shed)", registry=r)
        self.model_processes_up = Gauge(
            "vega_model_processes_up", "Model processes up and warm (VEGA_EXECUTOR=process)",
            registry=r)
        self.model_process_restarts = Counter(
            "vega_model_process_restarts_total", "Model processes restarted after dying or "
            "hanging", registry=r)
        self.model_process_exits = Counter(
            "vega_model_process_exits_total", "Model processes that died or were killed for "
            "hanging, counted as they end (restarts count once the next is warm)", registry=r)
        self.quarantined = Gauge(
            "vega_quarantined_inputs", "Inputs that took a model process down alone, here "
            "or at a peer, refused unrun for a while (500 model_error; vega/quarantine.py)",
            registry=r)
        self.quarantine_refusals = Counter(
            "vega_quarantine_refusals_total", "Instances refused (each of a request's on "
            "its own) for being an input that took a model process down", registry=r)
        self.overflow_events = Counter(
            "vega_overflow_events_total", "What happened to overflow batches besides a "
            "plain steal: taken_back, reclaimed, dead_lettered, declined, "
            "late_reply, malformed, expired; stalled: a Redis command timed out in a "
            "stall of this process, Redis answering", ["event"], registry=r)
        # At 0 from the start (Redis or not): rate() and increase() miss a series' first step.
        for direction in ("out", "in"):
            self.overflow.labels(direction)
        for event in OVERFLOW_EVENTS:
            self.overflow_events.labels(event)
        self.steal_rtt = Gauge("vega_steal_rtt_seconds",
                               "Measured round trip of a stolen batch, less its model time",
                               registry=r)
        self.peers = Gauge("vega_peers", "Live peer processes seen through Redis", registry=r)
        self.peer_lent = Gauge("vega_peer_threads_lent",
                                "Executor threads the live peers say they can lend now",
                                ["model"], registry=r)
        self.refused_with_room = Counter(
            "vega_refusals_with_peer_room_total",
            "Requests refused while live peers' last beats said they had threads to lend (a "
            "few at a burst's onset; growing under a steady load: look)", ["model"],
            registry=r)
        # Pressure relief (docs/pressure.md): cache, idempotency keys, fallback, capacity.
        self.cache_hits = Counter("vega_cache_hits_total", "Answers served from the cache",
                                  ["model", "tier"], registry=r)
        self.cache_misses = Counter("vega_cache_misses_total",
                                    "Cache lookups that found nothing", ["model"], registry=r)
        self.cache_evictions = Counter("vega_cache_evictions_total",
                                       "Entries dropped from the in-process cache for room",
                                       ["model"], registry=r)
        self.cache_bytes = Gauge("vega_cache_bytes", "Bytes held by the in-process cache",
                                 registry=r)
        self.idempotent = Counter("vega_idempotent_requests_total",
                                  "Repeats of an Idempotency-Key, each once: replayed (a "
                                  "recorded answer at once), waited (for an attempt running)",
                                  ["model", "event"], registry=r)
        self.degraded = Counter("vega_degraded_total",
                                "Requests served by the fallback model instead of the main one",
                                ["model", "priority"], registry=r)
        self.queue_age = Gauge("vega_queue_age_seconds", "Age of the oldest queued item",
                               ["model", "priority"], registry=r)
        self.utilisation = Gauge("vega_executor_utilisation",
                                 "Share of executor thread time spent running batches",
                                 registry=r)
        self.refusal_rate = Gauge("vega_refusals_per_second",
                                  "Refusals per second over the last capacity sample",
                                  ["reason"], registry=r)
        self.suggested_processes = Gauge(
            "vega_suggested_processes",
            "Processes this one suggests for the observed load (with hysteresis)", registry=r)

        # The async lane (vega/jobs/): a dashboard reads these names.
        self.jobs_depth = Gauge("vega_jobs_depth", "Jobs queued (never delivered) or pending "
                                "(claimed, not finished)", ["model", "state"], registry=r)
        self.jobs_total = Counter("vega_jobs_total", "Jobs finished here, by outcome",
                                  ["model", "outcome"], registry=r)
        self.jobs_oldest_age = Gauge("vega_jobs_oldest_age_seconds",
                                     "Age of the oldest job not finished", ["model"], registry=r)
        self.jobs_dead_letters = Gauge("vega_jobs_dead_letters",
                                       "Jobs failed and copied to the dead-letter stream",
                                       ["model"], registry=r)
        self.jobs_retried = Counter("vega_jobs_retried_total",
                                    "Job runs that failed and were put back", ["model"],
                                    registry=r)
        self.jobs_reclaimed = Counter("vega_jobs_reclaimed_total",
                                      "Jobs taken over from a process that stopped answering",
                                      ["model"], registry=r)

    def answered(self, model: str, priority: str, outcome: str, refused: bool,
                 seconds: float | None) -> None:
        """Count one answer: a refusal's reason, a 200's time. Once per request, so the
        labelled children are kept rather than looked up each time."""
        key = (model, priority, outcome)
        children = self._answers.get(key)
        if children is None:
            children = self._answers[key] = (
                self.requests.labels(*key), self.rejections.labels(*key) if refused else None,
                self.request_seconds.labels(model))
        children[0].inc()
        if children[1] is not None:
            children[1].inc()
        if seconds is not None:
            children[2].observe(seconds)

    def observe_batch(self, batch: Batch) -> None:
        """Once per batch formed here, run here or handed to a peer: sizes, padding and
        queue waits (its forward pass: observe_run)."""
        model = batch.model
        self.last_batch_ms[model] = int(time.time() * 1000)
        self.batch_size.labels(model).observe(batch.size)
        self.padding.labels(model).observe(batch.padding_ratio)
        self.batch_steps.labels(model).inc(batch.steps)
        self.padded_steps.labels(model).inc(batch.padded_steps)
        wait = self.queue_wait.labels(model)
        for item in batch.items:
            wait.observe(item.queue_s)

    def observe_run(self, batch: Batch) -> None:
        """Once per batch run here: its forward pass, where it ran (a batch handed off was
        observed at its hand-off, unrun; a stolen one is timed at the thief)."""
        if batch.infer_s > 0:
            self.inference.labels(batch.model).observe(batch.infer_s)

    def set_queue(self, model: str, depths: list[int], rate: float) -> None:
        for name, depth in zip(PRIORITY_NAMES, depths):
            self.queue_depth.labels(model, name).set(depth)
        self.service_rate.labels(model).set(rate)

    def render(self) -> bytes:
        return generate_latest(self.registry)
