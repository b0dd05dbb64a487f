"""Admission: refuse early, cheaply and on purpose (DESIGN.md rules 1, 3, 4 and 5).

A request is checked, cheapest first, against the class watermarks of the bounded
queue, the work its class may queue behind (rule 5), the deadline it asks for given
the backlog ahead of it, and the token bucket. Everything it reads about the queue
comes from the batcher as values. A refusal raises a VegaError whose
``retry_after_ms`` comes from the backlog and the measured service rate, never from
a constant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vega.batcher import Batcher
from vega.config import Settings
from vega.errors import MIN_RETRY_MS, VegaError
from vega.records import CRITICAL, NORMAL, PRIORITY_NAMES, SHEDDABLE


@dataclass(frozen=True)
class AdmissionConfig:
    queue_capacity: int
    shed_watermark: float
    normal_watermark: float
    rate_limit: float  # cost units per second; 0 = no token bucket
    burst: float  # cost units; 0 = one second of rate_limit
    margin_s: float
    # Under a standing queue, the most queued work (seconds) a non-critical item may
    # join; at least two full batches of its bucket so batching keeps its pipeline.
    standing_target_s: float = 0.005

    @classmethod
    def from_settings(cls, s: Settings) -> AdmissionConfig:
        return cls(queue_capacity=s.queue_capacity, shed_watermark=s.shed_watermark,
                   normal_watermark=s.normal_watermark, rate_limit=s.rate_limit, burst=s.burst,
                   margin_s=s.deadline_margin_ms / 1000, standing_target_s=s.codel_target_ms / 1000)


class NeverFits(VegaError):
    """422: a request no retry could fit inline, where a 429 would promise one: more
    instances than its class may ever queue, or a deadline shorter than its own batches
    take with nothing ahead. A caller that would take a job (respond-async) gets one."""


class TokenBucket:
    """Refills at ``rate`` per second up to ``size``; ``reserve`` is kept for critical."""

    def __init__(self, rate: float, size: float, reserve: float, now: float) -> None:
        self.rate = rate
        self.size = size
        self.reserve = reserve
        self.tokens = size
        self._at = now

    def take(self, cost: float, critical: bool, now: float) -> float:
        """Take ``cost`` tokens, or return the seconds until they would be there.

        A request dearer than the bucket holds above its floor goes once the bucket is
        full, leaving a debt that is refilled before the next one: else it would be
        refused forever, with a Retry-After promising otherwise."""
        self.tokens = min(self.size, self.tokens + (now - self._at) * self.rate)
        self._at = now
        floor = 0.0 if critical else self.reserve
        need = min(cost, self.size - floor)
        if self.tokens - need >= floor - 1e-9:
            self.tokens -= cost
            return 0.0
        return (need + floor - self.tokens) / self.rate

    def refund(self, cost: float) -> None:
        self.tokens = min(self.size, self.tokens + cost)


class Reach(Protocol):
    """What this process knows of the capacity its live peers can lend (rule 11)."""

    def lent(self, model: str) -> float:
        """Executor threads peers can lend for ``model`` now (0 without Redis or peers)."""

    def room(self, model: str) -> bool:
        """Whether a batch of ``model`` handed off now would be taken (none is waiting)."""


class Admission:
    """With a ``reach``, the work ahead is shared with the threads live peers can lend,
    so a request is refused only when neither this process nor they can serve it in
    time; without peers it is the local rule."""

    def __init__(self, config: AdmissionConfig, batcher: Batcher, now: float,
                 reach: Reach | None = None) -> None:
        self.config = config
        self.batcher = batcher
        self.reach = reach
        self.refused_with_room = 0  # refusals made while peers could have taken more
        capacity = config.queue_capacity
        # Items of each class may fill the queue up to this many (rule 4: headroom for critical).
        self.limits = {
            CRITICAL: capacity,
            NORMAL: max(1, int(capacity * config.normal_watermark + 1e-9)),  # 100 x 0.29: 29
            SHEDDABLE: int(capacity * config.shed_watermark + 1e-9),
        }
        self.bucket: TokenBucket | None = None
        if config.rate_limit > 0:
            size = config.burst or config.rate_limit
            reserve = size * (1.0 - config.normal_watermark)
            self.bucket = TokenBucket(config.rate_limit, size, reserve, now)

    def admit(self, priority: int, buckets: Sequence[int], deadline: float,
              now: float, arrived: float | None = None) -> list[float]:
        """Admit a request of ``len(buckets)`` items or raise; return each item's cost.
        ``arrived``: when the request came in, if before ``now`` (its deadline counts
        from then)."""
        costs = [self.batcher.item_cost(bucket) for bucket in buckets]
        self._check_room(priority, len(buckets))
        model = self.batcher.config.model
        lent = self.reach.lent(model) if self.reach is not None else 0.0
        own = self.batcher.config.parallelism
        share = (own + lent) / own  # how many times its own threads the queue drains through
        ahead_s = self.batcher.backlog_s(priority) / share  # the work served before it
        try:
            self._check_queue_time(priority, buckets, ahead_s, share, now)
            self._check_deadline(priority, buckets, deadline, ahead_s, now,
                                 now if arrived is None else arrived)
        except VegaError:
            if self.reach is not None and self.reach.room(model):
                self.refused_with_room += 1
            raise
        if self.bucket is not None:
            wait_s = self.bucket.take(sum(costs), priority == CRITICAL, now)
            if wait_s > 0:
                raise VegaError("rate_limited", "over the admitted compute rate",
                                retry_after_ms=max(MIN_RETRY_MS, 1000 * wait_s))
        return costs

    def refund(self, costs: Sequence[float]) -> None:
        """Give back the tokens of a request admitted but then found invalid."""
        if self.bucket is not None:
            self.bucket.refund(sum(costs))

    def _check_room(self, priority: int, count: int) -> None:
        depth = self.batcher.depth()
        limit = self.limits[priority]
        if depth + count <= limit:
            return
        if 0 < limit < count:  # no retry could fit it, where a 429 would promise one
            # (a watermark of 0 sheds the whole class: that is the 429 below)
            raise NeverFits("invalid_input", f"{count} instances, more than this process "
                            f"queues for {PRIORITY_NAMES[priority]} requests ({limit}): send "
                            "fewer per request")
        code = "shed" if priority == SHEDDABLE else "queue_full"
        excess = depth + count - limit
        raise VegaError(code, f"queue at its bound for {PRIORITY_NAMES[priority]} requests",
                        retry_after_ms=self._drain_ms(excess))

    def precheck(self, priority: int) -> None:
        """Refuse before the body is read or parsed when no request of this class could
        enter (its watermark: the other rules need the parsed request)."""
        self._check_room(priority, 1)

    def _check_queue_time(self, priority: int, buckets: Sequence[int], ahead_s: float,
                          share: float, now: float) -> None:
        # Rule 5 (CoDel): the queue buffers bursts shorter than the interval, no more.
        # A queue holding more work than that cannot empty within it, so its oldest items
        # would be shed after waiting the interval out: refuse them now instead. (Admitted,
        # a flood's onset filled the queue and was shed 0.1 s later, leaving at 1024 polite
        # connections ~40 callers to fill the batches until Retry-After sent the rest back.)
        # Once the queue has not emptied for an interval, keep it to a few batches of work.
        batcher = self.batcher
        if priority == CRITICAL:
            return
        if batcher.standing(now):
            # Enough for batching to keep its pipeline: where the queue and the request
            # hold one bucket, one full batch (the next batch forms full from it); with
            # mixed lengths two, of items or of work at the longest kind queued or asked
            # for, as the queue holds partial batches of every bucket, not only this
            # request's.
            size = batcher.config.max_batch_size
            lone = batcher.lone_bucket()
            batches = 1 if lone is not None and all(b == lone for b in buckets) else 2
            queued = sum(batcher.depth(p) for p in range(priority + 1)) + len(buckets)
            if queued <= batches * size * share:
                return
            longest = max(batcher.longest_queued(), *buckets)
            target = max(self.config.standing_target_s,
                         batches * batcher.times.predict(longest, size))
            reason = "sustained overload: queue kept short"
        else:
            target = batcher.standing_after_s
            reason = (f"queue holds as much work as it may buffer ({1000 * target:.0f} ms "
                      "predicted, as VEGA_CODEL_INTERVAL_MS sets)")
        if ahead_s > target:
            code = "shed" if priority == SHEDDABLE else "queue_full"
            raise VegaError(code, reason,
                            retry_after_ms=max(MIN_RETRY_MS, 1000 * (ahead_s - target)))

    def _check_deadline(self, priority: int, buckets: Sequence[int], deadline: float,
                        ahead_s: float, now: float, arrived: float) -> None:
        batcher = self.batcher
        finish = now + ahead_s + self.config.margin_s
        size = batcher.config.max_batch_size
        worst = own_s = 0.0
        counts = ((buckets[0], 1),) if len(buckets) == 1 else Counter(buckets).items()
        idle = batcher.config.dispatch_when_idle  # then a free thread takes a batch at once
        free = idle and batcher.inflight < batcher.config.parallelism
        for bucket, mine in counts:
            worst = max(worst, self._first_batch_s(bucket, batcher.bucket_depth(bucket) + mine,
                                                   free))
            if mine > size:  # the full batches its own items need past that one, in turn
                own_s += (mine - 1) // size * batcher.times.predict(bucket, size)
        own_s /= batcher.config.parallelism
        if own_s > batcher.standing_after_s and priority != CRITICAL:
            # Its own later batches would wait past the interval and be shed at dispatch as
            # a standing queue's, on an idle server too: no retry could serve it whole.
            raise NeverFits("invalid_input", f"{len(buckets)} instances queue {1000 * own_s:.0f}"
                            f" ms behind their own batches, more than a "
                            f"{PRIORITY_NAMES[priority]} request may wait "
                            f"({1000 * batcher.standing_after_s:.0f} ms): send fewer per request")
        if finish + worst + own_s <= deadline:
            return
        # On an idle server from its arrival: past the deadline even then, no retry would
        # meet it either.
        alone_s = self.config.margin_s + own_s + max(
            self._first_batch_s(bucket, mine, idle) for bucket, mine in counts)
        if arrived + alone_s > deadline:
            raise NeverFits("invalid_input", f"predicted to take {1000 * alone_s:.1f} ms on "
                            f"an idle server, more than its deadline "
                            f"({1000 * (deadline - arrived):.1f} ms)")
        raise VegaError("deadline_unmeetable",
                        f"predicted to finish {1000 * (finish + worst + own_s - deadline):.1f} "
                        "ms after its deadline", retry_after_ms=max(MIN_RETRY_MS, 1000 * ahead_s))

    def _first_batch_s(self, bucket: int, waiting: int, free: bool = False) -> float:
        """Until the first batch of ``bucket`` with ``waiting`` items queued ends: one that
        will not fill waits out the window before it runs, unless a thread is ``free``."""
        config = self.batcher.config
        wait_s = 0.0 if free or waiting >= config.max_batch_size else config.max_wait_s
        return wait_s + self.batcher.times.predict(bucket, min(config.max_batch_size, waiting))

    def _drain_ms(self, items: int) -> float:
        """Milliseconds until ``items`` queued items have been served at the measured rate."""
        rate = self.batcher.rate.items_per_s
        if rate <= 0:
            return 1000.0  # nothing measured yet: the process is just starting
        return max(MIN_RETRY_MS, 1000 * items / rate)

    def retry_after_ms(self) -> float:
        """How long until the whole backlog is served: for 503s while draining."""
        return max(MIN_RETRY_MS, 1000 * self.batcher.backlog_s())


