"""The thief alone: built from a Link (no Streams, no runtime) against a real Redis.

Entries are written with the wire format as an origin would; the local runner is a
stub that answers each item with its sum, so what comes back on the origin's reply
stream can be checked exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.infra import RedisServer, require
from tests.models import echo
from vega.batcher import Batcher, BatcherConfig
from vega.channel.client import connect
from vega.channel.keys import GROUP, dlq_key, done_key, overflow_key, reply_key
from vega.channel.link import Link, stop_tasks
from vega.channel.steal import Thief
from vega.channel.wire import (
    Overflow,
    Reply,
    decode_overflow,
    decode_reply,
    encode_overflow,
    wall_ms,
)
from vega.config import load_settings
from vega.errors import VegaError
from vega.metrics import Metrics
from vega.records import Batch

CODES = frozenset({"model_error", "declined", "dead_letter"})
MODEL = "echo"


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def redis_url(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One redis-server, then a three-primary Redis Cluster (the reply stream and the
    model's keys on different slots)."""
    if request.param == "cluster":
        yield request.getfixturevalue("redis_cluster").url
        return
    require("redis-server")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


class Rig:
    """A link, its thief, the batches the stub ran, and a plain client to look with."""

    def __init__(self, url: str, node: str, **env: str) -> None:
        settings = load_settings(environ={
            "VEGA_REDIS_URL": url, "VEGA_NODE_ID": node, "VEGA_LENGTH_BUCKETS": "16",
            "VEGA_MAX_BATCH_SIZE": "4", "VEGA_REDIS_TIMEOUT_MS": "2000", **env})
        adapter = echo(MODEL)
        batcher = Batcher(BatcherConfig.from_settings(settings, MODEL, adapter.max_length),
                          self._never)
        self.ran: list[Batch] = []
        self.taken_back: list[tuple[str, str]] = []
        self.reposted: list[tuple[str, Any]] = []
        self.link = Link(settings, node, Metrics(), {MODEL: (adapter, batcher)}, self._run)
        self.link.take_back = lambda key, why: self.taken_back.append((key, why))
        self.link.reposted = lambda key, entry_id: self.reposted.append((key, entry_id))
        self.thief = Thief(self.link)
        self.look: Any = connect(url, 2.0)  # untyped: replies are bytes here
        self.tasks: list[asyncio.Task[None]] = []

    async def _never(self, batch: Batch) -> None:
        raise AssertionError("the thief must run batches through run_local")

    async def _run(self, batch: Batch) -> None:
        """The stub local runner: each item's answer is its sum and length."""
        self.ran.append(batch)
        batch.infer_s = 0.002
        for item in batch.items:
            item.future.set_result(np.array([item.sample.sum(), item.length], np.float32))

    async def start(self, *loops: Callable[[], Awaitable[None]]) -> None:
        await self.look.delete(overflow_key(MODEL), dlq_key(MODEL))
        await self.link.ensure_group(MODEL)
        self.link.up_event.set()
        self.tasks = [asyncio.ensure_future(loop()) for loop in loops]

    async def stop(self) -> None:
        assert not await stop_tasks(list(self.tasks), timeout_s=10), "a loop did not stop"
        await self.link.cmd.aclose()
        await self.look.aclose()

    def count(self, name: str, label: str) -> float:
        family = self.link.metrics.overflow if name == "overflow" \
            else self.link.metrics.overflow_events
        return float(family.labels(label)._value.get())


def entry(origin: str, batch: str, deadline_in_ms: int = 5000, attempt: int = 1) -> Overflow:
    samples = (np.full((2, 8), 1.0, np.float32), np.full((3, 8), 0.5, np.float32))
    return Overflow(origin=origin, batch=batch, model=MODEL, identity="1",
                    deadline_ms=wall_ms() + deadline_in_ms, sent_ms=wall_ms(), attempt=attempt,
                    pad_to=3, lengths=(2, 3), samples=samples)


async def eventually(check: Callable[[], Any], what: str, timeout_s: float = 10) -> None:
    """Poll ``check`` (a value or a coroutine) until it is truthy."""
    for _ in range(int(timeout_s / 0.02)):
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout_s} s")


async def offered(rig: Rig, sent: Overflow) -> Reply:
    """Write ``sent`` to the model's stream as its origin would; the one reply it gets."""
    await rig.look.delete(reply_key(sent.origin))
    await rig.look.xadd(overflow_key(MODEL), encode_overflow(sent))
    await eventually(lambda: rig.look.xlen(reply_key(sent.origin)), "the reply")
    [(_, fields)] = await rig.look.xrange(reply_key(sent.origin))
    return decode_reply(fields, len(sent.lengths), CODES)


@pytest.fixture
async def rig(redis_url: str) -> AsyncIterator[Rig]:
    rig = Rig(redis_url, "thief-1", VEGA_CLAIM_IDLE_MS="200")
    await rig.start(lambda: rig.thief.steal_loop(MODEL))
    yield rig
    await rig.stop()


