"""The batcher: length buckets, priorities, deadlines, and the size/wait triggers.

Items wait in one deque per (length bucket, class) (vega.queues). The loop wakes on events only:
an enqueue, a timer for when the oldest item's wait runs out (or a held batch falls due), or a
finished batch freeing a thread. Work-conserving (``dispatch_when_idle``), a free thread takes
what is queued at once, a busy one lets batches grow until a thread is about to free; otherwise
a batch is due when full or when its oldest item has waited ``max_wait_s``. Formed batches go to
an injected ``sink`` (the executor, or the overflow channel): no HTTP, torch or Redis here.

What admission, metrics and status read of the queue (depth, backlog, item cost) is kept in
vega.queues; of the batches in flight (spare threads, a stall, the service rate), here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vega.buckets import length_bounds, shares
from vega.config import Settings
from vega.errors import VegaError, missed_deadline
from vega.inflight import Inflight
from vega.queues import JOBS, Queues
from vega.records import CRITICAL, JOB, Batch, Item, fail_items
from vega.timing import ServiceRate

log = logging.getLogger("vega.batcher")

# While every thread is busy, the next batch is formed shortly before a thread is
# predicted to free: FORM_AHEAD of the freeing batch's predicted time ahead, at least
# FORM_AHEAD_MIN_S (the loop's clock ticks in ms). Formed earlier it waits out the running
# batch while fresher items queue behind it; formed later the thread sits idle. The lead
# is the freeing batch's, not the candidate's, or long buckets always fall due first.
# Behind a full batch's worth of queue the batch is chosen from what already waits, so it
# goes as far ahead as batch ends were lately seen late (late_s), FORM_AHEAD_DEEP_S at least.
FORM_AHEAD = 0.3
FORM_AHEAD_MIN_S = 0.002
FORM_AHEAD_DEEP_S = 0.004
SWEEP_S = 0.005  # how often the queue's heads are checked against their deadlines
# A batch this many times its predicted run past its predicted end, and this long at
# least, is hung: the process turns not-ready until it ends (stalled).
STALL_FACTOR, STALL_MIN_S = 10.0, 2.0

Sink = Callable[[Batch], Awaitable[None]]
BatchObserver = Callable[[Batch], None]


@dataclass(frozen=True)
class BatcherConfig:
    model: str
    buckets: tuple[int, ...]  # upper length bound of each bucket
    max_batch_size: int
    max_wait_s: float
    max_inflight: int
    # Work-conserving: an idle executor thread gets what is queued now. Waiting for a
    # fuller batch only pays while the threads are busy; idle, it is latency for nothing.
    dispatch_when_idle: bool = False  # VEGA_DISPATCH_WHEN_IDLE turns it on by default
    # The sink may hand a batch to a peer (overflow): then a partial batch is still formed
    # at the wait trigger while the threads are busy, so that an idle peer can take it.
    hands_off: bool = False
    parallelism: int = 1  # executor threads running batches at once
    standing_after_s: float = 0.1  # CoDel interval (DESIGN.md rule 5)
    # A job batch is cut to what is predicted to run in this long: an inline request
    # that arrives while it runs waits at most that.
    job_batch_s: float = 0.02
    # The length the model pads a batch's longest window to (a compiled package rounds up).
    pad: Callable[[int], int] | None = None
    min_length: int = 1  # the shortest window the model takes: no bucket ends below it

    @classmethod
    def from_settings(cls, s: Settings, model: str, max_length: int, hands_off: bool = False,
                      pad: Callable[[int], int] | None = None,
                      min_length: int = 1) -> BatcherConfig:
        """A model's batcher as the settings describe it (the simulator builds the same)."""
        return cls(model=model, buckets=length_bounds(s.length_buckets, max_length, min_length),
                   pad=pad, min_length=min_length,
                   max_batch_size=s.max_batch_size, max_wait_s=s.max_wait_ms / 1000,
                   dispatch_when_idle=s.dispatch_when_idle, hands_off=hands_off,
                   max_inflight=s.max_inflight_batches, parallelism=s.executor_threads,
                   standing_after_s=s.codel_interval_ms / 1000,
                   job_batch_s=s.jobs_batch_ms / 1000)


