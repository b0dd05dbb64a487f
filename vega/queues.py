"""Admitted items waiting in a batcher: one deque per (length bucket, class), and the
counts kept of them as items come and go.

``Batcher`` builds on this; what admission, metrics and status read of the queue (depth
per class, depth per bucket, the oldest item, whether inline work waits, whether the queue
stands: rule 5) is kept here, and the answers given to items that leave it unrun (stale,
or past their last call), so the batcher module holds only the loop that forms and
dispatches batches.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable

from vega.records import CLASS_NAMES, CRITICAL, JOB, Item


# The interval is at least this many batch times (a moving mean of those served, with
# this weight each): a queue cannot empty more often than its batches end, nor an item
# wait less than the batch running ahead of it. A model slower than the configured
# interval would otherwise find every queue standing and shed what it had admitted.
INTERVAL_BATCHES = 2
BATCH_TIME_WEIGHT = 0.1


class Queues:
    def __init__(self, buckets: int, standing_after_s: float) -> None:
        self.interval_s = standing_after_s  # VEGA_CODEL_INTERVAL_MS (DESIGN.md rule 5)
        self.standing_after_s = standing_after_s  # the interval in force (fit_interval)
        self._batch_s = 0.0
        self._queues = [[deque[Item]() for _ in CLASS_NAMES] for _ in range(buckets)]
        self._bucket_depth = [0] * buckets  # inline items only
        self._job_bucket_depth = [0] * buckets
        self._counts = [[0] * len(CLASS_NAMES) for _ in range(buckets)]
        self._depth = [0] * len(CLASS_NAMES)
        self._cost = [0.0] * len(CLASS_NAMES)
        self._inline_clear = asyncio.Event()  # set while no inline item is queued
        self._inline_clear.set()
        self._nonempty_since: float | None = None  # since when inline items have waited
        self._idle = asyncio.Event()  # set while nothing is queued or in flight
        self._idle.set()
        self._shed_at: float | None = None  # when a standing queue last shed a stale item
        self._drained_at: float | None = None  # when a batch last emptied its inline buckets

    def depth(self, priority: int | None = None) -> int:
        """Items queued of ``priority``, or of every inline class (job items apart)."""
        return sum(self._depth[:JOB]) if priority is None else self._depth[priority]

    def fit_interval(self, batch_s: float, weight: float = BATCH_TIME_WEIGHT) -> None:
        """A batch took ``batch_s``: the interval in force is the configured one, or
        INTERVAL_BATCHES batch times where those are longer."""
        self._batch_s += weight * (batch_s - self._batch_s)
        self.standing_after_s = max(self.interval_s, INTERVAL_BATCHES * self._batch_s)

    def standing(self, now: float) -> bool:
        """The queue has not emptied for an interval (rule 5): admission keeps it short."""
        since = self._nonempty_since
        return since is not None and now - since > self.standing_after_s

    def behind(self, now: float) -> bool:
        """A standing queue in which no batch formed within the interval took every item
        of its buckets: the batches are not keeping up, so stale items are shed.

        With length buckets the queue as a whole may never empty under a load the server
        carries: each bucket waits its turn and is emptied by its batch, and an item that
        waits a little past the interval for that turn is still served."""
        drained = self._drained_at
        return self.standing(now) and \
            (drained is None or now - drained > self.standing_after_s)

    def newest_first(self, now: float) -> bool:
        """While a standing queue has shed within the interval: newest first (rule 5).

        A load the server carries can keep the queue from emptying with no item waiting
        out the interval; newest first would make its oldest wait it out and be shed."""
        shed_at = self._shed_at
        return shed_at is not None and now - shed_at < self.standing_after_s \
            and self.behind(now)

    async def wait_no_inline(self) -> None:
        """Return once no inline item is queued: when the async lane may feed job items."""
        while self._nonempty_since is not None:
            await self._inline_clear.wait()

    def longest_queued(self) -> int:
        """The longest bucket with items queued (0 when none is)."""
        return next((b for b in range(len(self._bucket_depth) - 1, -1, -1)
                     if self._bucket_depth[b]), 0)

    def lone_bucket(self) -> int | None:
        """The one bucket with items queued; None when none is, or several are."""
        occupied = [b for b, depth in enumerate(self._bucket_depth) if depth]
        return occupied[0] if len(occupied) == 1 else None

    def bucket_depth(self, bucket: int) -> int:
        return self._bucket_depth[bucket]

    def oldest(self, priority: int) -> float | None:
        """When the oldest live item of ``priority`` was queued (loop clock), or None."""
        heads = (first_live(queues[priority]) for queues in self._queues)
        return min((item.enqueued_at for item in heads if item is not None), default=None)

    def refuse_hopeless(self, now: float, lead: Callable[[int], float],
                        refusal: Callable[[Item], BaseException]) -> float:
        """Answer ``refusal(item)`` to each inline item at the head of its queue that could
        not end by its deadline even if a batch of its bucket took it now (``lead(bucket)``
        seconds ahead of it); return when the next head reaches that point (inf: none).

        Only heads are looked at, so this costs a few steps per bucket: a deque is in
        arrival order, which is deadline order for callers who ask the same deadline."""
        next_at = math.inf
        for bucket, queues in enumerate(self._queues):
            if not self._bucket_depth[bucket]:
                continue
            ahead = lead(bucket)
            for queue in queues[:JOB]:
                while (item := first_live(queue)) is not None:
                    if item.deadline - ahead > now:
                        next_at = min(next_at, item.deadline - ahead)
                        break
                    queue.popleft()
                    self._count(item, -1)
                    item.future.set_exception(refusal(item))
        return next_at

    def refuse_queued(self, refusal: Callable[[], BaseException]) -> int:
        """Answer ``refusal()`` to every item still queued, job items included (a stop that
        could wait no longer: none of them began); return how many."""
        refused = 0
        for queues in self._queues:
            for queue in queues:
                while (item := first_live(queue)) is not None:
                    queue.popleft()
                    self._count(item, -1)
                    item.future.set_exception(refusal())
                    refused += 1
        return refused

    def shed_waited(self, bucket: int, since: float, refusal: Callable[[], BaseException]
                    ) -> None:
        """Answer ``refusal()`` to the non-critical items of ``bucket`` queued before
        ``since``, at the old end of each queue.

        Serving newest first leaves the oldest at the front; without this they would
        hold their places (and make the bucket look oldest) until their deadline."""
        for priority, queue in enumerate(self._queues[bucket][:JOB]):
            if priority == CRITICAL:
                continue
            while queue and (not queue[0].live or queue[0].enqueued_at < since):
                item = queue.popleft()
                if item.live:
                    self._count(item, -1)
                    item.future.set_exception(refusal())

    def _count(self, item: Item, sign: int) -> None:
        item.counted = sign > 0
        self._depth[item.priority] += sign
        self._cost[item.priority] += sign * item.cost
        self._counts[item.bucket][item.priority] += sign
        if sign > 0:
            self._idle.clear()
        if item.priority == JOB:  # job items make no queue stand and no inline wait
            self._job_bucket_depth[item.bucket] += sign
            return
        self._bucket_depth[item.bucket] += sign
        if sign > 0 and self._nonempty_since is None:
            self._nonempty_since = item.enqueued_at
            self._inline_clear.clear()
        elif sign < 0 and not any(self._depth[:JOB]):
            self._nonempty_since = None
            self._inline_clear.set()


def first_live(queue: deque[Item]) -> Item | None:
    """The first item of ``queue`` still waiting (answered or cancelled ones drop off)."""
    while queue and not queue[0].live:
        queue.popleft()
    return queue[0] if queue else None
