"""Admitted items waiting in a batcher: one deque per (length bucket, class), and the
counts kept of them as items come and go.

``Batcher`` builds on this; what admission, metrics and status read of the queue (depth
per class, depth per bucket, the oldest item, whether inline work waits) is kept here,
so the batcher module holds only the loop that forms and dispatches batches.
"""

from __future__ import annotations

import asyncio
from collections import deque

from vega.records import CLASS_NAMES, JOB, Item


class Queues:
    def __init__(self, buckets: int) -> None:
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

    def depth(self, priority: int | None = None) -> int:
        """Items queued of ``priority``, or of every inline class (job items apart)."""
        return sum(self._depth[:JOB]) if priority is None else self._depth[priority]

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
