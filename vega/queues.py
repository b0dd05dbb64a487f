"""Admitted items waiting in a batcher: one deque per (length bucket, class), and the
counts kept of them as items come and go.

``Batcher`` builds on this and reaches the deques and counts only through the methods
here: it queues an item (``_push``), looks at the heads (``_heads``, ``_lane``) and takes
a batch (``_take``). What admission, metrics and status read of the queue (depth per class
and per bucket, the backlog it predicts, an item's cost and bucket, the oldest item,
whether inline work waits, whether the queue stands: rule 5) is kept here, and the answers
given to items that leave it unrun (stale, or past their last call), so the batcher module
holds only the loop that forms and dispatches batches and what it has in flight.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable

from vega.errors import MIN_RETRY_MS, VegaError, missed_deadline
from vega.records import CLASS_NAMES, CRITICAL, JOB, PRIORITY_NAMES, Item
from vega.timing import BatchTimes

# The interval is at least this many batch times (a moving mean of those served, with
# this weight each): a queue cannot empty more often than its batches end, nor an item
# wait less than the batch running ahead of it. A model slower than the configured
# interval would otherwise find every queue standing and shed what it had admitted.
INTERVAL_BATCHES = 2
BATCH_TIME_WEIGHT = 0.1

INLINE, JOBS = slice(0, JOB), slice(JOB, JOB + 1)  # the classes a batch takes: a lane


class Queues:
    def __init__(self, buckets: tuple[int, ...], max_batch_size: int, parallelism: int,
                 standing_after_s: float) -> None:
        self._bounds = buckets  # upper length bound of each bucket
        self._batch_size, self._parallelism = max_batch_size, parallelism
        self.times = BatchTimes(len(buckets))  # what the backlog is predicted from
        self.interval_s = standing_after_s  # VEGA_CODEL_INTERVAL_MS (DESIGN.md rule 5)
        self.standing_after_s = standing_after_s  # the interval in force (fit_interval)
        self._batch_s = 0.0
        self._queues = [[deque[Item]() for _ in CLASS_NAMES] for _ in buckets]
        self._bucket_depth = [0] * len(buckets)  # inline items only
        self._job_bucket_depth = [0] * len(buckets)
        self._counts = [[0] * len(CLASS_NAMES) for _ in buckets]
        self._depth = [0] * len(CLASS_NAMES)
        self._inline_clear = asyncio.Event()  # set while no inline item is queued
        self._inline_clear.set()
        self._nonempty_since: float | None = None  # since when inline items have waited
        self._shed_at: float | None = None  # when a standing queue last shed a stale item
        self._drained_at: float | None = None  # when a batch last emptied its inline buckets

    def depth(self, priority: int | None = None) -> int:
        """Items queued of ``priority``, or of every inline class (job items apart)."""
        return sum(self._depth[:JOB]) if priority is None else self._depth[priority]

    def empty(self) -> bool:
        """No item is queued, job items included."""
        return not any(self._depth)

    def backlog_s(self, priority: int = len(PRIORITY_NAMES) - 1) -> float:
        """Predicted seconds to work through what is queued ahead of ``priority``, as the
        batches it will run in (rule 2): partial batches share one, not a full one each."""
        if not any(self._depth[: priority + 1]):
            return 0.0
        counts = [sum(c[: priority + 1]) if self._bucket_depth[b] else 0
                  for b, c in enumerate(self._counts)]
        return self.times.drain_s(counts, self._batch_size) / self._parallelism

    def item_cost(self, bucket: int) -> float:
        """Compute cost of one item in ``bucket``, in shortest-bucket items (rule 3)."""
        size = self._batch_size
        unit = self.times.per_item_s(0, size)
        return max(1.0, self.times.per_item_s(bucket, size) / unit) if unit > 0 else 1.0

    def bucket_of(self, length: int) -> int:
        """The bucket an item of ``length`` queues in (the last, if past every bound)."""
        for index, bound in enumerate(self._bounds):
            if length <= bound:
                return index
        return len(self._bounds) - 1

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
                    self._uncount(item)
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
                    self._uncount(item)
                    item.future.set_exception(refusal())
                    refused += 1
        return refused

    def shed_waited(self, bucket: int, now: float) -> None:
        """Shed the non-critical items of ``bucket`` that have waited out the interval, at
        the old end of each queue.

        Serving newest first leaves the oldest at the front; without this they would
        hold their places (and make the bucket look oldest) until their deadline."""
        since = now - self.standing_after_s
        for priority, queue in enumerate(self._queues[bucket][:JOB]):
            if priority == CRITICAL:
                continue
            while queue and (not queue[0].live or queue[0].enqueued_at < since):
                item = queue.popleft()
                if item.live:
                    self._uncount(item)
                    item.future.set_exception(self._stale(now))

    # -- for the loop that builds on this (vega.batcher) ------------------------------

    def _push(self, item: Item) -> bool:
        """Queue ``item`` and count it in; True when it heads its deque."""
        item.enqueued_at = asyncio.get_running_loop().time()
        item.queued_pc = time.perf_counter()
        queue = self._queues[item.bucket][item.priority]
        queue.append(item)
        item.counted = True
        self._depth[item.priority] += 1
        self._counts[item.bucket][item.priority] += 1
        if item.priority == JOB:  # job items make no queue stand and no inline wait
            self._job_bucket_depth[item.bucket] += 1
        else:
            self._bucket_depth[item.bucket] += 1
            if self._nonempty_since is None:
                self._nonempty_since = item.enqueued_at
                self._inline_clear.clear()
        return len(queue) == 1

    def _uncount(self, item: Item) -> None:
        """Count out ``item``, which left its deque or is about to (its future answered)."""
        item.counted = False
        self._depth[item.priority] -= 1
        self._counts[item.bucket][item.priority] -= 1
        if item.priority == JOB:
            self._job_bucket_depth[item.bucket] -= 1
            return
        self._bucket_depth[item.bucket] -= 1
        if not any(self._depth[:JOB]):
            self._nonempty_since = None
            self._inline_clear.set()

    def _lane(self) -> tuple[slice, list[int]]:
        """The classes the next batch takes, and their depth per bucket: the inline
        classes while any inline item is queued, else the job class (never both)."""
        if self._nonempty_since is not None:
            return INLINE, self._bucket_depth
        return JOBS, self._job_bucket_depth

    def _heads(self, bucket: int, lane: slice) -> list[Item | None]:
        """The first live item of each class of ``lane`` in ``bucket`` (None: none waits)."""
        return [first_live(queue) for queue in self._queues[bucket][lane]]

    def _busiest_job_bucket(self) -> int:
        """The bucket with the most job items queued (0 when none is)."""
        depth = self._job_bucket_depth
        return max(range(len(depth)), key=depth.__getitem__) if any(depth) else 0

    def _take(self, given: dict[int, int], items: list[Item], finish: float, now: float,
              lifo: bool, behind: bool) -> None:
        """Move up to ``count`` live items of each ``bucket: count`` of ``given`` into
        ``items``, critical first (newest first: ``lifo``), refusing those that cannot make
        their deadline by ``finish`` or (``behind``) are stale. If that empties the inline
        buckets taken from, the queue drained now (``behind``)."""
        lane, depth = self._lane()  # depth: the live counts, which the takes lower
        taken_at = time.perf_counter()  # one clock read a batch, not one an item
        for bucket, count in given.items():
            taken, item = 0, None
            try:
                for queue in self._queues[bucket][lane]:
                    while queue and taken < count:
                        item = queue.pop() if lifo else queue.popleft()
                        if not item.live:
                            continue
                        self._uncount(item)
                        item.queue_s = taken_at - item.queued_pc
                        refusal = self._refuse_at_dispatch(item, finish, now, behind)
                        if refusal is not None:
                            item.future.set_exception(refusal)
                        else:
                            items.append(item)
                            taken += 1
            except Exception:
                if item is not None and item not in items:  # popped, in no queue: pump fails it
                    items.append(item)
                raise
        if lane is INLINE and not any(depth[bucket] for bucket in given):
            self._drained_at = now

    def _refuse_at_dispatch(self, item: Item, finish: float, now: float,
                            behind: bool) -> VegaError | None:
        if item.deadline <= finish:
            return missed_deadline(item.deadline, now, self.backlog_s())
        if behind and item.priority != CRITICAL and \
                now - item.enqueued_at > self.standing_after_s:
            return self._stale(now)
        return None

    def _stale(self, now: float) -> VegaError:
        """The answer to an item a standing queue sheds (rule 5); noted for newest_first."""
        self._shed_at = now
        return VegaError("shed", "queued too long under sustained overload",
                         retry_after_ms=max(MIN_RETRY_MS, 1000 * self.backlog_s()))


def first_live(queue: deque[Item]) -> Item | None:
    """The first item of ``queue`` still waiting (answered or cancelled ones drop off)."""
    while queue and not queue[0].live:
        queue.popleft()
    return queue[0] if queue else None
