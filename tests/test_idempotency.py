"""Idempotency keys: replays, single-flight, conflicts, refusals; in one process and across two."""

from __future__ import annotations

import asyncio
import signal
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
from redis import exceptions as rexc

from tests.infra import RedisServer
from tests.inproc import in_process
from tests.models import forwarded, window
from tests.servers import VegaProcess, metric
from vega.calls import Reply
from vega.channel.client import SideRedis, Unavailable
from vega.errors import VegaError
from vega.metrics import Metrics
from vega.pressure.idempotency import Idempotency, fingerprint

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

ECHO = {"VEGA_MODEL": "python:tests.models:echo", "VEGA_LENGTH_BUCKETS": "16"}
OK = Reply(200, b'{"outputs":[1]}', {}, "ok")


async def test_a_second_claim_replays_and_a_concurrent_one_waits() -> None:
    store = Idempotency(ttl_s=60, max_keys=10, metrics=Metrics())
    deadline = asyncio.get_running_loop().time() + 5
    first = await store.claim("m", "k1", "fp", deadline)
    assert first.replay is None
    waiter = asyncio.ensure_future(store.claim("m", "k1", "fp", deadline))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # single-flight: it waits for the first attempt
    await store.finish(first, OK)
    assert (await waiter).replay == OK
    assert (await store.claim("m", "k1", "fp", deadline)).replay == OK
    assert (await store.claim("other-model", "k1", "fp", deadline)).replay is None


async def test_remembered_answers_hold_what_their_bodies_are_not_orjson_s_buffers() -> None:
    store = Idempotency(ttl_s=60, max_keys=1000, metrics=Metrics())
    deadline = asyncio.get_running_loop().time() + 5
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):
            claim = await store.claim("m", f"k{i}", "fp", deadline)
            await store.finish(claim, Reply(200, orjson.dumps({"outputs": [i, 0.5]}), {}, "ok"))
        per_key = (tracemalloc.get_traced_memory()[0] - before) / 1000
    finally:
        tracemalloc.stop()
    assert per_key < 2000, per_key  # 4 KB and more when a body kept orjson's buffer


async def test_a_different_body_conflicts_and_a_refusal_is_forgotten() -> None:
    store = Idempotency(ttl_s=60, max_keys=10, metrics=Metrics())
    deadline = asyncio.get_running_loop().time() + 5
    claim = await store.claim("m", "k", fingerprint({"inputs": [1]}), deadline)
    with pytest.raises(VegaError) as conflict:
        await store.claim("m", "k", fingerprint({"inputs": [2]}), deadline)
    assert conflict.value.code == "invalid_input"
    waiter = asyncio.ensure_future(store.claim("m", "k", fingerprint({"inputs": [1]}), deadline))
    await asyncio.sleep(0.01)
    await store.finish(claim, Reply(429, b"{}", {}, "queue_full"))
    retry = await waiter  # the refused attempt is not remembered: this one runs afresh
    assert retry.replay is None
    await store.finish(retry, OK)
    assert (await store.claim("m", "k", fingerprint({"inputs": [1]}), deadline)).replay == OK


async def test_a_waiter_gives_up_at_its_deadline_and_old_keys_expire() -> None:
    store = Idempotency(ttl_s=0.05, max_keys=2, metrics=Metrics())
    loop = asyncio.get_running_loop()
    first = await store.claim("m", "k", "fp", loop.time() + 5)
    with pytest.raises(VegaError) as late:
        await store.claim("m", "k", "fp", loop.time() + 0.05)
    assert late.value.code == "deadline_exceeded"
    await store.finish(first, OK)
    await asyncio.sleep(0.06)
    assert (await store.claim("m", "k", "fp", loop.time() + 5)).replay is None
    assert store.key_of(None) is None and store.key_of('"abc-123"') == "abc-123"
    with pytest.raises(VegaError):
        store.key_of("has space")


def post(url: str, body: bytes, key: str) -> httpx.Response:
    return httpx.post(url + "/v1/infer", content=body, headers={"Idempotency-Key": key},
                      timeout=10)


async def post_all(urls: list[str], body: bytes, key: str) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=10) as client:
        return list(await asyncio.gather(*(
            client.post(url + "/v1/infer", content=body, headers={"Idempotency-Key": key})
            for url in urls)))


