"""The batcher as a function fed by enqueue, with a recording sink held open by a gate
(on the virtual clock: see conftest.py here)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from vega.batcher import FORM_AHEAD, FORM_AHEAD_DEEP_S, FORM_AHEAD_MIN_S, Batcher, BatcherConfig
from vega.errors import VegaError
from vega.inflight import LATE_ENDS, Inflight
from vega.records import CRITICAL, JOB, NORMAL, SHEDDABLE, Batch, Item
from vega.warmup import seed_batch_times


class RecordingSink:
    """Records each batch; holds it until ``gate`` is set; answers each item with its id."""

    def __init__(self, fail_on: Callable[[Batch], bool] | None = None) -> None:
        self.batches: list[Batch] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.running = 0
        self.max_running = 0
        self.fail_on = fail_on

    async def __call__(self, batch: Batch) -> None:
        self.batches.append(batch)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
            if self.fail_on is not None and self.fail_on(batch):
                raise RuntimeError("sink failed")
            batch.infer_s = 0.001
            for item in batch.items:
                if not item.future.done():
                    item.future.set_result(item.id)
        finally:
            self.running -= 1


def config(**changes: object) -> BatcherConfig:
    base = dict(model="m", buckets=(16, 64, 512), max_batch_size=4, max_wait_s=0.02,
                max_inflight=2)
    base.update(changes)
    return BatcherConfig(**base)  # type: ignore[arg-type]


Start = Callable[..., tuple[Batcher, RecordingSink]]


@pytest.fixture
async def running() -> AsyncIterator[Callable[..., tuple[Batcher, RecordingSink]]]:
    tasks: list[asyncio.Task[None]] = []

    def start(sink: RecordingSink | None = None,
              **changes: object) -> tuple[Batcher, RecordingSink]:
        sink = sink or RecordingSink()
        batcher = Batcher(config(**changes), sink)
        tasks.append(asyncio.create_task(batcher.run()))
        return batcher, sink

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def item(batcher: Batcher, length: int = 10, priority: int = NORMAL,
         deadline_s: float = 10.0, sample: Any = None) -> Item:
    loop = asyncio.get_running_loop()
    new = Item(sample=sample, length=length, priority=priority,
               deadline=loop.time() + deadline_s, future=loop.create_future(),
               bucket=batcher.bucket_of(length))
    batcher.enqueue(new)
    return new


async def test_size_trigger_dispatches_full_batch_before_the_wait(running: Start) -> None:
    batcher, sink = running(max_wait_s=60.0)
    items = [item(batcher) for _ in range(4)]
    await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 5)
    assert [b.size for b in sink.batches] == [4]


async def test_wait_trigger_dispatches_partial_batch(running: Start) -> None:
    batcher, sink = running(max_wait_s=0.01)
    items = [item(batcher) for _ in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 5)
    assert results == [i.id for i in items]
    assert [b.size for b in sink.batches] == [3]


async def test_idle_executor_gets_what_is_queued_at_once(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, dispatch_when_idle=True, max_wait_s=60.0)
    first = item(batcher)
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 1), 5)  # not after 60 s
    sink.gate.set()
    await asyncio.wait_for(first.future, 5)
    assert [b.size for b in sink.batches] == [1]


async def test_busy_executor_holds_a_partial_batch_past_the_wait(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, dispatch_when_idle=True, max_wait_s=0.01, max_batch_size=4,
                         standing_after_s=60.0)
    first = item(batcher)
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 1), 5)
    later = [item(batcher) for _ in range(2)]
    await asyncio.sleep(0.1)  # ten times the wait
    # Sent now, they would only queue behind the running batch at size 2; with no batch
    # time measured there is no predicted end to form them ahead of.
    assert len(sink.batches) == 1 and batcher.depth() == 2
    more = [item(batcher) for _ in range(2)]
    await asyncio.sleep(0.05)
    # A full batch still goes ahead (pipelining); the leftover keeps waiting.
    assert [b.size for b in sink.batches] == [1, 4] and batcher.depth() == 0
    straggler = item(batcher)
    await asyncio.sleep(0.05)
    assert len(sink.batches) == 2 and batcher.depth() == 1
    sink.gate.set()
    everyone = [first, *later, *more, straggler]
    await asyncio.wait_for(asyncio.gather(*(i.future for i in everyone)), 5)
    assert [b.size for b in sink.batches] == [1, 4, 1]


async def _busy_with_a_full_batch(running: Start, predicted_s: dict[int, float],
                                  ) -> tuple[Batcher, RecordingSink, list[Item]]:
    """A work-conserving batcher (batches of 4) whose thread runs a full batch of bucket 0,
    held open, with these predicted times per bucket for a full batch."""
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, dispatch_when_idle=True, max_wait_s=60.0, max_batch_size=4,
                         standing_after_s=60.0)
    for bucket, seconds in predicted_s.items():
        for _ in range(3):
            batcher.times.observe(bucket, 4, seconds)
    first = [item(batcher) for _ in range(4)]
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 1), 5)
    return batcher, sink, first


async def test_while_busy_a_full_batch_forms_just_before_the_thread_frees(running: Start) -> None:
    started = asyncio.get_running_loop().time()
    batcher, sink, first = await _busy_with_a_full_batch(running, {0: 0.4})
    second = [item(batcher) for _ in range(4)]  # full while the thread is busy
    await asyncio.sleep(0.1)
    # Sent now, it would wait ~0.3 s behind the running batch: it stays in the queue.
    assert len(sink.batches) == 1 and batcher.depth() == 4
    # It goes FORM_AHEAD of the running batch's predicted time (0.12 s) before that batch's
    # predicted end (0.4 s), while it still runs.
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 2), 5)
    assert asyncio.get_running_loop().time() - started >= 0.4 * (1 - FORM_AHEAD) - 0.01
    assert sink.running == 2 and not any(i.future.done() for i in first)
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + second)), 5)


async def test_while_busy_a_partial_batch_forms_just_before_the_thread_frees(running: Start
                                                                               ) -> None:
    started = asyncio.get_running_loop().time()
    batcher, sink, first = await _busy_with_a_full_batch(running, {0: 0.4})
    second = [item(batcher) for _ in range(2)]  # half a batch, well within its 60-s wait
    await asyncio.sleep(0.1)
    assert len(sink.batches) == 1 and batcher.depth() == 2  # it grows while the thread is busy
    # Like a full one, it goes FORM_AHEAD of the running batch's predicted time before that
    # batch's predicted end, while it still runs: the thread does not wait for the loop.
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 2), 5)
    assert asyncio.get_running_loop().time() - started >= 0.4 * (1 - FORM_AHEAD) - 0.01
    assert sink.running == 2 and not any(i.future.done() for i in first)
    assert sink.batches[1].size == 2
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + second)), 5)


async def test_behind_a_full_batch_of_queue_the_next_one_is_formed_further_ahead() -> None:
    # A batch predicted at 5 ms runs; 30% of that is under either least lead. Behind half a
    # batch the next one falls due FORM_AHEAD_MIN_S before the running one's predicted end;
    # behind a full batch's worth over two buckets, FORM_AHEAD_DEEP_S before it.
    batcher, sink = held({0: (0.001, 0.001), 1: (0.001, 0.001)})
    first = [item(batcher) for _ in range(4)]
    assert batcher.pump() is None  # the idle thread took the full batch
    end = asyncio.get_running_loop().time() + 0.005
    later = [item(batcher, length=10), item(batcher, length=40)]
    assert batcher.pump() == pytest.approx(end - FORM_AHEAD_MIN_S)
    later += [item(batcher, length=10), item(batcher, length=40)]
    assert batcher.pump() == pytest.approx(end - FORM_AHEAD_DEEP_S)
    await _answered(batcher, sink, first + later)


async def _answered(batcher: Batcher, sink: RecordingSink, items: list[Item]) -> None:
    """Open the sink and run the batcher until ``items`` are answered."""
    task = asyncio.create_task(batcher.run())
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_behind_a_full_batch_of_queue_the_lead_covers_batch_ends_seen_late() -> None:
    # A batch predicted at 20 ms is seen ending 60 ms after it started: a loop busy with a
    # burst gets to an end, and to its timers, that late. Behind a full batch's worth of
    # queue the next one is then formed 40 ms ahead of the running batch's predicted end,
    # here as soon as that batch starts; behind half a batch the usual lead holds.
    batcher, sink = held({0: (0.004, 0.004), 1: (0.004, 0.004), 2: (0.004, 0.004)})
    loop = asyncio.get_running_loop()
    first = [item(batcher, length=500) for _ in range(4)]  # its 1-ms answer costs bucket 2
    assert batcher.pump() is None  # the idle thread took the full batch
    await asyncio.sleep(0.060)
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first)), 5)
    await _until(lambda: batcher.inflight == 0)
    sink.gate.clear()
    second = [item(batcher) for _ in range(4)]
    assert batcher.pump() is None  # the idle thread took it
    run_s = batcher.times.predict(0, 4)
    end = loop.time() + run_s
    await _until(lambda: len(sink.batches) == 2)
    later = [item(batcher, length=10), item(batcher, length=40)]
    assert batcher.pump() == pytest.approx(end - FORM_AHEAD * run_s)  # half a batch: it waits
    later += [item(batcher, length=10), item(batcher, length=40)]
    assert batcher.pump() is None and batcher.depth() == 0  # deep: formed now
    await _answered(batcher, sink, second + later)


async def test_the_lateness_of_batch_ends_is_forgotten_after_a_few_batches() -> None:
    inflight = Inflight(parallelism=1)
    loop = asyncio.get_running_loop()

    def ran(late_s: float) -> None:
        done = loop.create_future()
        inflight.add(done, now=1.0, run_s=0.01)
        inflight.remove(done, now=1.01 + late_s)

    assert inflight.late_s == 0.0
    ran(0.05)
    ran(-0.002)  # ended early: never a negative lead
    assert inflight.late_s == pytest.approx(0.05)
    for _ in range(LATE_ENDS - 2):
        ran(0.0)
    assert inflight.late_s == pytest.approx(0.05)  # still among the last LATE_ENDS
    ran(-0.001)
    assert inflight.late_s == 0.0


def test_a_batch_is_overdue_only_far_past_its_predicted_end() -> None:
    inflight = Inflight(parallelism=1)
    short, long_ = object(), object()
    inflight.add(short, now=0.0, run_s=0.01)  # predicted to end at 0.01
    assert not inflight.overdue(1.9, factor=10, least_s=2.0)  # slow, not hung
    assert inflight.overdue(2.1, factor=10, least_s=2.0)
    inflight.remove(short, now=2.1)
    inflight.add(long_, now=0.0, run_s=0.5)  # a long batch gets ten times its run: 5 s
    assert not inflight.overdue(5.4, factor=10, least_s=2.0)
    assert inflight.overdue(5.6, factor=10, least_s=2.0)


def test_a_batch_queued_behind_one_seen_late_starts_when_that_one_ended() -> None:
    def schedule(ended_at: float | None) -> Inflight:
        inflight = Inflight(parallelism=1)
        running, queued = object(), object()
        inflight.add(running, now=1.0, run_s=0.01)
        inflight.add(queued, now=1.0, run_s=0.01)  # predicted to run 1.01-1.02, behind it
        inflight.remove(running, now=1.015, ended_at=ended_at)  # the loop got to it 5 ms late
        return inflight

    told = schedule(ended_at=time.monotonic() - 0.005)  # its runner: it ended on time
    assert told.freeing_run() == pytest.approx((1.01, 1.02), abs=1e-3)
    assert told.late_s == pytest.approx(0.005, abs=1e-3)  # the loop's lateness still counts
    assert schedule(ended_at=None).freeing_run() == pytest.approx((1.015, 1.025), abs=1e-3)


async def test_a_runner_that_tells_of_a_batch_end_gets_the_next_batch_at_once(
        running: Start) -> None:
    """The executor calls ``on_end`` as the batch ends, before its answers: the next batch
    is formed in that call, not when the batch's future's callbacks get their turn."""
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, dispatch_when_idle=True, max_wait_s=60.0, max_batch_size=4,
                         max_inflight=1)
    measured: list[tuple[int, int, float]] = []
    original = batcher.times.observe

    def observe(bucket: int, size: int, seconds: float) -> None:
        measured.append((bucket, size, seconds))
        original(bucket, size, seconds)

    batcher.times.observe = observe  # type: ignore[method-assign]
    first = [item(batcher) for _ in range(4)]
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 1), 5)
    second = [item(batcher) for _ in range(4)]
    await asyncio.sleep(0.01)
    assert batcher.depth() == 4 and batcher.inflight == 1  # waiting for the one thread
    ended = sink.batches[0]
    assert ended.on_end is not None
    ended.infer_s = 0.001
    ended.on_end(ended)
    assert batcher.depth() == 0 and batcher.inflight == 1  # the second took the thread
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + second)), 5)
    await _until(lambda: batcher.inflight == 0)
    assert len(measured) == 2  # each batch measured once, the first told of twice


async def test_a_batch_formed_ahead_refuses_items_its_wait_would_make_late(running: Start) -> None:
    """Refused at dispatch as admission refuses (rule 1): their deadlines are still ahead,
    so not 504 (expired) but 429 ``deadline_unmeetable``, with a Retry-After."""
    batcher, sink, first = await _busy_with_a_full_batch(running, {0: 0.4})
    # Formed ~0.28 s in, these would end at ~0.68 s if they ran at once; behind the running
    # batch they end at ~0.8 s, past their 0.75-s deadline.
    late = [item(batcher, deadline_s=0.75) for _ in range(4)]
    await asyncio.wait_for(_until(lambda: all(i.future.done() for i in late)), 5)
    errors = [i.future.exception() for i in late]
    assert all(isinstance(e, VegaError) and e.code == "deadline_unmeetable" and e.status == 429
               and e.retry_after_ms is not None and e.retry_after_ms >= 50 for e in errors)
    assert len(sink.batches) == 1
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first)), 5)


async def test_an_item_that_can_no_longer_make_its_deadline_is_refused_while_it_waits(
        running: Start) -> None:
    """Still queued behind a batch that runs past its last call, an item is refused then,
    with its deadline still ahead (429 ``deadline_unmeetable``, a Retry-After), and leaves
    the queue: not left to expire there into a 504 at the deadline."""
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, dispatch_when_idle=True, max_inflight=1, max_batch_size=4,
                         standing_after_s=60.0)
    for size in (1, 4):
        batcher.times.observe(0, size, 0.05 * size)  # a batch of one: 0.05 s
    first = [item(batcher) for _ in range(4)]
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 1), 5)
    late = [item(batcher, deadline_s=0.3) for _ in range(2)]
    kept = item(batcher, deadline_s=10.0)
    await asyncio.wait_for(_until(lambda: all(i.future.done() for i in late)), 5)
    now = asyncio.get_running_loop().time()
    assert all(now < i.deadline for i in late)
    errors = [i.future.exception() for i in late]
    assert all(isinstance(e, VegaError) and e.code == "deadline_unmeetable" and e.status == 429
               and e.retry_after_ms is not None for e in errors)
    assert batcher.depth() == 1 and not kept.future.done()
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + [kept])), 5)
    assert [b.size for b in sink.batches] == [4, 1]


async def test_held_full_batches_fall_due_together_and_the_oldest_goes(running: Start) -> None:
    # How far ahead comes from the batch that frees the thread, not from each candidate:
    # otherwise a long bucket's batch (long predicted time, long lead) always fell due first.
    batcher, sink, first = await _busy_with_a_full_batch(running, {0: 0.3, 2: 0.9})
    short = [item(batcher, length=10) for _ in range(4)]  # queued first: the oldest
    long = [item(batcher, length=500) for _ in range(4)]
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 2), 5)
    assert sink.batches[1].bucket == 0
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + short + long)), 5)
    assert [b.bucket for b in sink.batches] == [0, 0, 2]


async def test_a_held_full_batch_goes_at_once_when_the_thread_frees_early(running: Start) -> None:
    # Predicted far longer than it will take.
    batcher, sink, first = await _busy_with_a_full_batch(running, {0: 5.0})
    second = [item(batcher) for _ in range(4)]
    await asyncio.sleep(0.05)
    assert len(sink.batches) == 1
    sink.gate.set()  # the running batch ends ~5 s early: the held one goes now
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + second)), 5)
    assert [b.size for b in sink.batches] == [4, 4]


async def test_with_peers_to_hand_off_to_a_partial_batch_goes_at_the_wait(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, dispatch_when_idle=True, hands_off=True, max_wait_s=0.01,
                         standing_after_s=60.0)
    first = item(batcher)
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 1), 5)
    later = [item(batcher) for _ in range(2)]
    # The thread is busy, but the sink may run this batch on an idle peer.
    await asyncio.wait_for(_until(lambda: len(sink.batches) == 2), 5)
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in [first, *later])), 5)
    assert [b.size for b in sink.batches] == [1, 2]


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_buckets_are_batched_apart_and_pad_to_their_longest(running: Start) -> None:
    batcher, sink = running()
    short = [item(batcher, length=n) for n in (3, 10)]
    long = [item(batcher, length=n) for n in (100, 300)]
    await asyncio.wait_for(asyncio.gather(*(i.future for i in short + long)), 5)
    by_bucket = {b.bucket: b for b in sink.batches}
    assert sorted(by_bucket) == [0, 2]
    assert by_bucket[0].pad_to == 10 and by_bucket[2].pad_to == 300
    assert by_bucket[0].padding_ratio == pytest.approx(1 - 13 / 20)


async def test_critical_items_are_taken_first(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, max_inflight=1, max_batch_size=2)
    blocker = [item(batcher), item(batcher)]  # occupies the only pipeline slot
    await asyncio.sleep(0.05)
    low = [item(batcher, priority=SHEDDABLE) for _ in range(2)]
    high = [item(batcher, priority=CRITICAL) for _ in range(2)]
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in blocker + low + high)), 5)
    assert [i.id for i in sink.batches[1].items] == [i.id for i in high]
    assert [i.id for i in sink.batches[2].items] == [i.id for i in low]


class TimedSink(RecordingSink):
    """A model whose every batch takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def __call__(self, batch: Batch) -> None:
        await asyncio.sleep(self.seconds)
        await super().__call__(batch)