async def test_a_stolen_batch_is_run_answered_on_the_origin_s_stream_and_acked(rig: Rig) -> None:
    reply = await offered(rig, entry("origin-1", "origin-1.b.1"))
    assert (reply.batch, reply.node, reply.error_code) == ("origin-1.b.1", "thief-1", "")
    assert [list(o) for o in reply.outputs] == [[16.0, 2.0], [12.0, 3.0]]
    assert reply.infer_ms == pytest.approx(2.0)
    [batch] = rig.ran
    assert batch.size == 2 and batch.pad_to == 3
    # Answered, marked done and acknowledged: no reader will see it again.
    assert await rig.look.xlen(overflow_key(MODEL)) == 0
    assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0
    assert await rig.look.get(done_key(MODEL, "origin-1.b.1")) == b"thief-1"
    assert 0 < await rig.look.pttl(reply_key("origin-1"))
    assert rig.count("overflow", "in") == 1 and rig.link.counts["taken"] == 1


async def test_a_malformed_entry_goes_to_the_dead_letter_stream_and_the_reader_lives(
        rig: Rig) -> None:
    await rig.look.xadd(overflow_key(MODEL), {"junk": "1"})
    await eventually(lambda: rig.look.xlen(dlq_key(MODEL)), "the dead letter")
    [(_, kept)] = await rig.look.xrange(dlq_key(MODEL))
    assert kept[b"reason"].startswith(b"malformed") and kept[b"by"] == b"thief-1"
    assert kept[b"field:junk"] == b"1"
    assert await rig.look.xlen(overflow_key(MODEL)) == 0
    assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0
    assert rig.count("events", "dead_lettered") == 1 and rig.ran == []
    # The loop lives on: the next good entry is run.
    await rig.look.xadd(overflow_key(MODEL), encode_overflow(entry("origin-2", "origin-2.b.1")))
    await eventually(lambda: len(rig.ran) == 1, "the next entry to run")


async def test_an_entry_it_cannot_finish_in_time_is_declined_not_run(rig: Rig) -> None:
    reply = await offered(rig, entry("origin-3", "origin-3.b.1", deadline_in_ms=1))
    assert reply.error_code == "declined"
    assert rig.ran == [] and await rig.look.xlen(overflow_key(MODEL)) == 0


async def test_a_stolen_batch_refused_unrun_is_declined_for_its_origin_to_run(
        redis_url: str) -> None:
    # Its model process went down between the idle check and the run: not a model error
    # (the origin would answer 500), a refusal the origin takes back and runs itself.
    rig = Rig(redis_url, "thief-nr")

    async def down(batch: Batch) -> None:  # what the executor does with no process up
        for item in batch.items:
            item.future.set_exception(VegaError("not_ready", "the model process is restarting"))

    rig.link.run_local = down
    await rig.start(lambda: rig.thief.steal_loop(MODEL))
    try:
        reply = await offered(rig, entry("origin-nr", "origin-nr.b.1"))
    finally:
        await rig.stop()
    assert (reply.error_code, reply.error_message) == (
        "declined", "the model process is restarting")


