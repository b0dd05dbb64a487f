"""The overflow wire format, and one process's streams against a real Redis."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
from redis import exceptions as rexc

from tests.infra import RedisServer
from tests.models import FAIL_MARK, echo, window
from vega.channel.keys import (
    GROUP,
    NODES,
    dlq_key,
    done_key,
    jobs_key,
    node_key,
    overflow_key,
    reply_key,
)
from vega.channel.link import stop_tasks
from vega.channel.wire import (
    Overflow,
    Reply,
    WireError,
    batch_of,
    decode_overflow,
    decode_reply,
    encode_overflow,
    encode_reply,
)
from vega.config import load_settings
from vega.errors import VegaError
from vega.records import CRITICAL, Batch, Item
from vega.runtime import Runtime
from vega.streams import Streams

CODES = frozenset({"model_error", "declined", "dead_letter"})


def overflow(**changes: Any) -> Overflow:
    samples = (np.arange(16, dtype=np.float32).reshape(2, 8), np.ones((3, 8), np.float32))
    fields: dict[str, Any] = {"origin": "host-1", "batch": "host-1.ab.7", "model": "echo",
                              "identity": "1", "deadline_ms": 1_800_000_000_000,
                              "sent_ms": 1_799_999_999_000, "attempt": 1, "pad_to": 3,
                              "lengths": (2, 3), "samples": samples}
    fields.update(changes)
    return Overflow(**fields)


def test_overflow_entries_round_trip_bit_for_bit() -> None:
    entry = overflow()
    fields = encode_overflow(entry)
    assert set(fields) == {b"v", b"meta", b"data"} and len(fields[b"data"]) == 5 * 8 * 4
    back = decode_overflow(fields)
    assert back.batch == entry.batch and back.lengths == (2, 3) and back.attempt == 1
    for sent, got in zip(entry.samples, back.samples):
        assert got.dtype == np.float32 and np.array_equal(sent, got)


def test_replies_round_trip_arrays_json_and_errors() -> None:
    outputs = (np.array([1.5, 2.0], np.float32), np.array([3.0, 4.25], np.float32))
    back = decode_reply(encode_reply(Reply("b", "n", 1.25, outputs)), 2, CODES)
    assert back.infer_ms == 1.25
    assert all(np.array_equal(a, b) for a, b in zip(outputs, back.outputs))
    back = decode_reply(encode_reply(Reply("b", "n", 0, ({"label": 1}, [2]))), 2, CODES)
    assert back.outputs == ({"label": 1}, [2])
    per_step = (np.ones((2, 3), np.float32), np.zeros((5, 3), np.float32))  # rows per step
    back = decode_reply(encode_reply(Reply("b", "n", 0, per_step)), 2, CODES)
    assert [a.shape for a in back.outputs] == [(2, 3), (5, 3)]
    numbers = (np.float32(8.0), np.float32(20.0))  # one number per window
    assert decode_reply(encode_reply(Reply("b", "n", 0, numbers)), 2, CODES).outputs == (8, 20)
    back = decode_reply(encode_reply(Reply("b", "n", 0, (), "model_error", "boom")), 2, CODES)
    assert (back.error_code, back.error_message) == ("model_error", "boom")
    assert batch_of(encode_reply(Reply("b7", "n", 0, (), "declined", ""))) == "b7"


@pytest.mark.parametrize("change", [
    lambda f: f.pop(b"data"),
    lambda f: f.update({b"v": b"1"}),  # the wire before identities: another release
    lambda f: f.update({b"meta": b"\x80\x04\x95 a pickle"}),
    lambda f: f.update({b"data": f[b"data"][:-4]}),
    lambda f: f.update({b"data": f[b"data"] + b"\0" * 4}),
    lambda f: f.update({b"extra": b"1"}),
])
def test_damaged_entries_are_refused(change: Callable[[dict[bytes, bytes]], Any]) -> None:
    fields = encode_overflow(overflow())
    change(fields)
    with pytest.raises(WireError):
        decode_overflow(fields)


@pytest.mark.parametrize("meta_change", [
    {"attempt": 0}, {"attempt": True}, {"deadline_ms": "soon"}, {"origin": "a b"},
    {"model": "{x}"}, {"identity": ""}, {"identity": 1}, {"lengths": []}, {"lengths": [2, 0]},
    {"pad_to": 9},
    {"arrays": [{"dtype": "object", "shape": [2, 8]}, {"dtype": "float32", "shape": [3, 8]}]},
    {"arrays": [{"dtype": "float32", "shape": [2, 8, 1, 1, 1]},
                {"dtype": "float32", "shape": [3, 8]}]},
    {"unknown": 1},
])
def test_entries_off_the_schema_are_refused(meta_change: dict[str, Any]) -> None:
    fields = encode_overflow(overflow())
    meta = orjson.loads(fields[b"meta"])
    meta.update(meta_change)
    fields[b"meta"] = orjson.dumps(meta)
    with pytest.raises(WireError):
        decode_overflow(fields)


@pytest.mark.parametrize("meta_change", [
    {"arrays": [{"dtype": "x" * 1_000_000, "shape": [2, 8]},
                {"dtype": "float32", "shape": [3, 8]}]},
    {"arrays": [{"dtype": "float32", "shape": [1] * 1_000_000},
                {"dtype": "float32", "shape": [3, 8]}]},
])
def test_a_huge_field_of_a_refused_entry_is_not_copied_into_its_message(
        meta_change: dict[str, Any]) -> None:
    fields = encode_overflow(overflow())
    meta = orjson.loads(fields[b"meta"])
    meta.update(meta_change)
    fields[b"meta"] = orjson.dumps(meta)
    with pytest.raises(WireError) as refused:  # it goes to a log line and the dead letters
        decode_overflow(fields)
    assert len(str(refused.value)) < 500
    fields = {**encode_overflow(overflow()), b"v": b"9" * 1_000_000}
    with pytest.raises(WireError) as refused:
        decode_overflow(fields)
    assert len(str(refused.value)) < 500
    reply = encode_reply(Reply("b", "n", 0, (), "model_error", "x"))
    reply[b"meta"] = reply[b"meta"].replace(b'"model_error"', b'"' + b"y" * 1_000_000 + b'"')
    with pytest.raises(WireError) as refused:
        decode_reply(reply, 2, CODES)
    assert len(str(refused.value)) < 500


def test_replies_of_the_wrong_size_or_code_are_refused() -> None:
    with pytest.raises(WireError):
        decode_reply(encode_reply(Reply("b", "n", 0, (np.ones(2, np.float32),))), 2, CODES)
    with pytest.raises(WireError):
        decode_reply(encode_reply(Reply("b", "n", 0, (), "rm -rf", "x")), 2, CODES)


def test_keys_share_the_model_hash_tag() -> None:
    assert overflow_key("echo") == "vega:{echo}:overflow"
    assert dlq_key("echo") == "vega:{echo}:dlq"
    assert reply_key("n1") == "vega:reply:n1" and node_key("n1") == "vega:node:n1"


# -- one runtime in this process against a real redis-server -----------------------


@asynccontextmanager
async def solo_runtime(redis_url: str, **env: str) -> AsyncIterator[Runtime]:
    """A warm runtime serving the echo model alone, its Redis side channel up."""
    settings = load_settings(environ={
        "VEGA_REDIS_URL": redis_url, "VEGA_NODE_ID": "solo", "VEGA_WARMUP_BATCHES": "1",
        "VEGA_LENGTH_BUCKETS": "16", "VEGA_MAX_BATCH_SIZE": "4", "VEGA_HEARTBEAT_MS": "100",
        "VEGA_TORCH_THREADS": "1", **env})
    rt = Runtime(settings, [echo("echo")])
    await rt.start()
    await rt.wait_ready()
    assert rt.streams is not None
    for _ in range(100):
        if rt.streams.up:
            break
        await asyncio.sleep(0.05)
    try:
        yield rt
    finally:
        await rt.stop()


@pytest.fixture
async def runtime(redis_server: RedisServer) -> AsyncIterator[Runtime]:
    async with solo_runtime(redis_server.url) as rt:
        yield rt


async def check_the_solo_heartbeat(runtime: Runtime, client: Any) -> None:
    """The solo runtime's beat is in Redis with a TTL of a few beats, and it sees no peer."""
    for _ in range(40):
        state = await client.hgetall(node_key("solo"))
        if state:
            break
        await asyncio.sleep(0.05)
    assert state[b"node"] == b"solo" and orjson.loads(state[b"models"]) == ["echo"]
    assert 0 < await client.pttl(node_key("solo")) <= 800
    assert runtime.status()["redis_up"] is True and runtime.status()["peers"] == []