async def test_a_bucket_that_waited_an_interval_goes_before_fresh_critical_ones(
        running: Start) -> None:
    # Critical items arriving as fast as batches take them, all in another bucket: ranked
    # by class alone, the normal item waited behind them to its deadline (504).
    batcher, _ = running(TimedSink(0.02), max_inflight=1, max_batch_size=2)
    low = item(batcher, length=10, deadline_s=1.0)
    loop = asyncio.get_running_loop()
    started, answered_at = loop.time(), None
    for _ in range(60):
        item(batcher, length=300, priority=CRITICAL)
        await asyncio.sleep(0.01)
        if low.future.done() and answered_at is None:
            answered_at = loop.time()
    assert answered_at is not None and answered_at - started < 0.3
    error = low.future.exception()
    assert error is None or (isinstance(error, VegaError) and error.code == "shed")


async def test_an_item_that_cannot_make_its_deadline_is_refused_and_never_run(
        running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, max_inflight=1, max_batch_size=1)
    first = item(batcher)
    await asyncio.sleep(0.02)
    doomed = item(batcher, deadline_s=0.03)
    await asyncio.sleep(0.06)
    sink.gate.set()
    await asyncio.wait_for(first.future, 5)
    with pytest.raises(VegaError) as caught:
        await asyncio.wait_for(doomed.future, 5)
    # At its last call, with its deadline still ahead: refused, not expired.
    assert caught.value.code == "deadline_unmeetable" and caught.value.status == 429
    ran = [i.id for b in sink.batches for i in b.items]
    assert doomed.id not in ran