async def test_a_stolen_batch_the_model_raised_on_leaves_no_exception_unread(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # asyncio logs each failed future nobody read: a line per item of every such batch.
    rig = Rig(redis_url, "thief-me")

    async def raising(batch: Batch) -> None:
        for item in batch.items:
            item.future.set_exception(VegaError("model_error", "model raised ValueError"))

    rig.link.run_local = raising
    await rig.start(lambda: rig.thief.steal_loop(MODEL))
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            reply = await offered(rig, entry("origin-me", "origin-me.b.1"))
            gc.collect()
    finally:
        await rig.stop()
    assert (reply.error_code, reply.error_message) == ("model_error", "model raised ValueError")
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_a_batch_of_another_version_or_weights_of_its_model_is_declined_not_run(
        rig: Rig) -> None:
    # A rolling deploy: old and new processes share the stream, and an answer from the
    # other weights would be wrong (and cached under the origin's).
    assert rig.link.identities[MODEL] == "1"
    reply = await offered(rig, dataclasses.replace(entry("origin-5", "origin-5.b.1"),
                                                   identity="2:0123abcd"))
    assert (reply.error_code, reply.error_message) == ("declined", "another version or weights")
    assert rig.ran == [] and await rig.look.xlen(overflow_key(MODEL)) == 0


async def test_a_stolen_batch_is_padded_as_its_model_pads_a_batch_of_its_own(
        rig: Rig) -> None:
    # A compiled package runs lengths rounded up (to 8 here): the entry carries the longest
    # length, and the thief rounds it as its origin's batcher did, so the answers agree.
    batcher = rig.link.models[MODEL][1]
    batcher.config = dataclasses.replace(batcher.config, pad=lambda n: -(-n // 8) * 8)
    reply = await offered(rig, entry("origin-p", "origin-p.b.1"))
    assert reply.error_code == "" and [batch.pad_to for batch in rig.ran] == [8]


async def test_a_batch_past_this_process_s_limits_is_declined_not_dead_lettered(
        rig: Rig) -> None:
    """Peers of the same model with other limits: more items than this VEGA_MAX_BATCH_SIZE
    (4 here; 128 at a tester's origin), or a window longer than this model takes. Dead-
    lettered as malformed, such a batch got no reply, and its origin waited to its last
    call (504s). Declined, its origin runs it at once."""
    many = entry("origin-m", "origin-m.b.1")
    many = dataclasses.replace(many, lengths=(2,) * 5, pad_to=2,
                               samples=(np.ones((2, 8), np.float32),) * 5)
    long_ = dataclasses.replace(entry("origin-m", "origin-m.b.2"), lengths=(600,), pad_to=600,
                                samples=(np.ones((600, 8), np.float32),))
    for sent, why in ((many, "5 items, more than VEGA_MAX_BATCH_SIZE here (4)"),
                      (long_, "a sample the model refuses here")):
        reply = await offered(rig, sent)
        assert (reply.batch, reply.error_code) == (sent.batch, "declined")
        assert reply.error_message.startswith(why)
    assert rig.ran == [] and await rig.look.xlen(dlq_key(MODEL)) == 0
    assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0


async def test_its_own_batch_read_while_idle_is_taken_back_without_a_round_trip(
        rig: Rig) -> None:
    await rig.look.xadd(overflow_key(MODEL), encode_overflow(entry("thief-1", "thief-1.b.9")))
    await eventually(lambda: rig.taken_back, "the take-back")
    assert rig.taken_back == [("thief-1.b.9", "idle again")] and rig.ran == []
    assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0


async def test_an_entry_read_as_work_of_its_own_arrived_is_declined_at_once(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy when the read returns (it blocked while idle): the thief declines a peer's
    entry, so its origin takes it back now, its deadline nearly whole, instead of waiting
    for an answer until the deadline all but ran out while the entry waited for another
    reader. Its own entry goes back for an idle peer, and its hand-off learns the new id."""
    monkeypatch.setattr(rig.thief, "_idle_now", lambda: False)
    reads_left = [1]  # the read already blocked, then one more: the copy stays unread

    async def idle() -> None:
        reads_left[0] -= 1
        if reads_left[0] < 0:
            await asyncio.Event().wait()

    monkeypatch.setattr(rig.thief, "_idle", idle)
    reply = await offered(rig, entry("origin-4", "origin-4.b.1"))
    assert (reply.batch, reply.node, reply.error_code) == ("origin-4.b.1", "thief-1", "declined")
    assert rig.ran == [] and await rig.look.xlen(overflow_key(MODEL)) == 0
    assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0
    await rig.look.xadd(overflow_key(MODEL), encode_overflow(entry("thief-1", "thief-1.b.7")))
    await eventually(lambda: rig.reposted, "the repost")
    [(key, new_id)] = rig.reposted
    [(kept_id, kept)] = await rig.look.xrange(overflow_key(MODEL))
    assert key == "thief-1.b.7" and kept_id == new_id and rig.taken_back == [] and rig.ran == []
    assert decode_overflow(kept).batch == "thief-1.b.7"


async def test_a_dead_thief_s_entry_is_put_back_with_the_next_attempt(redis_url: str) -> None:
    rig = Rig(redis_url, "reclaimer", VEGA_CLAIM_IDLE_MS="100")
    await rig.start(rig.thief.reclaim_loop)
    try:
        await rig.look.xadd(overflow_key(MODEL), encode_overflow(entry("origin-4", "o4.b.1")))
        # A thief that read it and died: pending on "ghost", never acknowledged.
        await rig.look.xreadgroup(GROUP, "ghost", {overflow_key(MODEL): ">"}, count=1)
        await eventually(lambda: rig.count("events", "reclaimed") == 1, "the reclaim")
        [(_, fields)] = await rig.look.xrange(overflow_key(MODEL))
        again = decode_overflow(fields)
        assert (again.batch, again.attempt) == ("o4.b.1", 2)
        assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0
    finally:
        await rig.stop()


async def test_a_loop_that_lost_its_cancellation_is_cancelled_again() -> None:
    async def loses_the_first() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # as a blocking redis-py read can lose it
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(loses_the_first())
    await asyncio.sleep(0)
    assert not await stop_tasks([task], timeout_s=5)
    assert task.cancelled()


async def test_no_batch_is_read_while_its_model_process_restarts(redis_url: str) -> None:
    """A batch taken while no model can run would fail, though a peer could run it: left
    unread, then run once the model is back."""
    rig = Rig(redis_url, "thief-3")
    up = [False]
    rig.link.runnable = lambda: up[0]
    await rig.start(lambda: rig.thief.steal_loop(MODEL))
    try:
        assert not rig.link.lending()  # nor are spare threads offered in its heartbeat
        sent = entry("origin-6", "origin-6.b.1")
        await rig.look.delete(reply_key(sent.origin))
        await rig.look.xadd(overflow_key(MODEL), encode_overflow(sent))
        await asyncio.sleep(0.5)
        assert rig.ran == []
        assert (await rig.look.xpending(overflow_key(MODEL), GROUP))["pending"] == 0
        up[0] = True
        await eventually(lambda: rig.ran, "the batch run once its model is back")
        assert [batch.items[0].length for batch in rig.ran] == [2]
    finally:
        await rig.stop()