class Batcher(Queues):
    def __init__(self, config: BatcherConfig, sink: Sink,
                 on_batch_done: BatchObserver | None = None) -> None:
        super().__init__(config.buckets, config.max_batch_size, config.parallelism,
                         config.standing_after_s)
        self.config = config
        self.rate = ServiceRate(config.parallelism)
        self._sink = sink
        self._on_batch_done = on_batch_done
        self._wake = asyncio.Event()
        self._running = False  # while run() is looping
        self._inflight = Inflight(config.parallelism)
        self._idle = asyncio.Event()  # set while nothing is queued or in flight
        self._idle.set()
        self._swept_at, self._next_last_call = -math.inf, math.inf  # see _last_calls

    def with_config(self, config: BatcherConfig) -> Batcher:
        return Batcher(config, self._sink, self._on_batch_done)

    # -- what peers, status and a drain read of the batches in flight ----------------

    @property
    def spare_threads(self) -> int:
        """Executor threads this batcher's own work leaves free now: what peers may borrow
        (its own queued items come first: a process steals only when it has none)."""
        if self.depth():
            return 0
        return max(0, self.config.parallelism - len(self._inflight))

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def wait_idle(self) -> None:
        """Return once nothing is queued or in flight (for drain)."""
        while not self.empty() or self._inflight:
            await self._idle.wait()

    # -- the request side ----------------------------------------------------------

    def enqueue(self, item: Item) -> None:
        """Queue an admitted item; its future is answered exactly once from here on."""
        if self._push(item) and item.priority != JOB:  # a new head: its last call may come first
            last_call = item.deadline - self._last_call_lead(item.bucket)
            self._next_last_call = min(self._next_last_call, last_call)
        self._idle.clear()
        item.future.add_done_callback(functools.partial(self._left_queue, item))
        self._wake.set()

    def _maybe_idle(self) -> None:  # not for a batch formed but not yet dispatched (drain)
        if self.empty() and not self._inflight:
            self._idle.set()

    def _left_queue(self, item: Item, _future: asyncio.Future[Any]) -> None:
        # Answered or cancelled while queued: the deque drops it at its front, the counts now.
        if item.counted:
            self._uncount(item)
            self._maybe_idle()

    # -- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Form and dispatch batches until cancelled."""
        loop = asyncio.get_running_loop()
        self._running = True
        try:
            while True:
                self._wake.clear()
                wake_at = self.pump()
                timer = loop.call_at(wake_at, self._pump_here) if wake_at is not None else None
                try:
                    await self._wake.wait()
                finally:
                    if timer is not None:
                        timer.cancel()
        finally:
            self._running = False  # stopped: a batch that finishes now starts no other

    def _pump_here(self) -> None:
        """Start what is due now, in this callback (the timer's, a finished batch's), then
        let the loop task recompute its timer. Woken through the task, a batch waited behind
        every handler queued on the loop, and one formed ahead reached an idle model process."""
        try:
            if self._running:
                self.pump()
        finally:
            self._wake.set()

    def pump(self) -> float | None:
        """Dispatch every batch that is due now; return when one next falls due by waiting.

        Synchronous, so a batch's end starts the next one at once (``batch.on_end`` calls
        ``_released``, then ``_pump_here``). None: nothing falls due by time alone.
        """
        loop = asyncio.get_running_loop()
        wake_at: float | None = None
        while len(self._inflight) < self.config.max_inflight:
            now = loop.time()
            bucket, wake_at = self._pick(now)
            if bucket is None:
                break
            wake_at = None
            taken: list[Item] = []  # the batch's items, taken from the queues one by one
            try:
                batch = self._form(bucket, now, taken)
                if batch.items:
                    self._dispatch(batch)
                else:
                    self._maybe_idle()
            except Exception:
                log.exception("batch loop error; failing the batch and going on")
                fail_items(taken, VegaError("model_error", "internal error forming batch"))
                return now  # look again once pending callbacks have run, not in a tight loop
        last_call = self._last_calls(loop.time())
        if last_call is None or (wake_at is not None and wake_at <= last_call):
            return wake_at
        return last_call

    def _last_calls(self, now: float) -> float | None:
        """Rule 1 once more, for what waits: an item that can no longer make its deadline
        is refused now (429; 504 once it has passed), not left to expire in the queue: its
        last call leaves a batch of one's predicted time and SWEEP_S. Looked at when the
        first last call falls due and, as the drift moves the lead, when the loop passes by,
        once per SWEEP_S at most. Returns the next last call once it is within an interval
        (until then every enqueue and batch end passes by: no timer)."""
        if not self.depth():
            self._next_last_call = math.inf
        elif now >= self._next_last_call or now >= self._swept_at + SWEEP_S:
            self._swept_at = now
            self._next_last_call = self.refuse_hopeless(
                now, self._last_call_lead,
                lambda item: missed_deadline(item.deadline, now, self.backlog_s()))
            self._maybe_idle()  # the refused may have been the last: a drain waits on it
        return self._next_last_call if self._next_last_call < now + self.standing_after_s \
            else None

    def _last_call_lead(self, bucket: int) -> float:
        return self.times.predict(bucket, 1) + SWEEP_S

    def _pick(self, now: float) -> tuple[int | None, float | None]:
        """The bucket to dispatch now (top class at its head, then oldest), or when to look next."""
        best: tuple[int, tuple[int, float]] | None = None
        chosen = None
        wake_at: float | None = None
        idle = self.config.dispatch_when_idle and len(self._inflight) < self.config.parallelism
        hold = self.config.dispatch_when_idle and not self.config.hands_off
        lane, depth = self._lane()
        if lane is JOBS:
            # A job batch goes only to a free thread, never formed ahead: an inline item
            # arriving then waits for at most the rest of one batch, not a queue of them.
            if len(self._inflight) >= self.config.parallelism:
                return None, None  # a finishing batch wakes the loop
            idle = True
        run = self._inflight.freeing_run() if hold and not idle else None
        deep = run is not None and self.depth() >= self.config.max_batch_size
        lead = max(FORM_AHEAD_DEEP_S, self._inflight.late_s) if deep else FORM_AHEAD_MIN_S
        form_at = now if run is None else _form_at(*run, lead)
        # A partial batch, too, is formed ahead of a predicted end: held until the thread
        # freed, it reached the model a loop turn and a thread hand-off late.
        partial_ahead = run is not None and run[1] > run[0]
        for bucket, queued in enumerate(depth):
            if not queued:
                continue
            heads = self._heads(bucket, lane)
            if all(item is None for item in heads):
                continue  # answered or cancelled, its done callback (the counts) not run yet
            oldest = min(item.enqueued_at for item in heads if item is not None)
            ready_at = oldest + self.config.max_wait_s
            full = depth[bucket] >= self.config.max_batch_size
            due = full or partial_ahead
            if due and form_at > now:  # formed now, it would only wait behind the running batch
                wake_at = form_at if wake_at is None else min(wake_at, form_at)
                continue
            # Work-conserving: a free thread takes what is here now; while every thread is busy,
            # a batch held grows until shortly before a thread frees (batches grow with load).
            if idle or due or (not hold and ready_at <= now):
                # A bucket that waited an interval ranks at the top class: by class alone, one
                # seldom holding a critical item waited behind those that do to its deadline.
                top = CRITICAL if now - oldest > self.standing_after_s else next(
                    p for p, item in enumerate(heads) if item is not None)
                ranked = idle or (partial_ahead and not full)  # full ones first, oldest first
                key = (top, self._urgency(bucket, oldest, now) if ranked else (0, oldest))
                if best is None or key < best:
                    best, chosen = key, bucket
            elif not hold and (wake_at is None or ready_at < wake_at):
                wake_at = ready_at
        return chosen, wake_at

    def _urgency(self, bucket: int, oldest: float, now: float) -> tuple[int, float]:
        """Order of the buckets an idle thread may take (lowest first).

        The batch serving the most items per second of model time goes first, so cheap
        windows wait behind no expensive ones; an item passed over for two of its own
        batches' time, or a quarter of the CoDel interval at most (so that its batch ends
        before a standing queue would shed it), goes before those, oldest first."""
        size = self.config.max_batch_size
        overdue_s = min(2 * self.times.predict(bucket, size), self.standing_after_s / 4)
        if now - oldest > overdue_s:
            return (0, oldest)
        given = self._shares(bucket)
        items = min(size, sum(given.values()))
        seconds = self.times.predict(max(given), items)
        return (1, -items / seconds if seconds > 0 else oldest)

    def _form(self, bucket: int, now: float, items: list[Item]) -> Batch:
        behind = self.behind(now)
        if behind:
            self.shed_waited(bucket, now)
        lifo = self.newest_first(now)
        given = self._shares(bucket)
        top = max(given)
        size = min(self.config.max_batch_size, sum(given.values()))
        run = self._inflight.freeing_run()  # formed ahead, it starts once the running batch ends
        finish = (now if run is None else max(now, run[1])) + self.times.predict(top, size)
        self._take(given, items, finish, now, lifo, behind)
        pad_to = max((item.length for item in items), default=0)
        return Batch(model=self.config.model, bucket=top, items=items, isolate=True,
                     pad_to=pad_to if self.config.pad is None else self.config.pad(pad_to))

    def _shares(self, bucket: int) -> dict[int, int]:
        """How many items each bucket gives the batch formed for ``bucket`` (the merge
        rule: vega.buckets.shares)."""
        lane, depth = self._lane()
        cap = self._job_cap(bucket) if lane is JOBS else self.config.max_batch_size
        return shares(bucket, depth, cap, self.times.predict)

    def stalled(self, now: float) -> bool:
        """A batch in flight is far past its predicted end (STALL_FACTOR times its run, and
        STALL_MIN_S at least): its model is hung, long before VEGA_MODEL_TIMEOUT_S kills it."""
        return self._inflight.overdue(now, STALL_FACTOR, STALL_MIN_S)

    def job_items_per_s(self) -> float:
        """Job items run per second of a free thread's time: the measured service rate,
        less what cutting job batches to ``job_batch_s`` costs (rule 2's lines)."""
        bucket = self._busiest_job_bucket()
        full, cut = self.config.max_batch_size, self._job_cap(bucket)
        full_s, cut_s = self.times.predict(bucket, full), self.times.predict(bucket, cut)
        if full_s <= 0 or cut_s <= 0:
            return self.rate.items_per_s
        return self.rate.items_per_s * min(1.0, (cut / cut_s) / (full / full_s))

    def _job_cap(self, bucket: int) -> int:
        """The largest job batch of ``bucket`` predicted to run within ``job_batch_s``."""
        size = self.config.max_batch_size
        while size > 1 and self.times.predict(bucket, size) > self.config.job_batch_s:
            size -= 1
        return size

    def _dispatch(self, batch: Batch) -> None:
        batch.on_end = self._ended
        done = asyncio.ensure_future(self._sink(batch))
        self._track(batch)
        done.add_done_callback(functools.partial(self._finished, batch))

    def hold(self, batch: Batch, done: asyncio.Future[None]) -> None:
        """Count a batch of our own that runs here undispatched (one taken back from peers):
        it holds a thread, so the waits, spare threads and idleness must see it till it ends."""
        self._track(batch)
        batch.on_end = self._released  # freed as early as a dispatched batch, not measured
        done.add_done_callback(lambda _done: self._released(batch))

    def _track(self, batch: Batch) -> None:
        self._inflight.add(batch, asyncio.get_running_loop().time(),
                           self.times.predict(batch.bucket, batch.size))
        self._idle.clear()

    def _released(self, batch: Batch) -> None:
        """A batch ended, dispatched or held: its thread is free, so start what is due
        now, before the handlers the batch woke. Once, whichever tells of the end first."""
        if batch in self._inflight:
            self._inflight.remove(batch, asyncio.get_running_loop().time(), batch.ended_at)
            self._pump_here()
        self._maybe_idle()

    def _ended(self, batch: Batch) -> None:
        """The batch ended (its runner says so first; else its future's callback does):
        measured if it ran, and its thread freed."""
        if batch in self._inflight and batch.infer_s > 0:
            self.times.observe(batch.bucket, batch.size, batch.infer_s)
            self.fit_interval(batch.infer_s)
            self.rate.observe(batch.size, sum(item.cost for item in batch.items), batch.infer_s)
        self._released(batch)  # measured first: the next batch is predicted with it

    def _finished(self, batch: Batch, done: asyncio.Future[None]) -> None:
        error = None if done.cancelled() else done.exception()
        if error is not None:
            log.error("batch %d failed outside the model: %r", batch.id, error)
            batch.fail(VegaError("model_error", "batch failed"))
        if batch.on_end == self._ended:  # else taken back and held: its run here frees it
            self._ended(batch)
        if self._on_batch_done is not None:
            self._on_batch_done(batch)


def _form_at(start: float, end: float, least_lead: float) -> float:
    """When the batch after one predicted to run from ``start`` to ``end`` may be formed."""
    return end - max(least_lead, FORM_AHEAD * (end - start))