async def test_repeats_run_the_model_once_and_conflicts_are_422(
        vega: Callable[..., VegaProcess], tmp_path: Path) -> None:
    log = str(tmp_path / "forwards")
    server = vega(**ECHO, TEST_FORWARD_LOG=log, TEST_SLEEP_MS="300")
    base = forwarded(log)
    body = orjson.dumps({"inputs": window(8, 0.5)})
    first = post(server.url, body, "order-1")
    again = post(server.url, b" " + body, "order-1")  # whitespace is not a different body
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
    assert forwarded(log) == base + 1

    together = await post_all([server.url] * 4, body, "order-2")
    assert {r.status_code for r in together} == {200}
    assert len({r.content for r in together}) == 1
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in together) == 3
    assert forwarded(log) == base + 2
    # Each of the four repeats counted once: one replayed at once, three waited (and then
    # replayed the answer they waited for, not counted again).
    events = {event: metric(server, "vega_idempotent_requests_total", model="echo",
                            event=event) for event in ("replayed", "waited")}
    assert events == {"replayed": 1, "waited": 3}, events

    conflict = post(server.url, orjson.dumps({"inputs": window(8, 0.6)}), "order-1")
    assert conflict.status_code == 422 and conflict.json()["error"]["code"] == "invalid_input"
    # A malformed key is refused before the body is read or parsed.
    bad_key = post(server.url, b"not json", "has space")
    assert bad_key.status_code == 422 and "Idempotency-Key" in bad_key.json()["error"]["message"]
    assert forwarded(log) == base + 2


async def test_repeats_across_two_processes_share_one_run_through_redis(
        vega: Callable[..., VegaProcess], redis_server: RedisServer, tmp_path: Path) -> None:
    logs = [str(tmp_path / "a"), str(tmp_path / "b")]
    a, b = (vega(**ECHO, VEGA_REDIS_URL=redis_server.url, TEST_SLEEP_MS="300",
                 TEST_FORWARD_LOG=log) for log in logs)
    base = sum(forwarded(log) for log in logs)
    body = orjson.dumps({"inputs": window(8, 0.5)})
    together = await post_all([a.url, b.url, a.url, b.url], body, "pay-7")
    assert {r.status_code for r in together} == {200}
    assert len({r.content for r in together}) == 1
    assert sum(forwarded(log) for log in logs) == base + 1
    later = post(b.url, body, "pay-7")
    assert later.content == together[0].content
    assert later.headers["idempotent-replayed"] == "true"
    conflict = post(a.url, orjson.dumps({"inputs": window(8, 0.9)}), "pay-7")
    assert conflict.status_code == 422
    assert sum(forwarded(log) for log in logs) == base + 1


# -- a Redis command timed out: a stall here, or Redis away -----------------------------

async def timed_out(_client: object) -> None:
    raise rexc.TimeoutError("Timeout reading from redis")


async def test_a_timeout_while_redis_answers_leaves_the_shared_tiers_on(
        redis_server: RedisServer) -> None:
    """A stall of this process (a burst's long loop turns) times out commands that Redis
    answered: one PING tells it from Redis away, so the tiers are not skipped for it."""
    side = SideRedis(redis_server.url, 0.1)
    try:
        with pytest.raises(Unavailable) as away:
            await side.run(timed_out)
        assert away.value.maybe_ran
        for _ in range(100):
            if side.timeouts.stalls:
                break
            await asyncio.sleep(0.01)
        assert side.timeouts.stalls == 1 and side.up
        assert await side.run(lambda r: r.set("after", b"1")) is True
    finally:
        await side.close()


async def test_a_timeout_while_redis_is_hung_skips_it_for_a_while(
        redis_server: RedisServer) -> None:
    side = SideRedis(redis_server.url, 0.1)
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(Unavailable):
            await side.run(lambda r: r.get("k"))
        for _ in range(100):
            if not side.up:
                break
            await asyncio.sleep(0.01)
        assert not side.up and side.timeouts.stalls == 0
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
        await side.close()
    with pytest.raises(Unavailable) as skipped:
        await side.run(lambda r: r.get("k"))
    assert not skipped.value.maybe_ran  # skipped, not sent


