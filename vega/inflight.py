"""The batches in flight on a pool of executor threads, each with its predicted run.

The batcher keeps one per model: what it dispatched and what runs here without having
been dispatched now (a batch taken back from peers). From it the batcher reads when a
thread will free, so it forms the next batch just ahead of that; admission and the
heartbeat read how many threads are busy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable

# Batch ends the lateness is taken from: enough to span a burst of the loop's busy turns,
# few enough that a burst past is forgotten within a few batches' time.
LATE_ENDS = 16

Run = tuple[float, float]  # predicted (start, end), loop clock


class Inflight:
    """Batches running or waiting for a thread, in the order the pool starts them (FIFO)."""

    def __init__(self, parallelism: int) -> None:
        self.parallelism = parallelism
        self._runs: dict[Hashable, Run] = {}  # by batch
        self._late: deque[float] = deque(maxlen=LATE_ENDS)
        # The most that one of the last LATE_ENDS batches was seen ending past its predicted
        # end (never below 0). The loop sees an end only when it gets to it, and a loop that
        # busy runs its timers as late: a batch formed only just ahead leaves the model waiting.
        self.late_s = 0.0

    def __len__(self) -> int:
        return len(self._runs)

    def __contains__(self, batch: Hashable) -> bool:
        return batch in self._runs

    def add(self, batch: Hashable, now: float, run_s: float) -> None:
        """A batch handed to the pool now, predicted to run ``run_s`` once it has a thread."""
        freeing = self.freeing_run()
        start = now if freeing is None else max(now, freeing[1])
        self._runs[batch] = (start, start + run_s)

    def remove(self, batch: Hashable, now: float, ended_at: float | None = None) -> None:
        """``batch`` was seen ended at ``now`` (loop clock); it ended at ``ended_at``
        (time.monotonic(), from whoever ran it) where known."""
        start, end = self._runs.pop(batch)
        self._late.append(max(0.0, now - end))
        self.late_s = max(self._late)  # once per batch end, not per look at the queue
        # A batch queued behind this one started when this one ended: not when predicted,
        # nor when a busy loop got to the end.
        ended = now if ended_at is None else now - max(0.0, time.monotonic() - ended_at)
        shift = max(start, ended) - end
        for other, (other_start, other_end) in list(self._runs.items()):
            if other_start >= end:
                self._runs[other] = (other_start + shift, other_end + shift)

    def overdue(self, now: float, factor: float, least_s: float) -> bool:
        """Whether a batch is past its predicted end by ``factor`` times its predicted run,
        and by ``least_s`` at least: a model that hangs, not one running slow."""
        return any(now - end > max(least_s, factor * (end - start))
                   for start, end in self._runs.values())

    def freeing_run(self) -> Run | None:
        """Predicted run of the batch whose end frees a thread for one more; None: one is free."""
        queued = len(self._runs) - self.parallelism
        if queued < 0:
            return None
        return sorted(self._runs.values(), key=lambda run: run[1])[queued]