async def test_cancelled_item_is_dropped_before_dispatch(running: Start) -> None:
    batcher, sink = running(max_wait_s=0.02)
    gone, kept = item(batcher), item(batcher)
    gone.future.cancel()  # the caller disconnected
    await asyncio.wait_for(kept.future, 5)
    ran = [i.id for b in sink.batches for i in b.items]
    assert ran == [kept.id]
    assert batcher.depth() == 0


async def test_item_whose_caller_hung_up_is_cancelled_at_dispatch(running: Start) -> None:
    batcher, sink = running(max_wait_s=0.02)
    hung_up = False
    gone, kept = item(batcher), item(batcher)
    gone.gone = lambda: hung_up
    hung_up = True  # after enqueue: the batcher finds out when it looks, not before
    await asyncio.wait_for(kept.future, 5)
    assert [i.id for b in sink.batches for i in b.items] == [kept.id]
    assert gone.future.cancelled()
    await asyncio.sleep(0)  # the done callback that fixes the counts
    assert batcher.depth() == 0


async def test_failed_batch_fails_only_its_items_and_the_loop_goes_on(running: Start) -> None:
    sink = RecordingSink(fail_on=lambda b: any(i.length == 13 for i in b.items))
    batcher, _ = running(sink, max_wait_s=0.005)
    bad = item(batcher, length=13)
    with pytest.raises(VegaError) as caught:
        await asyncio.wait_for(bad.future, 5)
    assert caught.value.code == "model_error"
    good = item(batcher, length=13 + 1)
    assert await asyncio.wait_for(good.future, 5) == good.id