async def test_a_lock_whose_set_timed_out_still_gets_the_answer_for_peers(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SET NX landed but its reply came late: the attempt runs here and publishes its
    answer over the lock, so a repeat on a peer replays it rather than waiting on a lock
    that says "running" until it expires."""
    import vega.pressure.idempotency as idempotency

    real_set = idempotency._set_if_absent

    async def landed_but_timed_out(client: Any, **kwargs: Any) -> bool:
        await real_set(client, **kwargs)
        raise rexc.TimeoutError("Timeout reading from redis")

    here, peer = (Idempotency(60, 10, Metrics(), SideRedis(redis_server.url, 0.5))
                  for _ in range(2))
    deadline = asyncio.get_running_loop().time() + 1.0
    try:
        monkeypatch.setattr(idempotency, "_set_if_absent", landed_but_timed_out)
        claim = await here.claim("m", "k", "fp", deadline)
        monkeypatch.setattr(idempotency, "_set_if_absent", real_set)
        assert claim.replay is None  # it runs here
        await here.finish(claim, OK)
        assert (await peer.claim("m", "k", "fp", deadline)).replay == OK
    finally:
        for store in (here, peer):
            assert store.redis is not None
            await store.redis.close()


async def test_an_answer_redis_did_not_take_is_offered_again_once_it_answers(
        redis_server: RedisServer) -> None:
    """Redis taken for away as the attempt answered (hung, or this loop stalled past the
    probe too): the answer is published once Redis answers again, so a peer's repeat
    replays it rather than waiting on a lock that says "running" and then running the
    model a second time."""
    here, peer = (Idempotency(60, 10, Metrics(), SideRedis(redis_server.url, 0.1))
                  for _ in range(2))
    assert here.redis is not None and redis_server.proc is not None
    loop = asyncio.get_running_loop()
    look = redis.Redis.from_url(redis_server.url)
    try:
        claim = await here.claim("m", "k", "fp", loop.time() + 30)
        assert claim.replay is None and claim.token  # it runs here, holding the lock
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable):
                await here.redis.run(lambda r: r.get("k"))
            for _ in range(100):
                if not here.redis.up:
                    break
                await asyncio.sleep(0.01)
            assert not here.redis.up
            await here.finish(claim, OK)  # skipped: Redis is away
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        for _ in range(100):
            stored = look.get(claim.redis_key)
            if stored is not None and orjson.loads(stored)["state"] == "done":
                break
            await asyncio.sleep(0.05)
        assert stored is not None and orjson.loads(stored)["state"] == "done", stored
        assert (await peer.claim("m", "k", "fp", loop.time() + 1)).replay == OK
    finally:
        look.close()
        for store in (here, peer):
            await store.close()
            assert store.redis is not None
            await store.redis.close()


@pytest.mark.parametrize("record", [
    b"not json", b"[1]",
    orjson.dumps({"fp": "fp", "state": "done", "reply": "x"}),
    orjson.dumps({"fp": "fp", "state": "done", "reply": {
        **OK.encode(), "headers": {"X-Evil": "a\r\nSet-Cookie: session=theirs"}}}),
    orjson.dumps({"fp": "fp", "state": "done", "reply": {**OK.encode(), "status": 1000}}),
])
async def test_a_shared_record_vega_did_not_write_is_a_logged_500_not_a_replay(
        redis_server: RedisServer, record: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """Another program's value under a key's record: refused, never replayed (an HTTP
    server refuses such a status or header: an error escaping the request stack), nor
    the key's model run again (its first attempt may have run)."""
    store = Idempotency(60, 10, Metrics(), SideRedis(redis_server.url, 0.5))
    look = redis.Redis.from_url(redis_server.url)
    try:
        first = await store.claim("m", "k", "fp", asyncio.get_running_loop().time() + 1)
        assert first.redis_key and first.replay is None
        await store.finish(first, None)  # forgotten here; the record is then replaced
        look.set(first.redis_key, record, px=60_000)
        with pytest.raises(VegaError) as refused:
            await store.claim("m", "k", "fp", asyncio.get_running_loop().time() + 1)
        assert refused.value.code == "internal_error"
        assert "is not one Vega wrote" in caplog.text
    finally:
        look.close()
        await store.close()
        assert store.redis is not None
        await store.redis.close()


async def test_an_answer_never_replaces_a_lock_a_peer_holds(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SET NX that timed out without landing: a peer then takes the lock and runs too.
    Our answer must not replace its lock; its own answer is what Redis keeps."""
    import vega.pressure.idempotency as idempotency

    real_set = idempotency._set_if_absent

    async def lost(client: Any, **kwargs: Any) -> bool:
        raise rexc.TimeoutError("Timeout reading from redis")

    here, peer = (Idempotency(60, 10, Metrics(), SideRedis(redis_server.url, 0.5))
                  for _ in range(2))
    deadline = asyncio.get_running_loop().time() + 1.0
    theirs = Reply(200, b'{"outputs":[2]}', {}, "ok")
    try:
        monkeypatch.setattr(idempotency, "_set_if_absent", lost)
        ours = await here.claim("m", "k", "fp", deadline)
        monkeypatch.setattr(idempotency, "_set_if_absent", real_set)
        running = await peer.claim("m", "k", "fp", deadline)
        assert ours.replay is None and running.replay is None and running.token
        await here.finish(ours, OK)
        assert peer.redis is not None
        held = await peer.redis.run(lambda r: r.get(running.redis_key))
        assert held == running.token  # still the peer's lock
        await peer.finish(running, theirs)
        third = Idempotency(60, 10, Metrics(), SideRedis(redis_server.url, 0.5))
        assert (await third.claim("m", "k", "fp", deadline)).replay == theirs
        assert third.redis is not None
        await third.redis.close()
    finally:
        for store in (here, peer):
            assert store.redis is not None
            await store.redis.close()


# -- one key on /v1 and /v2 ----------------------------------------------------------

DIALECTS_ENV = {"VEGA_MODEL": "sensor", "VEGA_CACHE_BYTES": "1000000", "VEGA_LENGTH_BUCKETS": "16"}
WINDOW = [[0.1 * i + 0.01 * c for c in range(8)] for i in range(2)]
# A valid v2 body, written as orjson writes it with sorted keys (what /v1 fingerprints).
V2_BODY = orjson.dumps({"id": "a", "inputs": [{"data": WINDOW, "datatype": "FP32",
                                               "name": "INPUT__0", "shape": [1, 2, 8]}]},
                       option=orjson.OPT_SORT_KEYS)


async def test_a_key_used_on_v1_then_v2_is_a_conflict_not_a_replay() -> None:
    async with in_process(DIALECTS_ENV) as (client, _):
        first = await client.post("/v1/infer", content=V2_BODY, headers={"Idempotency-Key": "k"})
        assert first.status_code == 422  # v1 cannot read tensors: remembered (422 is kept)
        second = await client.post("/v2/models/sensor/infer", content=V2_BODY,
                                   headers={"Idempotency-Key": "k"})
        # One key on both protocols is a conflict, not /v1's error replayed to /v2.
        assert second.headers.get("idempotent-replayed") is None, second.text
        assert second.status_code == 422 and "different request body" in second.text


async def test_a_v2_answer_is_not_replayed_to_v1() -> None:
    async with in_process(DIALECTS_ENV) as (client, _):
        first = await client.post("/v2/models/sensor/infer", content=V2_BODY,
                                  headers={"Idempotency-Key": "k"})
        assert first.status_code == 200 and "model_name" in first.json()
        plain = await client.post("/v1/infer", content=V2_BODY)
        assert plain.status_code == 422  # what /v1 answers this body
        second = await client.post("/v1/infer", content=V2_BODY,
                                   headers={"Idempotency-Key": "k"})
        assert "model_name" not in second.text, second.text  # a /v2 answer on /v1
        assert second.status_code == 422 and "different request body" in second.text


async def test_a_retry_with_less_time_left_or_another_class_is_a_replay() -> None:
    # A caller's own retry loop sends what is left of its deadline in the body: the same
    # request, not a conflict. Another input under the key still is one.
    async with in_process(DIALECTS_ENV) as (client, _):
        first = await client.post("/v1/infer", content=orjson.dumps(
            {"inputs": WINDOW, "deadline_ms": 2000}), headers={"Idempotency-Key": "r"})
        again = await client.post("/v1/infer", content=orjson.dumps(
            {"inputs": WINDOW, "deadline_ms": 800, "priority": "critical"}),
            headers={"Idempotency-Key": "r"})
        assert first.status_code == again.status_code == 200
        assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
        other = await client.post("/v1/infer", content=orjson.dumps(
            {"inputs": WINDOW[:1], "deadline_ms": 800}), headers={"Idempotency-Key": "r"})
        assert other.status_code == 422 and "different request body" in other.text


async def test_a_replay_does_not_claim_a_cache_miss() -> None:
    async with in_process(DIALECTS_ENV) as (client, _):
        body = orjson.dumps({"inputs": WINDOW})
        first = await client.post("/v1/infer", content=body, headers={"Idempotency-Key": "c"})
        assert first.headers["x-vega-cache"] == "miss"
        again = await client.post("/v1/infer", content=body, headers={"Idempotency-Key": "c"})
        assert again.headers["idempotent-replayed"] == "true"
        # The replay came from the idempotency store, not from a cache lookup that missed.
        assert again.headers.get("x-vega-cache") != "miss", dict(again.headers)