async def test_heartbeat_is_written_with_a_ttl(runtime: Runtime,
                                               redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await check_the_solo_heartbeat(runtime, client)
    finally:
        await client.aclose()


async def test_a_loop_late_at_the_end_of_a_blocked_read_is_not_an_outage(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A loop busy for 200 ms now and then (a burst of requests on a loaded host) may reach
    a blocked read's empty answer only after its socket timeout has passed as well; the
    reads of an idle process (its thief's, its replies', its job lane's) must not take that
    for Redis gone, which would take back every batch it had handed off. Heartbeats are
    slowed so that no short command is in flight across a stall."""
    async with solo_runtime(redis_server.url, VEGA_HEARTBEAT_MS="2000") as rt:
        assert rt.streams is not None and rt.streams.up
        caplog.clear()
        seen_down = 0
        for _ in range(12):
            time.sleep(0.2)  # the loop stalls (blocked reads end every 500 ms)
            seen_down += not rt.streams.up
            await asyncio.sleep(0.15)
            seen_down += not rt.streams.up
        complaints = [record.getMessage() for record in caplog.records
                      if record.levelno >= logging.WARNING
                      and record.name in ("vega.streams", "vega.jobs")]
        assert seen_down == 0 and complaints == [], complaints


async def ghost_peer_only(runtime: Runtime) -> Streams:
    """The runtime's streams with no thief of its own and a peer that never steals.

    The thief is stopped and awaited, not only cancelled: a cancellation can be lost in
    redis-py's blocking read, and a read still blocked in Redis would take the next entry
    (then nobody answers it). The round trip after, to the server holding the stream (one
    of several in a Redis Cluster), lets it see that connection close."""
    streams = runtime.streams
    assert streams is not None
    thieves = [task for task in streams._tasks if task.get_name().startswith("streams-steal")]
    assert thieves and not await stop_tasks(thieves, timeout_s=5.0)
    await streams.cmd.xlen(overflow_key("echo"))
    streams.peers = [{"node": "ghost", "models": ["echo"], "stealing": True, "spare": {"echo": 1},
        "identity": {"echo": "1"}}]
    return streams


def one_window_batch(runtime: Runtime, deadline_s: float) -> tuple[Batch, Item]:
    loop = asyncio.get_running_loop()
    sample, length = runtime.models["echo"].adapter.decode(window(2, 1.0))
    item = Item(sample=sample, length=length, priority=CRITICAL,
                deadline=loop.time() + deadline_s, future=loop.create_future())
    return Batch(model="echo", bucket=0, items=[item], pad_to=2), item


async def check_an_unclaimed_hand_off_is_taken_back(runtime: Runtime) -> None:
    """A batch offered to a peer that never steals is taken back and answered here.

    The origin looks once it would have started the batch itself (``local_wait_s``), finds
    the entry unread and deletes it: taken back with most of the deadline left, so a late
    timer in a busy test process cannot turn the answer into a 504."""
    streams = await ghost_peer_only(runtime)
    batch, item = one_window_batch(runtime, 0.3)
    assert await streams.offer(batch, local_wait_s=0.02)
    output = await asyncio.wait_for(item.future, 1.0)
    assert output[0] == pytest.approx(16.0)
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 1


@pytest.mark.exclusive  # the take-back must run within the item's 300-ms deadline
async def test_a_hand_off_nobody_takes_is_taken_back_and_run_locally(runtime: Runtime) -> None:
    await check_an_unclaimed_hand_off_is_taken_back(runtime)


async def test_a_batch_taken_back_is_timed_where_it_ran(runtime: Runtime) -> None:
    """The batcher saw the hand-off end before the batch ran: the run here after it is taken
    back is the one vega_inference_seconds times (as a thief times a stolen one)."""
    timed = runtime.metrics.inference.labels("echo")
    before = sum(timed.counts)
    streams = await ghost_peer_only(runtime)
    batch, item = one_window_batch(runtime, 5.0)
    assert await streams.offer(batch, local_wait_s=0.02)
    await asyncio.wait_for(item.future, 5.0)
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 1
    for _ in range(100):  # the batch's end is told after its items are answered
        if sum(timed.counts) > before:
            break
        await asyncio.sleep(0.01)
    assert sum(timed.counts) == before + 1 and timed.sum > 0


async def test_a_batch_taken_back_before_its_xadd_returns_is_left_to_no_thief(
        runtime: Runtime, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The origin's timer may take a batch back while its XADD is on its way (a slow Redis);
    the entry written after that is marked done and deleted, so no thief runs it again."""
    streams = await ghost_peer_only(runtime)
    real_xadd = streams.cmd.xadd

    async def slow_xadd(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.3)  # past the take-back timer: the local wait + a round trip
        return await real_xadd(*args, **kwargs)

    monkeypatch.setattr(streams.cmd, "xadd", slow_xadd)
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=0.05)
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 1
    assert (await asyncio.wait_for(item.future, 1.0))[0] == pytest.approx(16.0)  # run here
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for _ in range(40):
            if await client.xlen(overflow_key("echo")) == 0:
                break
            await asyncio.sleep(0.05)
        assert await client.xlen(overflow_key("echo")) == 0
        done = await client.keys(done_key("echo", "*"))
        assert [await client.get(key) for key in done] == [b"solo"]
    finally:
        await client.aclose()


async def test_a_batch_taken_back_during_its_xadd_holds_its_thread_till_it_has_run(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The batcher's dispatch ends when the late XADD returns; the batch taken back before
    that still runs here, so it must stay in flight (no spare thread lent) till it ends."""
    async with solo_runtime(redis_server.url, VEGA_EXECUTOR="thread") as runtime:
        streams = await ghost_peer_only(runtime)
        served = runtime.models["echo"]
        module: Any = served.adapter.module  # type: ignore[attr-defined]
        module.sleep_s = 0.8  # the run here outlasts the checks below
        monkeypatch.setattr(streams, "worth_handing_off", lambda batch, wait_s: True)
        real_xadd = streams.cmd.xadd

        async def slow_xadd(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.3)  # past the take-back timer (entry id still unknown)
            return await real_xadd(*args, **kwargs)

        monkeypatch.setattr(streams.cmd, "xadd", slow_xadd)
        answer = asyncio.ensure_future(runtime.infer("echo", [window(4)], 0, 5000))
        taken_back = streams.metrics.overflow_events.labels("taken_back")
        for _ in range(100):
            if taken_back._value.get() == 1:
                break
            await asyncio.sleep(0.01)
        assert taken_back._value.get() == 1 and served.batcher.inflight == 1
        await asyncio.sleep(0.4)  # the XADD has returned: the dispatch has ended
        seen = (answer.done(), served.batcher.inflight, served.batcher.spare_threads)
        await asyncio.wait_for(answer, 5)
        assert seen == (False, 1, 0)


async def test_a_batch_taken_back_holds_a_thread_so_the_next_hand_off_waits_for_peers(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle process's thief reads its own hand-off back and runs it here, outside the
    batcher's dispatch. While it runs the batcher counts it: no spare thread to lend, and
    the thief leaves our next hand-off in the stream for peers instead of taking that back
    too (each one behind the last on our thread while peers idle). Once the thread is
    free, the thief takes the waiting one back as well."""
    monkeypatch.setenv("TEST_SLEEP_MS", "600")  # a forward pass outlasts the checks below
    async with solo_runtime(redis_server.url) as runtime:
        streams, batcher = runtime.streams, runtime.models["echo"].batcher
        assert streams is not None
        taken_back = streams.metrics.overflow_events.labels("taken_back")
        ghost = [{"node": "ghost", "models": ["echo"], "stealing": True, "spare": {"echo": 1},
        "identity": {"echo": "1"}}]
        first, first_item = one_window_batch(runtime, 10.0)
        streams.peers = ghost  # until the next heartbeat finds no such peer
        assert await streams.offer(first, local_wait_s=2.0)
        for _ in range(100):
            if taken_back._value.get() == 1:
                break
            await asyncio.sleep(0.01)
        assert taken_back._value.get() == 1  # read back by our own idle thief
        assert (batcher.inflight, batcher.spare_threads) == (1, 0)

        second, second_item = one_window_batch(runtime, 10.0)
        streams.peers = ghost
        assert await streams.offer(second, local_wait_s=2.0)
        await asyncio.sleep(0.2)
        assert taken_back._value.get() == 1 and not first_item.future.done()
        pending = await streams.cmd.xpending(overflow_key("echo"), GROUP)
        assert (await streams.cmd.xlen(overflow_key("echo")), pending["pending"]) == (1, 0)

        assert (await asyncio.wait_for(first_item.future, 5.0))[0] == pytest.approx(16.0)
        assert (await asyncio.wait_for(second_item.future, 5.0))[0] == pytest.approx(16.0)
        assert taken_back._value.get() == 2 and batcher.inflight == 0


# -- offers at a burst's onset: beats from before it ------------------------------------


async def beats_stopped(runtime: Runtime, peers: list[dict[str, Any]]) -> Streams:
    """The runtime's streams with no thief and no heartbeat of their own, seeing ``peers``
    (their beats do not change unless the test changes them)."""
    streams = await ghost_peer_only(runtime)
    beats = [task for task in streams._tasks if task.get_name() == "streams-heartbeat"]
    assert beats and not await stop_tasks(beats, timeout_s=5.0)
    streams.peers = peers
    return streams


def ghost(name: str, beat_ms: int) -> dict[str, Any]:
    return {"node": name, "time_ms": beat_ms, "models": ["echo"], "stealing": True,
            "spare": {"echo": 1},
        "identity": {"echo": "1"}}


async def test_a_peer_serving_another_version_or_weights_lends_nothing(
        runtime: Runtime) -> None:
    # It would decline every batch of ours (test_thief): admission must not count on it.
    streams = await beats_stopped(runtime, [ghost("same", 1)])
    assert streams.lent("echo") == 1
    streams.peers = [{**ghost("other", 1), "identity": {"echo": "2:0123abcd"}},
                     {**ghost("older", 1), "identity": {}}]  # beats before identities
    assert streams.lent("echo") == 0


async def test_an_offer_no_peer_read_stops_offers_until_a_peer_beats_again(
        runtime: Runtime) -> None:
    """A burst reaches every process at once, so each one's last beat, from before it,
    says it is free. An offer that comes back unread says otherwise: no more offers on
    that beat (each would wait for nobody and come back later), only on the next one."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=0.02)
    assert (await asyncio.wait_for(item.future, 1.0))[0] == pytest.approx(16.0)  # taken back
    after, _ = one_window_batch(runtime, 3.0)
    assert streams.lent("echo") == 0 and not streams.worth_handing_off(after, 0.5)
    streams.peers = [ghost("ghost", 2)]  # its next beat
    assert streams.lent("echo") == 1 and streams.worth_handing_off(after, 0.5)


async def test_an_offer_left_unread_while_a_peer_runs_ours_keeps_offers_going(
        runtime: Runtime) -> None:
    """A peer that has just answered a batch of ours is stealing: one left unread meanwhile
    waited only for its thief to come back for it, which says nothing about the peer."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    first, first_item = one_window_batch(runtime, 3.0)
    assert await streams.offer(first, local_wait_s=2.0)
    [key] = list(streams._pending)
    output = np.array([16.0, 2.0], np.float32)
    await streams.cmd.xadd(reply_key("solo"), encode_reply(Reply(  # type: ignore[arg-type]
        key, "ghost", 1.0, (output,))))
    assert (await asyncio.wait_for(first_item.future, 1.0))[0] == pytest.approx(16.0)
    second, second_item = one_window_batch(runtime, 3.0)
    assert await streams.offer(second, local_wait_s=0.02)
    assert (await asyncio.wait_for(second_item.future, 1.0))[0] == pytest.approx(16.0)
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 1
    assert streams.lent("echo") == 1


async def test_a_decline_stops_offers_to_that_peer_alone(runtime: Runtime) -> None:
    streams = await beats_stopped(runtime, [ghost("busy", 1), ghost("idle", 1)])
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=2.0)  # checked long after the decline
    [key] = list(streams._pending)
    await streams.cmd.xadd(reply_key("solo"), encode_reply(Reply(  # type: ignore[arg-type]
        key, "busy", 0.0, (), "declined", "busy now")))
    assert (await asyncio.wait_for(item.future, 1.0))[0] == pytest.approx(16.0)  # run here
    assert streams.metrics.overflow_events.labels("declined")._value.get() == 1
    assert streams.lent("echo") == 1  # the idle one's thread
    streams.peers = [ghost("busy", 2), ghost("idle", 1)]
    assert streams.lent("echo") == 2


async def test_a_batch_a_peer_s_model_raised_on_is_run_here_where_it_is_halved(
        runtime: Runtime) -> None:
    # The peer answers a batch whole: one caller's input it raised on would fail the
    # others. Run here, the batch is halved down to that input (vega.settle).
    streams = await beats_stopped(runtime, [ghost("peer", 1)])
    loop = asyncio.get_running_loop()
    adapter = runtime.models["echo"].adapter
    rows = [window(2, 1.0), window(3, 1.0)]
    rows[1][0][0] = FAIL_MARK
    items = [Item(sample=adapter.decode(r)[0], length=len(r), priority=CRITICAL,
                  deadline=loop.time() + 3.0, future=loop.create_future()) for r in rows]
    batch = Batch(model="echo", bucket=0, items=items, pad_to=3, isolate=True)
    assert await streams.offer(batch, local_wait_s=2.0)
    [key] = list(streams._pending)
    await streams.cmd.xadd(reply_key("solo"), encode_reply(Reply(  # type: ignore[arg-type]
        key, "peer", 1.0, (), "model_error", "model raised ValueError")))
    assert (await asyncio.wait_for(items[0].future, 3.0))[0] == pytest.approx(16.0)
    with pytest.raises(VegaError, match="model raised ValueError"):
        await asyncio.wait_for(items[1].future, 3.0)
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 1


async def test_while_the_loop_runs_late_a_short_wait_is_not_handed_off(
        runtime: Runtime) -> None:
    """A hand-off needs turns of this process's loop (the XADD's reply, the answer's
    read); while each turn runs 100 ms late, a batch that would start here within 50 ms
    is run here, not offered."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, _ = one_window_batch(runtime, 3.0)
    assert streams.worth_handing_off(batch, local_wait_s=0.05)
    runtime.lag.lag_s = 0.1
    assert streams.round_trip_s() == pytest.approx(0.2)
    assert not streams.worth_handing_off(batch, local_wait_s=0.05)
    assert streams.worth_handing_off(batch, local_wait_s=0.5)


# -- a take-back close to the deadline ---------------------------------------------------


def slow_checks(streams: Streams, monkeypatch: pytest.MonkeyPatch, *delays_s: float) -> None:
    """Each unclaimed check (one EVAL) answered ``delays_s`` late, in turn: a loaded host."""
    real_eval, delays = streams.cmd.eval, list(delays_s)

    async def slow_eval(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(delays.pop(0))
        return await real_eval(*args, **kwargs)

    monkeypatch.setattr(streams.cmd, "eval", slow_eval)


@pytest.mark.exclusive  # the second take-back must run within its 450-ms deadline
async def test_the_unclaimed_check_is_asked_a_measured_check_before_the_last_call(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a peer has read a hand-off is one Redis round trip, which a loaded host
    stretches to tens of ms. Asked just before the last call, its answer came too late
    to run the batch here: every item of it a 504. A check once seen taking 200 ms is
    asked 200 ms before the last call."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    slow_checks(streams, monkeypatch, 0.2, 0.1)
    first, first_item = one_window_batch(runtime, 3.0)
    assert await streams.offer(first, local_wait_s=0.05)
    assert (await asyncio.wait_for(first_item.future, 2.0))[0] == pytest.approx(16.0)
    streams.peers = [ghost("ghost", 2)]  # believed again on its next beat
    second, second_item = one_window_batch(runtime, 0.45)
    assert await streams.offer(second, local_wait_s=0.4)  # it would start here in 400 ms
    assert (await asyncio.wait_for(second_item.future, 2.0))[0] == pytest.approx(16.0)
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 2


async def test_a_batch_taken_back_late_still_runs_the_items_that_can_make_it(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Taken back too late for its earliest deadline, a batch is dispatched again as the
    batcher dispatches: only the items it can no longer answer in time fail (504 once
    their deadline has passed)."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    slow_checks(streams, monkeypatch, 0.5)
    batch, soon = one_window_batch(runtime, 0.3)
    _, later = one_window_batch(runtime, 3.0)
    batch.items.append(later)
    assert await streams.offer(batch, local_wait_s=0.05)
    with pytest.raises(VegaError) as missed:
        await asyncio.wait_for(soon.future, 2.0)
    assert missed.value.code == "deadline_exceeded"
    assert (await asyncio.wait_for(later.future, 2.0))[0] == pytest.approx(16.0)


# -- a timeout: a stall here, or Redis away ----------------------------------------------


async def test_a_timeout_while_redis_answers_is_a_stall_here_not_an_outage(
        runtime: Runtime) -> None:
    """A stall of this process (a burst's long loop turns, a collection) fails with a
    timeout every command in flight across it, though Redis answered. A probe tells that
    from Redis away: batches out stay out, overflow stays on."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=2.0)
    streams.redis_error(rexc.TimeoutError("Timeout reading from redis"))
    stalled = streams.metrics.overflow_events.labels("stalled")
    for _ in range(100):
        if stalled._value.get():
            break
        await asyncio.sleep(0.01)
    assert stalled._value.get() == 1 and streams.up and not item.future.done()
    assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 0


async def test_an_unclaimed_check_timed_out_in_a_stall_still_takes_its_batch_back(
        runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis counts as up after the stall, so nothing takes every batch back: the one
    whose check failed is taken back by the check itself, not left waiting on nobody."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])

    async def timed_out(*args: Any, **kwargs: Any) -> Any:
        raise rexc.TimeoutError("Timeout reading from redis")

    monkeypatch.setattr(streams.cmd, "eval", timed_out)
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=0.05)
    assert (await asyncio.wait_for(item.future, 2.0))[0] == pytest.approx(16.0)
    assert streams.up


async def test_a_hand_off_whose_xadd_timed_out_runs_here_and_no_peer_runs_it(
        runtime: Runtime, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An XADD that timed out in a stall here may have reached the stream: the batch runs
    here, and it is marked done, so a peer's thief that reads it does not run it too."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    real_xadd = streams.cmd.xadd

    async def landed_but_timed_out(*args: Any, **kwargs: Any) -> Any:
        await real_xadd(*args, **kwargs)
        raise rexc.TimeoutError("Timeout reading from redis")

    monkeypatch.setattr(streams.cmd, "xadd", landed_but_timed_out)
    batch, item = one_window_batch(runtime, 3.0)
    assert not await streams.offer(batch, local_wait_s=2.0)  # the caller runs it here
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        for _ in range(100):
            done = await client.keys(done_key("echo", "*"))
            if done:
                break
            await asyncio.sleep(0.01)
        assert [await client.get(key) for key in done] == [b"solo"]
        assert await client.xlen(overflow_key("echo")) == 1  # there, but marked done
    finally:
        await client.aclose()
    assert streams.up and not item.future.done()


async def test_a_timeout_while_redis_is_hung_is_an_outage(
        runtime: Runtime, redis_server: RedisServer) -> None:
    """Redis stopped (SIGSTOP: it holds its connections and answers nothing): the probe
    times out too, and every batch out is taken back and run here."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=2.0)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        streams.redis_error(rexc.TimeoutError("Timeout reading from redis"))
        assert (await asyncio.wait_for(item.future, 2.0))[0] == pytest.approx(16.0)
        assert not streams.up
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert streams.metrics.overflow_events.labels("stalled")._value.get() == 0


async def test_a_redis_that_holds_writes_is_an_outage_not_a_stall_here(
        runtime: Runtime, redis_server: RedisServer) -> None:
    """CLIENT PAUSE WRITE (what a failover does): reads and PINGs are answered, every
    write waits. The probe is a write, so this is Redis away: batches come back."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=2.0)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.client_pause(1500, all=False)  # writes only
        streams.redis_error(rexc.TimeoutError("Timeout reading from redis"))
        assert (await asyncio.wait_for(item.future, 1.0))[0] == pytest.approx(16.0)
        assert not streams.up and streams.peers == []
    finally:
        await client.client_unpause()
        await client.aclose()
    assert streams.metrics.overflow_events.labels("stalled")._value.get() == 0


async def test_a_redis_that_refuses_writes_is_an_outage_and_its_peers_are_forgotten(
        runtime: Runtime, redis_server: RedisServer) -> None:
    """Out of memory under noeviction: each write is refused (OOM). Read as a refusal of
    one command, Redis stayed up and a dead peer stayed listed, its last beat frozen."""
    streams = runtime.streams
    assert streams is not None and streams.up
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.config_set("maxmemory", "1")
        streams.peers = [ghost("gone", 1)]
        for _ in range(100):  # the next beat (every 100 ms here) meets the refusal
            if not streams.up:
                break
            await asyncio.sleep(0.02)
        assert not streams.up and streams.peers == []
        assert streams.metrics.redis_up._value.get() == 0
        await client.config_set("maxmemory", "0")
        for _ in range(200):
            if streams.up:
                break
            await asyncio.sleep(0.05)
        assert streams.up  # back once Redis takes writes again
    finally:
        await client.config_set("maxmemory", "0")
        await client.aclose()


async def test_capacity_counts_only_peers_serving_the_model(runtime: Runtime) -> None:
    # Another deployment sharing the Redis (another model) is not capacity of this one.
    await beats_stopped(runtime, [ghost("twin", 1), {**ghost("other", 1), "models": ["x"]}])
    assert runtime.reporter.capacity_sample().processes == 2


async def test_a_padded_batch_goes_out_as_an_entry_a_thief_accepts(runtime: Runtime) -> None:
    """A compiled model's batcher pads a batch past its longest window (rounded up): that
    length went out as pad_to, which every thief refused (pad_to must be the longest
    length) and dead-lettered."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, _ = one_window_batch(runtime, 3.0)
    batch.pad_to = 16
    assert await streams.offer(batch, local_wait_s=2.0)
    [handoff] = streams._pending.values()
    look: Any = streams.cmd  # untyped: entries are bytes here
    [(_, fields)] = await look.xrange(overflow_key("echo"), handoff.entry_id, handoff.entry_id)
    assert decode_overflow(fields).pad_to == 2


async def test_a_process_named_after_a_long_host_name_hands_off_entries_a_thief_accepts(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without VEGA_NODE_ID a process is named host-pid: on a host with a 63-character name
    (a Kubernetes pod's, say) that was past the 64 characters the wire takes, so every
    peer dead-lettered its batches as "bad origin" and dropped its replies as "bad node"."""
    monkeypatch.setattr("socket.gethostname", lambda: "vega-" + "x" * 52 + "-7d9f8")
    async with solo_runtime(redis_server.url, VEGA_NODE_ID="") as rt:
        streams = await beats_stopped(rt, [ghost("ghost", 1)])
        batch, _ = one_window_batch(rt, 3.0)
        assert await streams.offer(batch, local_wait_s=2.0)
        [handoff] = streams._pending.values()
        look: Any = streams.cmd  # untyped: entries are bytes here
        [(_, fields)] = await look.xrange(overflow_key("echo"), handoff.entry_id,
                                          handoff.entry_id)
        assert decode_overflow(fields).origin == rt.node_id
        reply = encode_reply(Reply(decode_overflow(fields).batch, rt.node_id, 0, (), "declined"))
        assert decode_reply(reply, 1, CODES).node == rt.node_id  # its own replies pass too


async def test_a_reply_stream_redis_refuses_to_read_is_retried_slowly(
        runtime: Runtime, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply key of the wrong type (WRONGTYPE) is refused at once: the reply reader
    asked again with no pause, logging each refusal as fast as Redis answered."""
    streams = runtime.streams
    assert streams is not None
    refused: list[BaseException] = []
    monkeypatch.setattr(streams, "redis_error", refused.append)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        await client.set(reply_key("solo"), b"not a stream")
        await asyncio.sleep(1.0)
    finally:
        await client.delete(reply_key("solo"))
        await client.aclose()
    assert 1 <= len(refused) <= 4 and streams.up, len(refused)
    assert all("WRONGTYPE" in str(error) for error in refused)


async def test_a_peer_s_beat_with_spare_threads_that_are_no_count_lends_nothing(
        runtime: Runtime, redis_server: RedisServer) -> None:
    """Admission sums the spare threads of every live peer for each request: a beat saying
    {"echo": "2"} made that sum raise TypeError in every request, and a negative count
    could zero the share admission divides by; a huge one lifted every local bound."""
    client = aioredis.Redis.from_url(redis_server.url)
    spares = {"text": {"echo": "2"}, "minus": {"echo": -1}, "list": ["echo"], "fine": {"echo": 1},
              "boast": {"echo": 1e300}}  # believed, it lifted every queue bound here
    try:
        for name, spare in spares.items():
            await client.hset(node_key(name), mapping={
                "node": name, "time_ms": int(time.time() * 1000), "stealing": 1,
                "models": b'["echo"]', "identity": b'{"echo": "1"}', "depth": b"{}",
                "service_rate": b"{}", "inflight": 0, "spare": orjson.dumps(spare)})
            await client.zadd(NODES, {name: int(time.time() * 1000)})
        streams = runtime.streams
        assert streams is not None
        for _ in range(100):  # the next beat (every 100 ms here) reads them
            if len(streams.peers) == len(spares):
                break
            await asyncio.sleep(0.02)
        assert sorted(peer["node"] for peer in streams.peers) == sorted(spares)
        assert streams.lent("echo") == 1
        answer = await runtime.infer("echo", [window(4)], 0, 5000)
        assert answer is not None
    finally:
        await client.delete(*(node_key(name) for name in spares))
        await client.zrem(NODES, *spares)
        await client.aclose()


async def test_beats_of_another_type_or_size_are_refused_alone(
        runtime: Runtime, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """A registered node whose key is not a hash failed the whole read of the beats: no
    peer was known and an error was logged at every beat. A 2-MB beat was parsed at
    every beat and shown whole in /v1/status."""
    client = aioredis.Redis.from_url(redis_server.url)
    beat: dict[Any, Any] = {
        "time_ms": int(time.time() * 1000), "stealing": 1, "models": b'["echo"]',
        "identity": b'{"echo": "1"}', "depth": b"{}", "service_rate": b"{}", "inflight": 0,
        "spare": b'{"echo": 1}'}
    names = ("fine", "huge", "text")
    try:
        await client.hset(node_key("fine"), mapping={**beat, "node": "fine"})
        await client.hset(node_key("huge"), mapping={
            **beat, "node": "huge", "depth": orjson.dumps({"x": "y" * 2_000_000})})
        await client.set(node_key("text"), b"not a beat")
        await client.zadd(NODES, {name: int(time.time() * 1000) for name in names})
        streams = runtime.streams
        assert streams is not None
        for _ in range(100):  # the next beat (every 100 ms here) reads them
            if streams.peers:
                break
            await asyncio.sleep(0.02)
        assert [peer["node"] for peer in streams.peers] == ["fine"]
        assert streams.lent("echo") == 1
        assert "2 peer heartbeat(s) in Redis refused" in caplog.text
    finally:
        await client.delete(*(node_key(name) for name in names))
        await client.zrem(NODES, *names)
        await client.aclose()


async def test_a_process_that_stops_leaves_no_consumer_name_behind(
        redis_server: RedisServer) -> None:
    # Restarts under new names (the default VEGA_NODE_ID is host-pid) would otherwise
    # pile consumers up in the overflow and job groups, one per restart.
    client = aioredis.Redis.from_url(redis_server.url)
    streams = [overflow_key("echo"), jobs_key("echo")]

    async def names() -> list[list[bytes]]:
        return [[c["name"] for c in await client.xinfo_consumers(s, GROUP)] for s in streams]
    try:
        async with solo_runtime(redis_server.url):
            # A name joins a group with the first entry it is given: junk for the thief
            # (dead-lettered) and a job long gone for the runner (dropped).
            await client.xadd(overflow_key("echo"), {"junk": "1"})
            await client.xadd(jobs_key("echo"), {"id": "AAAAAAAAAAAAAAAAAAAAAA"})
            for _ in range(100):
                if all(await names()):
                    break
                await asyncio.sleep(0.05)
            assert await names() == [[b"solo"], [b"solo"]]
        assert await names() == [[], []]
    finally:
        await client.aclose()


# -- what a peer writes cannot stop the origin ---------------------------------------------


def raw_reply(meta: dict[str, Any], data: bytes = b"") -> dict[bytes, bytes]:
    return {b"v": b"2", b"meta": orjson.dumps(meta), b"data": data}


async def test_a_malformed_reply_is_dropped_and_the_reader_answers_the_next(
        runtime: Runtime) -> None:
    """Replies the checks once let through as a TypeError (an error code that is a list)
    or a ValueError (a shape whose int64 size wraps to 0) ended the only reply reader, and
    every later hand-off waited to its last call."""
    streams = await beats_stopped(runtime, [ghost("ghost", 1)])
    batch, item = one_window_batch(runtime, 3.0)
    assert await streams.offer(batch, local_wait_s=2.0)  # checked long after the replies
    [key] = list(streams._pending)
    head = {"batch": key, "node": "ghost", "infer_ms": 1}
    for fields in (raw_reply({**head, "error": {"code": ["declined"], "message": "x"}}),
                   raw_reply({**head, "arrays": [{"dtype": "float32", "shape": [65536] * 4}]}),
                   encode_reply(Reply(key, "ghost", 1.0, (np.array([99.0], np.float32),)))):
        await streams.cmd.xadd(reply_key("solo"), fields)  # type: ignore[arg-type]
    assert (await asyncio.wait_for(item.future, 1.0))[0] == pytest.approx(99.0)
    assert streams.metrics.overflow_events.labels("malformed")._value.get() == 2


@pytest.mark.parametrize("lasting_s, warned", [(0.0, False), (2.5, True)])
async def test_redis_timing_out_at_start_is_warned_of_only_if_it_lasts(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture, lasting_s: float,
        warned: bool) -> None:
    """A process starting on a busy host reads Redis's first answers late: a timeout in
    the first seconds is no outage to warn an operator of; one that lasts is."""
    caplog.set_level(logging.DEBUG, logger="vega")
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # answers nothing until told to go on

    def timed_out() -> bool:
        return any("redis connect failed: TimeoutError" in r.getMessage()
                   for r in caplog.records)

    async def go_on() -> None:
        while not timed_out():
            await asyncio.sleep(0.02)
        await asyncio.sleep(lasting_s)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGCONT)

    resumed = asyncio.create_task(go_on())
    try:
        async with solo_runtime(redis_server.url) as runtime:
            await asyncio.wait_for(resumed, 30)
            assert runtime.streams is not None
            for _ in range(200):
                if runtime.streams.up:
                    break
                await asyncio.sleep(0.05)
            assert runtime.streams.up
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "Timeout" in r.getMessage()]
    assert bool(warnings) == warned, warnings