async def test_pipelining_is_bounded_by_max_inflight(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, max_inflight=2, max_batch_size=1, max_wait_s=0.0)
    items = [item(batcher) for _ in range(6)]
    await asyncio.sleep(0.05)
    assert sink.running == 2 and batcher.inflight == 2
    assert batcher.depth() == 4  # the rest waits in the queue, not in the executor
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 5)
    assert sink.max_running == 2


async def test_a_held_batch_takes_a_thread_until_it_ends(running: Start) -> None:
    """A batch of ours taken back from peers runs beside the batcher's dispatch: while it
    runs the batcher counts it (no spare thread, not idle, one fewer to dispatch); its end
    frees the thread for what queued meanwhile."""
    batcher, sink = running(max_inflight=1, max_batch_size=1, max_wait_s=0.0,
                            dispatch_when_idle=True)
    loop = asyncio.get_running_loop()
    taken_back: asyncio.Future[None] = loop.create_future()
    batcher.hold(Batch(model="m", bucket=0, items=[], pad_to=10), taken_back)
    assert (batcher.inflight, batcher.spare_threads) == (1, 0)
    queued = item(batcher)
    await asyncio.sleep(0.05)
    assert sink.batches == [] and batcher.depth() == 1
    idle = asyncio.ensure_future(batcher.wait_idle())
    taken_back.set_result(None)
    await asyncio.wait_for(queued.future, 5)
    await asyncio.wait_for(idle, 5)
    assert [b.size for b in sink.batches] == [1] and batcher.spare_threads == 1


async def test_once_stopped_a_finishing_batch_starts_no_other() -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher = Batcher(config(max_batch_size=1, max_inflight=1, max_wait_s=0.0), sink)
    task = asyncio.create_task(batcher.run())
    first, second = item(batcher), item(batcher)
    while not sink.batches:
        await asyncio.sleep(0.001)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    sink.gate.set()
    assert await asyncio.wait_for(first.future, 5) == first.id
    await asyncio.sleep(0.05)
    assert len(sink.batches) == 1 and not second.future.done()


async def test_measures_batch_times_and_service_rate(running: Start) -> None:
    batcher, sink = running()
    items = [item(batcher) for _ in range(8)]
    await asyncio.wait_for(asyncio.gather(*(i.future for i in items)), 5)
    await asyncio.sleep(0)  # the done-callback that records the batch
    assert batcher.times.predict(0, 4) > 0
    assert batcher.rate.items_per_s == pytest.approx(4 / 0.001)


async def test_standing_queue_serves_newest_first_and_sheds_old_non_critical(
        running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, max_inflight=1, max_batch_size=1, max_wait_s=0.0,
                         standing_after_s=0.05)
    first = item(batcher)
    await asyncio.sleep(0.01)
    old = item(batcher)
    old_critical = item(batcher, priority=CRITICAL)
    await asyncio.sleep(0.08)  # the queue has not emptied for longer than the interval
    new = item(batcher)
    assert batcher.standing(asyncio.get_running_loop().time())
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(first.future, new.future, old_critical.future), 5)
    with pytest.raises(VegaError) as caught:
        await old.future
    assert caught.value.code == "shed" and caught.value.retry_after_ms is not None
    order = [i.id for b in sink.batches for i in b.items]
    assert order == [first.id, old_critical.id, new.id]


class SlowSink(RecordingSink):
    """Runs each batch ``run_s`` on the clock, and says it took that long."""

    def __init__(self, run_s: float) -> None:
        super().__init__()
        self.run_s = run_s

    async def __call__(self, batch: Batch) -> None:
        self.batches.append(batch)
        await asyncio.sleep(self.run_s)
        batch.infer_s = self.run_s
        for queued in batch.items:
            queued.future.set_result(queued.id)


@pytest.mark.parametrize(("warm_s", "served"), [(0.5, True), (0.001, False)])
async def test_a_model_slower_than_the_interval_serves_what_queues_behind_its_batch(
        running: Start, warm_s: float, served: bool) -> None:
    # Batches of 0.5 s, an interval of 0.1 s: the second item waits 0.45 s behind the
    # running batch with nothing overloaded. Warmed up at that batch time, the interval in
    # force is two batch times and the item is served; a model warmed up at 1 ms, whose
    # batch ran long once, still sheds what waited out the configured interval.
    batcher, sink = running(SlowSink(0.5), max_inflight=1, max_batch_size=4, max_wait_s=0.0,
                            standing_after_s=0.1)
    seed_batch_times(batcher, 1, lambda _bound, _size: warm_s)
    assert batcher.standing_after_s == pytest.approx(max(0.1, 2 * warm_s))
    loop = asyncio.get_running_loop()
    first = item(batcher)
    await asyncio.sleep(0.05)
    second = item(batcher)
    await asyncio.sleep(0.3)
    assert batcher.standing(loop.time()) is not served
    assert await asyncio.wait_for(first.future, 5) == first.id
    if served:
        assert await asyncio.wait_for(second.future, 5) == second.id
    else:
        with pytest.raises(VegaError) as caught:
            await asyncio.wait_for(second.future, 5)
        assert caught.value.code == "shed"


class SteppedSink(RecordingSink):
    """Holds each batch until the test releases it, one at a time, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.released = asyncio.Semaphore(0)

    async def __call__(self, batch: Batch) -> None:
        self.batches.append(batch)
        await self.released.acquire()
        for queued in batch.items:
            queued.future.set_result(queued.id)


async def test_a_queue_that_never_empties_but_keeps_up_is_served_oldest_first(
        running: Start) -> None:
    # A closed-loop load the server carries: the queue never empties, yet nothing waits
    # out the interval. Served newest first, its oldest item would be the one to wait it
    # out and be shed; oldest first, every item is served.
    sink = SteppedSink()
    batcher, _ = running(sink, max_inflight=1, max_batch_size=1, max_wait_s=0.0,
                         standing_after_s=0.5)
    loop = asyncio.get_running_loop()
    first, second = item(batcher), item(batcher)  # the first runs, the second waits
    await asyncio.sleep(0.3)
    third = item(batcher)
    sink.released.release()  # the second goes; the third keeps the queue from emptying
    await asyncio.sleep(0.3)
    fourth = item(batcher)
    assert batcher.standing(loop.time()) and not batcher.newest_first(loop.time())
    for _ in range(3):
        sink.released.release()
    answers = await asyncio.wait_for(asyncio.gather(
        *(i.future for i in (first, second, third, fourth))), 5)
    assert answers == [first.id, second.id, third.id, fourth.id]
    assert [b.items[0].id for b in sink.batches] == answers


@pytest.mark.parametrize(("lengths", "behind"), [((40, 400), False), ((10, 10), True)])
async def test_an_item_past_the_interval_is_shed_only_where_batches_leave_their_bucket(
        running: Start, lengths: tuple[int, int], behind: bool) -> None:
    # The queue as a whole never empties, and the last item waits past the interval.
    # Mixed lengths at a load the server carries: each batch takes every item of its
    # bucket, and that item only waited its bucket's turn: late, not stale, so served.
    # One length: each batch leaves items of its own bucket queued; the batches are not
    # keeping up, and what waited out the interval is shed.
    sink = SteppedSink()
    batcher, _ = running(sink, max_inflight=1, max_batch_size=1, max_wait_s=0.0,
                         standing_after_s=0.1)
    loop = asyncio.get_running_loop()
    first = item(batcher)  # runs at once
    await asyncio.sleep(0.01)
    second, last = (item(batcher, length=length) for length in lengths)
    await asyncio.sleep(0.05)
    sink.released.release()  # the second runs
    await asyncio.sleep(0.06)
    fresh = item(batcher)
    now = loop.time()
    assert batcher.standing(now) and batcher.behind(now) is behind
    assert now - last.enqueued_at > 0.1
    for _ in range(3):
        sink.released.release()
    served = [first, second, fresh] if behind else [first, second, last, fresh]
    answers = await asyncio.wait_for(asyncio.gather(*(i.future for i in served)), 5)
    assert answers == [i.id for i in served]
    if behind:
        with pytest.raises(VegaError) as caught:
            await last.future
        assert caught.value.code == "shed"


async def test_wait_idle_returns_only_when_everything_is_answered(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink)
    items = [item(batcher) for _ in range(5)]
    idle = asyncio.create_task(batcher.wait_idle())
    await asyncio.sleep(0.05)
    assert not idle.done()
    sink.gate.set()
    await asyncio.wait_for(idle, 5)
    assert all(i.future.done() for i in items)


async def test_standing_queue_sweeps_stale_items_from_the_old_end(running: Start) -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher, _ = running(sink, max_inflight=1, max_batch_size=2, max_wait_s=0.0,
                         standing_after_s=0.05)
    first = [item(batcher), item(batcher)]
    await asyncio.sleep(0.01)
    stale = [item(batcher) for _ in range(4)]
    await asyncio.sleep(0.08)
    fresh = [item(batcher), item(batcher)]
    sink.gate.set()
    await asyncio.wait_for(asyncio.gather(*(i.future for i in first + fresh)), 5)
    for old in stale:
        with pytest.raises(VegaError):
            await old.future
    assert batcher.depth() == 0
    ran = {i.id for b in sink.batches for i in b.items}
    assert ran == {i.id for i in first + fresh}


def costed(batcher: Batcher, lines: dict[int, tuple[float, float]]) -> None:
    """Seed the predictor: bucket b's batch costs ``fixed + per_item * size`` seconds."""
    for bucket, (fixed, per_item) in lines.items():
        for size in (1, 4):
            batcher.times.observe(bucket, size, fixed + per_item * size)


def held(lines: dict[int, tuple[float, float]]) -> tuple[Batcher, RecordingSink]:
    """A work-conserving batcher with costs ``lines``, not yet running; its sink holds."""
    sink = RecordingSink()
    sink.gate.clear()
    batcher = Batcher(config(max_batch_size=4, dispatch_when_idle=True), sink)
    costed(batcher, lines)
    return batcher, sink


async def formed_once(batcher: Batcher, sink: RecordingSink) -> Batch:
    """Let the loop look at what is queued and form one batch."""
    task = asyncio.create_task(batcher.run())
    try:
        while not sink.batches:
            await asyncio.sleep(0.001)
        return sink.batches[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_neighbouring_buckets_share_a_batch_when_padding_costs_less_than_a_pass() -> None:
    # A large fixed cost per forward pass, little per item: one batch of both is cheaper.
    batcher, sink = held({0: (0.010, 0.0001), 1: (0.010, 0.0002), 2: (0.010, 0.001)})
    for length in (10, 12, 40):
        item(batcher, length=length)
    batch = await formed_once(batcher, sink)
    assert sorted(i.length for i in batch.items) == [10, 12, 40]
    assert batch.bucket == 1 and batch.pad_to == 40


async def test_buckets_stay_apart_when_padding_costs_more_than_a_pass() -> None:
    # Per-item cost grows steeply with length: padding short items to 512 steps costs more
    # than running them on their own.
    batcher, sink = held({0: (0.001, 0.0001), 1: (0.001, 0.0004), 2: (0.001, 0.02)})
    for length in (10, 12, 300):
        item(batcher, length=length)
    batch = await formed_once(batcher, sink)
    assert sorted(i.length for i in batch.items) == [10, 12]
    assert batch.bucket == 0 and batch.pad_to == 12
    # The long one waits for a batch of its own (formed ahead of the first one's end, or not yet).
    later = [sorted(i.length for i in b.items) for b in sink.batches[1:]]
    assert (later, batcher.bucket_depth(2)) in (([], 1), ([[300]], 0))


async def test_a_deep_queue_keeps_distant_lengths_apart_a_short_one_merges_them() -> None:
    # Padding two 40-step items to 300 steps costs less than a pass of their own, but
    # more than their share of a full batch: behind a deep queue they get that batch,
    # so they are not padded; with little queued, the pass would be theirs alone.
    lines = {0: (0.002, 0.0001), 1: (0.002, 0.0002), 2: (0.002, 0.001)}
    for long_items, expected in ((10, [40, 40]), (2, [40, 40, 300, 300])):
        sink = RecordingSink()
        sink.gate.clear()
        batcher = Batcher(config(max_batch_size=8, dispatch_when_idle=True), sink)
        costed(batcher, lines)
        for length in [40] * 2 + [300] * long_items:
            item(batcher, length=length)
        batch = await formed_once(batcher, sink)
        assert sorted(i.length for i in batch.items) == expected
        assert batch.pad_to == expected[-1]


async def test_job_items_wait_for_inline_ones_and_never_share_their_batch() -> None:
    sink = RecordingSink()
    sink.gate.clear()
    batcher = Batcher(config(max_batch_size=4, dispatch_when_idle=True), sink)
    jobs = [item(batcher, priority=JOB) for _ in range(2)]
    inline = [item(batcher) for _ in range(2)]
    first = await formed_once(batcher, sink)
    assert [i.id for i in first.items] == [i.id for i in inline]
    assert batcher.depth() == 0 and all(not j.future.done() for j in jobs)


async def test_a_job_batch_is_cut_to_the_job_batch_time() -> None:
    # Items cost 10 ms each: within 25 ms, two of them (1 + 2 x 10 ms), not the four
    # an inline batch may take, so an inline request arriving meanwhile waits less.
    sink = RecordingSink()
    sink.gate.clear()
    batcher = Batcher(config(max_batch_size=4, dispatch_when_idle=True, job_batch_s=0.025),
                      sink)
    costed(batcher, {0: (0.001, 0.01), 1: (0.001, 0.01), 2: (0.001, 0.01)})
    for _ in range(4):
        item(batcher, priority=JOB)
    batch = await formed_once(batcher, sink)
    assert batch.size == 2


async def test_items_taken_before_forming_a_batch_fails_are_answered_at_once(
        running: Start) -> None:
    def no_shape(longest: int) -> int:  # an adapter's padded-length hook that raises
        raise ValueError(f"no compiled shape for {longest} steps")

    batcher, sink = running(pad=no_shape)
    taken = item(batcher, deadline_s=30.0)
    with pytest.raises(VegaError) as refused:
        await asyncio.wait_for(taken.future, 5)  # not left to its deadline
    assert refused.value.code == "model_error"
    assert batcher.depth() == 0 and sink.batches == []


async def test_a_drain_sees_idle_once_the_last_item_is_refused_at_its_last_call(
        running: Start) -> None:
    batcher, sink = running(dispatch_when_idle=False, max_wait_s=1.0, standing_after_s=10.0)
    doomed = item(batcher, deadline_s=0.2)  # its last call comes before its wait ends
    idle = asyncio.ensure_future(batcher.wait_idle())
    with pytest.raises(VegaError):
        await asyncio.wait_for(doomed.future, 5)
    assert sink.batches == []
    await asyncio.wait_for(idle, 5)  # not the drain's whole timeout


def _raise(*_args: object) -> bool:
    raise RuntimeError("a bug in the batcher")


@pytest.mark.parametrize("where", ["hang-up check", "dispatch refusal"])
async def test_an_item_taken_as_its_batch_formation_raised_is_answered_and_uncounted(
        running: Start, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    # Popped from its deque before the check raised, it was in no queue and no batch: its
    # caller waited forever and a drain waited out its whole timeout on its count.
    batcher, sink = running(max_wait_s=0.001)
    first = item(batcher)
    if where == "hang-up check":  # raises once taken: looked at in its queue, it answered
        queue = batcher._queues[first.bucket][first.priority]
        first.gone = lambda: first not in queue and _raise()
    else:
        monkeypatch.setattr(Batcher, "_refuse_at_dispatch", _raise)
    with pytest.raises(VegaError) as failed:
        await asyncio.wait_for(first.future, 5)
    assert failed.value.code == "model_error"
    await asyncio.wait_for(batcher.wait_idle(), 5)
    assert batcher.depth() == 0 and not sink.batches
    monkeypatch.undo()
    after = item(batcher)  # the loop went on
    assert await asyncio.wait_for(after.future, 5) == after.id
