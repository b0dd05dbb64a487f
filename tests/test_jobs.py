"""The async lane in one process (in-process ASGI): memory store and Redis store."""

from __future__ import annotations

import asyncio
import gzip
import logging
import re
from collections import Counter
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import redis

from tests.infra import RedisServer
from tests.inproc import app_in_process, in_process
from tests.models import FAIL_MARK, echo, window
from vega.channel.keys import jobs_key
from vega.errors import VegaError
from vega.jobs.redis_store import RedisStore
from vega.jobs.store import Job, MemoryStore, Submitted, new_id, wall_ms
from vega.runtime import Runtime

BASE = {"VEGA_WARMUP_BATCHES": "1", "VEGA_TORCH_THREADS": "1", "VEGA_LENGTH_BUCKETS": "16",
        "VEGA_CAPACITY_SAMPLE_S": "0.05"}


@asynccontextmanager
async def served(**env: str) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime, Any]]:
    model = echo("echo")
    async with in_process({**BASE, **env}, [model]) as (client, runtime):
        yield client, runtime, model


async def until_final(client: httpx.AsyncClient, job_id: str, timeout_s: float = 20) -> Any:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while True:
        doc = (await client.get(f"/v1/jobs/{job_id}")).json()
        if doc["status"] not in ("queued", "running"):
            return doc
        assert loop.time() < end, f"job {job_id} still {doc['status']}"
        await asyncio.sleep(0.02)


async def settled(runtime: Any, timeout_s: float = 10) -> None:
    """Let the job tasks finish: a result is visible in the store a moment before it is counted."""
    for runner in runtime.jobs.runners.values():
        await runner.settle(timeout_s)


async def submit(client: httpx.AsyncClient, body: Any, **headers: str) -> httpx.Response:
    return await client.post("/v1/jobs", content=orjson.dumps(body), headers=headers)


async def test_every_job_counter_is_exported_at_0_before_its_first_event() -> None:
    # rate() and increase() see a counter's first step only from a sample before it.
    async with served() as (client, _, _):
        metrics = (await client.get("/metrics")).text
    for counter in ('vega_jobs_total{model="echo",outcome="done"}',
                    'vega_jobs_retried_total{model="echo"}',
                    'vega_jobs_reclaimed_total{model="echo"}'):
        assert f"{counter} 0.0" in metrics, counter


async def test_a_job_its_runner_s_model_refuses_is_put_back_for_another_process() -> None:
    # Submitted where the model took 2-step windows, claimed where it takes 8 and more (a
    # rolling change of vega_min_length): another process may run it, so it goes back,
    # and fails with the reason only once every attempt was refused.
    async with in_process({"VEGA_MODEL": "python:tests.models:patches",
                           "VEGA_MAX_ATTEMPTS": "3"}) as (client, runtime):
        now = wall_ms()
        job = Job(id=new_id(), model="patches", single=True, priority=0, created_ms=now,
                  expires_ms=now + 60_000, instances=orjson.dumps([window(2)]))
        await runtime.jobs.store.submit(job, None, "", 100)
        final = await until_final(client, job.id)
        assert final["status"] == "failed" and final["error"]["code"] == "invalid_input"
        assert "window length 2 outside 8..256" in final["error"]["message"]
        stored = await runtime.jobs.store.get("patches", job.id)
        assert stored is not None and stored.attempts == 3


async def test_a_refused_submit_is_counted_under_the_class_it_named() -> None:
    # Refusals kept the default class: a critical 422 or 503 counted as normal, which the
    # per-class refusal panels and the VegaCriticalRefused alert read.
    async with served() as (client, runtime, _):
        named = await submit(client, {"inputs": [[1.0, 2.0]], "priority": "critical"})
        headed = await client.post("/v1/jobs", content=b"{not json",
                                   headers={"X-Vega-Priority": "sheddable"})
        plain = await client.post("/v1/jobs", content=b"{not json")
        early = await client.post("/v1/models/nope/jobs", content=orjson.dumps(
            {"inputs": window(4), "priority": "critical"}))  # refused before the parse
        # Compressed bytes are not the text (a scan of these finds no class): the header.
        packed = next(body for step in range(10_000) if (body := gzip.compress(orjson.dumps(
            {"inputs": window(4), "id": str(step)}), mtime=0)).count(b"{") != 1)
        zipped = await client.post("/v1/models/nope/jobs", content=packed, headers={
            "Content-Encoding": "gzip", "X-Vega-Priority": "sheddable"})
        assert [r.status_code for r in (named, headed, plain, early, zipped)] == \
            [422, 400, 400, 404, 404]
        counted = {(sample.labels["priority"], sample.labels["outcome"]): sample.value
                   for metric in runtime.metrics.requests.collect()
                   for sample in metric.samples if sample.name.endswith("_total")}
        assert counted[("critical", "invalid_input")] == 1
        assert counted[("sheddable", "invalid_json")] == 1
        assert counted[("normal", "invalid_json")] == 1
        assert counted[("critical", early.json()["error"]["code"])] == 1
        assert counted[("sheddable", "model_not_found")] == 1


@pytest.fixture(params=["memory", "redis"])
def store_env(request: pytest.FixtureRequest, tmp_path: Any) -> Any:
    if request.param == "memory":
        yield {}
        return
    from tests.infra import require

    require("redis-server")
    server = RedisServer(tmp_path).start()
    yield {"VEGA_REDIS_URL": server.url}
    server.stop()


async def test_a_job_answers_what_infer_answers_and_says_so_in_its_record(
        store_env: dict[str, str]) -> None:
    async with served(**store_env) as (client, runtime, _):
        for body in ({"inputs": window(7, 0.25)},
                     {"instances": [window(3, 1.0), window(12, 2.0)]}):
            inline = await client.post("/v1/infer", content=orjson.dumps(body))
            accepted = await submit(client, {**body, "ttl_s": 60})
            assert accepted.status_code == 202, accepted.text
            doc = accepted.json()
            assert doc["status"] == "queued" and accepted.headers["location"] == \
                f"/v1/jobs/{doc['id']}"
            assert int(accepted.headers["retry-after"]) >= 1
            final = await until_final(client, doc["id"])
            assert final["status"] == "done" and final["model"] == "echo"
            # Batch size is the third output of echo: compare the sums and lengths only.
            got = final["outputs"] if "instances" in body else [final["outputs"]]
            want = inline.json()["outputs"] if "instances" in body else [inline.json()["outputs"]]
            assert [row[:2] for row in got] == [row[:2] for row in want]
            assert final["finished_ms"] >= final["created_ms"]
        status = (await client.get("/v1/status")).json()["models"]["echo"]["jobs"]
        assert status["durable"] is bool(store_env)
        assert ("note" in status) is not bool(store_env)
        assert status["counts"]["done"] == 2


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    ({"inputs": [[1.0, 2.0]]}, 422),
    ({"inputs": [[0.0] * 8], "colour": "red"}, 422),
    ({"inputs": [[0.0] * 8], "ttl_s": -1}, 422),
    ({"inputs": [[0.0] * 8], "ttl_s": "soon"}, 422),
    ({"inputs": [[0.0] * 8], "priority": "urgent"}, 422),
    ({"instances": []}, 422),
    ([1, 2], 422),
])
async def test_a_bad_job_body_gets_infers_answer_and_stores_nothing(
        body: Any, status: int) -> None:
    async with served() as (client, runtime, _):
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        response = await client.post("/v1/jobs", content=content)
        assert response.status_code == status, response.text
        if not (isinstance(body, dict) and "ttl_s" in body):  # /v1/infer has no ttl_s
            inline = await client.post("/v1/infer", content=content)
            assert inline.status_code == status
        assert (await runtime.jobs.store.stats("echo")).queued == 0
        missing = await client.post("/v1/models/nope/jobs", content=orjson.dumps(
            {"inputs": window(4)}))
        assert missing.status_code == 404


async def test_hostile_job_ids_are_404_and_touch_nothing(store_env: dict[str, str]) -> None:
    async with served(**store_env) as (client, runtime, _):
        for job_id in ["x", "a" * 23, "a" * 21 + "$", "a" * 400, "%00" * 8, "a" * 21 + "%0A"]:
            for method in ("GET", "DELETE"):
                response = await client.request(method, f"/v1/jobs/{job_id}")
                assert response.status_code == 404
                assert response.json()["error"]["code"] == "job_not_found"
        unknown = await client.get("/v1/jobs/" + "a" * 22)  # well formed, never issued
        assert unknown.status_code == 404
        outside = await client.get("/v1/jobs/../../etc/passwd")
        assert outside.status_code == 404  # not a job route at all
        if store_env:
            keys = redis.Redis.from_url(store_env["VEGA_REDIS_URL"]).keys("*job*")
            assert set(keys) <= {b"vega:{echo}:jobs"}  # the stream the runner reads, no record
        assert (await runtime.jobs.store.stats("echo")).queued == 0


async def test_a_keyed_body_nested_past_what_can_be_fingerprinted_is_422() -> None:
    # orjson parses 1024 levels but writes 254: the fingerprint of an Idempotency-Key.
    body = b'{"inputs": ' + b"[" * 300 + b"]" * 300 + b"}"
    async with served() as (client, _runtime, _):
        for path in ("/v1/jobs", "/v1/infer"):
            answer = await client.post(path, content=body, headers={"Idempotency-Key": "k"})
            assert answer.status_code == 422, (path, answer.text)
            assert answer.json()["error"]["code"] == "invalid_input"


async def test_a_bug_on_a_job_route_is_a_json_500_and_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*args: Any) -> None:
        raise TypeError("a record no check foresaw")

    async with served() as (client, runtime, _):
        monkeypatch.setattr(runtime.jobs, "find", broken)
        monkeypatch.setattr(runtime.jobs, "submit", broken)
        for answer in [await client.get("/v1/jobs/" + "a" * 22),
                       await client.delete("/v1/jobs/" + "a" * 22),
                       await submit(client, {"inputs": window(4)})]:
            assert answer.status_code == 500
            assert answer.json()["error"]["code"] == "internal_error"
            assert "foresaw" not in answer.text
    assert sum("internal error" in r.getMessage() for r in caplog.records) == 3


async def test_claims_not_refreshed_through_an_outage_are_told_once(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    async def away(*args: Any) -> None:
        raise ConnectionError("the store is away")

    server = RedisServer(tmp_path).start()
    try:
        async with served(VEGA_REDIS_URL=server.url, VEGA_CLAIM_IDLE_MS="30") as (
                client, runtime, model):
            model.module.sleep_s = 1.0  # the job is held while its claim is refreshed
            monkeypatch.setattr(runtime.jobs.store, "refresh", away)
            with caplog.at_level(logging.WARNING, logger="vega.jobs"):
                job = (await submit(client, {"inputs": window(4)})).json()["id"]
                assert (await until_final(client, job))["status"] == "done"
    finally:
        server.stop()
    told = [r for r in caplog.records if "not refreshed" in r.getMessage()]
    assert len(told) == 1  # not once each 10 ms: ~100 lines a second


async def test_hostile_records_in_redis_fail_alone_and_the_jobs_around_them_run(
        tmp_path: Any) -> None:
    # What someone with Redis access could write: a key of another type, a count int()
    # takes but HINCRBY refuses, a done job without outputs. Each is dropped (or read as
    # not found); the jobs taken in the same batch as them run; no reply is broken JSON.
    server = RedisServer(tmp_path).start()
    look = redis.Redis.from_url(server.url)
    try:
        async with served(VEGA_REDIS_URL=server.url) as (client, runtime, _):
            runner = runtime.jobs.runners["echo"]
            runner.lane.taking.clear()  # the hostile entries and real jobs are read together
            now = wall_ms()
            good: dict[Any, Any] = {
                "model": "echo", "status": "queued", "single": "1", "priority": "1",
                "created_ms": str(now), "expires_ms": str(now + 60_000), "attempts": "0",
                "inputs": orjson.dumps([window(4)])}
            look.set("vega:{echo}:job:" + "P" * 22, "x")
            look.hset("vega:{echo}:job:" + "Q" * 22, mapping={**good, "attempts": " 1"})
            for poison in ("P" * 22, "Q" * 22):
                look.xadd("vega:{echo}:jobs", {"id": poison})
            look.hset("vega:{echo}:job:" + "R" * 22, mapping={**good, "status": "done"})
            ids = [(await submit(client, {"inputs": window(4)})).json()["id"] for _ in range(4)]
            runner.lane.taking.set()
            finals = [await until_final(client, job_id) for job_id in ids]
            assert [doc["status"] for doc in finals] == ["done"] * 4
            undone = await client.get("/v1/jobs/" + "R" * 22)
            assert undone.status_code == 404 and undone.json()["error"]["code"] == "job_not_found"
            pending = look.xpending("vega:{echo}:jobs", "workers")
            assert pending["pending"] == 0  # the hostile entries were acknowledged away
    finally:
        look.close()
        server.stop()


async def test_a_record_with_more_instances_than_a_submit_takes_is_not_run(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Written to Redis by something else: its instances would all join the batcher at once,
    # past every bound a submit keeps (VEGA_MAX_INSTANCES).
    server = RedisServer(tmp_path).start()
    look = redis.Redis.from_url(server.url)
    try:
        async with served(VEGA_REDIS_URL=server.url, VEGA_MAX_INSTANCES="4",
                          VEGA_MAX_ATTEMPTS="1") as (client, _runtime, _):
            now, job_id = wall_ms(), "H" * 22
            look.hset("vega:{echo}:job:" + job_id, mapping={
                "model": "echo", "status": "queued", "single": "0", "priority": "1",
                "created_ms": str(now), "expires_ms": str(now + 60_000), "attempts": "0",
                "inputs": orjson.dumps([window(4)] * 5)})
            look.xadd("vega:{echo}:jobs", {"id": job_id})
            final = await until_final(client, job_id)
            assert final["status"] == "failed", final
            assert final["error"]["code"] == "invalid_input"
            fits = await submit(client, {"instances": [window(4)] * 4})
            assert (await until_final(client, fits.json()["id"]))["status"] == "done"
    finally:
        look.close()
        server.stop()
    assert f"job {job_id} of echo: inputs refused" in caplog.text


async def test_a_store_outage_is_logged_when_it_begins_and_ends_not_every_retry(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path).start()
    try:
        async with served(VEGA_REDIS_URL=server.url) as (client, _runtime, _):
            with caplog.at_level(logging.INFO, logger="vega.jobs"):
                server.stop()
                await asyncio.sleep(2.5)  # five retries
                server.start()
                job_id = (await submit(client, {"inputs": window(4)})).json()["id"]
                assert (await until_final(client, job_id))["status"] == "done"
                for _ in range(100):  # at the next pass of the kind that failed
                    if any("answers again" in r.getMessage() for r in caplog.records):
                        break
                    await asyncio.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if r.name == "vega.jobs"]
        [began] = [m for m in said if m.startswith("job store for echo:")]
        assert re.match(r"job store for echo: \w+Error: \w", began), began  # Redis's words
        assert sum("answers again" in m for m in said) == 1, said
    finally:
        server.stop()


@pytest.mark.parametrize("denied", ["xautoclaim", "hincrby"])
async def test_a_user_without_a_command_logs_it_once_and_leaves_no_job_half_started(
        tmp_path: Any, caplog: pytest.LogCaptureFixture, denied: str) -> None:
    # An ACL without XAUTOCLAIM fails every reclaim while takes succeed: one outage, not
    # an "answers again" between each. Without HINCRBY a start script refused half-way
    # left its jobs "running" for good; starting a job no longer needs it.
    server = RedisServer(tmp_path).start()
    look = redis.asyncio.Redis.from_url(server.url)
    try:
        await look.acl_setuser("limited", enabled=True, passwords=["+pw"], keys=["*"],
                               commands=["+@all", f"-{denied}"])
        url = f"redis://limited:pw@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.INFO, logger="vega.jobs"):
            async with served(VEGA_REDIS_URL=url) as (client, _, _m):
                job_id = (await submit(client, {"inputs": window(4)})).json()["id"]
                assert (await until_final(client, job_id))["status"] == "done"
                await asyncio.sleep(2.5)  # passes that reclaim, and passes that only take
        said = [r.getMessage() for r in caplog.records if r.name == "vega.jobs"]
        began = [m for m in said if m.startswith("job store for echo:")]
        if denied == "xautoclaim":
            assert len(began) == 1 and "NOPERM" in began[0].upper(), said
        else:
            assert began == [], said
        assert not any("answers again" in m for m in said), said
    finally:
        await look.aclose()
        server.stop()


async def test_a_full_backlog_never_asks_for_a_resend_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with served(VEGA_MAX_BATCH_SIZE="1", VEGA_JOBS_MAX_DEPTH="1") as (client, runtime,
                                                                            model):
        model.module.sleep_s = 0.3
        # A fast model's backlog, as predicted:
        monkeypatch.setattr(runtime.jobs, "wait_s", lambda model: 0.0001)
        answers = [await submit(client, {"inputs": window(4), "ttl_s": 60}) for _ in range(3)]
        [refused, *_] = [answer for answer in answers if answer.status_code == 429]
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.json()["error"]["retry_after_ms"] >= 50  # was 0: resent at once


async def test_queued_jobs_can_be_cancelled_or_expire_and_never_run(
        store_env: dict[str, str]) -> None:
    env = {"VEGA_MAX_BATCH_SIZE": "1", "VEGA_JOBS_MAX_DEPTH": "6", **store_env}
    async with served(**env) as (client, runtime, model):
        model.module.sleep_s = 0.3  # two jobs held here at a time, one batch each
        ids = [(await submit(client, {"inputs": window(4, float(n)), "ttl_s": 60})).json()["id"]
               for n in range(4)]
        short = (await submit(client, {"inputs": window(4, 9.0), "ttl_s": 0.05})).json()["id"]
        cancelled = await client.delete(f"/v1/jobs/{ids[3]}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        full = await submit(client, {"inputs": window(4), "ttl_s": 60})
        assert full.status_code == 202  # five queued or held, the bound is six
        over = await submit(client, {"inputs": window(4), "ttl_s": 60})
        over2 = await submit(client, {"inputs": window(4), "ttl_s": 60})
        refused = over2 if over.status_code == 202 else over
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        seen = set()
        while True:
            doc = (await client.get(f"/v1/jobs/{ids[0]}")).json()
            seen.add(doc["status"])
            if doc["status"] == "done":
                break
            await asyncio.sleep(0.01)
        assert "running" in seen
        done = await client.delete(f"/v1/jobs/{ids[0]}")
        assert done.status_code == 409 and done.json()["error"]["code"] == "conflict"
        assert (await until_final(client, short))["status"] == "expired"
        assert (await until_final(client, ids[3]))["status"] == "cancelled"
        for job_id in ids[:3]:
            assert (await until_final(client, job_id))["status"] == "done"
        await settled(runtime)
        counts = runtime.jobs.counts["echo"]
        assert counts["cancelled"] == 1 and counts["expired"] == 1


async def test_a_job_whose_model_raises_is_retried_then_failed_and_dead_lettered(
        store_env: dict[str, str]) -> None:
    env = {"VEGA_MAX_ATTEMPTS": "3", **store_env}
    async with served(**env) as (client, runtime, model):
        runs: list[int] = []
        forward = model.module.__call__

        def counting(x: Any, lengths: Any) -> Any:
            runs.append(int(x.shape[0]))
            return forward(x, lengths)

        model.module.__call__ = counting
        bad = window(4)
        bad[0][0] = FAIL_MARK
        job_id = (await submit(client, {"inputs": bad})).json()["id"]
        final = await until_final(client, job_id)
        assert final["status"] == "failed" and final["error"]["code"] == "model_error"
        assert "dead-lettered" in final["error"]["message"]
        await asyncio.sleep(0.2)
        assert runtime.jobs.stats["echo"].dead_letters == 1
        if store_env:
            client_ = redis.Redis.from_url(store_env["VEGA_REDIS_URL"])
            entries: Any = client_.xrange("vega:{echo}:dlq")
            assert [e[1][b"kind"] for e in entries] == [b"job"]
            assert client_.xlen("vega:{echo}:jobs") == 0  # acknowledged and gone
        metrics = (await client.get("/metrics")).text
        assert 'vega_jobs_total{model="echo",outcome="failed"} 1.0' in metrics
        assert 'vega_jobs_dead_letters{model="echo"} 1.0' in metrics
        assert 'vega_jobs_retried_total{model="echo"} 2.0' in metrics


async def test_a_job_the_model_answers_nan_for_fails_at_once_not_retried() -> None:
    # The same window would answer NaN again: no retry, no dead letter, and no outputs of
    # null stored as its result.
    env = {"VEGA_MODEL": "python:tests.models:spread_scaled", "VEGA_MAX_ATTEMPTS": "3"}
    async with in_process({**BASE, **env}) as (client, runtime):
        rising = [[float(step)] * 8 for step in range(6)]
        done = await until_final(client, (await submit(client, {"inputs": rising})).json()["id"])
        assert done["status"] == "done" and len(done["outputs"]) == 8
        constant = (await submit(client, {"inputs": window(6)})).json()["id"]
        final = await until_final(client, constant)
        assert final["status"] == "failed" and final["error"]["code"] == "model_error"
        assert "NaN" in final["error"]["message"] and "outputs" not in final
        await settled(runtime)
        stats = runtime.jobs.stats["spread_scaled"]
        assert stats.dead_letters == 0
        metrics = (await client.get("/metrics")).text
        retried = [line for line in metrics.splitlines()
                   if line.startswith('vega_jobs_retried_total{model="spread_scaled"}')]
        assert retried in ([], ['vega_jobs_retried_total{model="spread_scaled"} 0.0'])
        assert 'vega_jobs_total{model="spread_scaled",outcome="failed"} 1.0' in metrics


async def test_an_idempotency_key_gives_one_job_and_another_body_is_422(
        store_env: dict[str, str]) -> None:
    async with served(**store_env) as (client, runtime, _):
        body = {"inputs": window(5), "ttl_s": 30}
        first, second = await asyncio.gather(*(submit(client, body, **{"Idempotency-Key": "k1"})
                                               for _ in range(2)))
        assert first.status_code == second.status_code == 202
        assert first.json()["id"] == second.json()["id"]
        other = await submit(client, {"inputs": window(6), "ttl_s": 30},
                             **{"Idempotency-Key": "k1"})
        assert other.status_code == 422
        bad_key = await submit(client, body, **{"Idempotency-Key": "\x01"})
        assert bad_key.status_code == 422
        await until_final(client, first.json()["id"])
        await settled(runtime)
        assert runtime.jobs.counts["echo"]["done"] == 1


async def test_a_key_whose_job_result_has_expired_starts_a_new_job(
        store_env: dict[str, str]) -> None:
    async with served(**store_env, VEGA_JOBS_RESULT_TTL_S="1") as (client, _runtime, _):
        body, key = {"inputs": window(5)}, {"Idempotency-Key": "k-expiring"}
        first = (await submit(client, body, **key)).json()["id"]
        assert (await until_final(client, first))["status"] == "done"
        for _ in range(100):  # the result is kept a second, then forgotten
            if (await client.get(f"/v1/jobs/{first}")).status_code == 404:
                break
            await asyncio.sleep(0.05)
        again = await submit(client, body, **key)
        # Not a replay of an id that answers 404 for good: a job that runs.
        assert again.status_code == 202 and "idempotent-replayed" not in again.headers
        assert again.json()["id"] != first
        assert (await until_final(client, again.json()["id"]))["status"] == "done"


async def test_prefer_respond_async_turns_an_inline_refusal_into_a_job() -> None:
    # Sheddable requests are always refused here (watermark 0): the turn is certain.
    async with served(VEGA_SHED_WATERMARK="0") as (client, _, _model):
        body = orjson.dumps({"inputs": window(4, 0.5), "priority": "sheddable"})
        plain = await client.post("/v1/infer", content=body)
        assert plain.status_code == 429 and plain.json()["error"]["code"] == "shed"
        turned = await client.post("/v1/infer", content=body,
                                   headers={"Prefer": "wait=5, respond-async"})
        assert turned.status_code == 202, turned.text
        assert turned.headers["preference-applied"] == "respond-async"
        assert (await until_final(client, turned.json()["id"]))["status"] == "done"
        served_inline = await client.post("/v1/infer", content=orjson.dumps(
            {"inputs": window(4)}), headers={"Prefer": "respond-async"})
        assert served_inline.status_code == 200  # not refused: nothing is turned
        bad = await client.post("/v1/infer", content=b"{", headers={"Prefer": "respond-async"})
        assert bad.status_code == 400


@pytest.mark.parametrize("peers", [1, 2])
async def test_a_keyed_request_turned_into_a_job_gets_that_job_when_repeated(
        peers: int, tmp_path: Any) -> None:
    # Sheddable requests are always refused here (watermark 0); the repeat, sent as
    # normal (a class a retry may change), would be served inline, as after the load has
    # gone: it gets the first outcome, that job, and the model runs once, not twice.
    server = RedisServer(tmp_path).start()
    try:
        env = {"VEGA_REDIS_URL": server.url, "VEGA_SHED_WATERMARK": "0"}
        async with served(**env) as (first_at, runtime, _), \
                served(**env) as (second_at, other, _):
            body = orjson.dumps({"inputs": window(4, 0.5)})
            keyed = {"Prefer": "respond-async", "Idempotency-Key": "turned-1"}
            first = await first_at.post("/v1/infer", content=body,
                                        headers={**keyed, "X-Vega-Priority": "sheddable"})
            assert first.status_code == 202, first.text
            repeat_at = first_at if peers == 1 else second_at
            again = await repeat_at.post("/v1/infer", content=body, headers=keyed)
            assert again.status_code == 202, again.text
            assert again.json()["id"] == first.json()["id"]
            assert again.headers["idempotent-replayed"] == "true"
            assert (await until_final(first_at, first.json()["id"]))["status"] == "done"
            answered = [sample.labels["outcome"] for r in (runtime, other)
                        for metric in r.metrics.requests.collect()
                        for sample in metric.samples
                        if sample.name.endswith("_total") and sample.value]
            assert "ok" not in answered and answered.count("job") == 2
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_job_refused_unrun_gets_back_the_attempt_its_start_counted(
        kind: str, tmp_path: Any) -> None:
    server = None
    if kind == "memory":
        store: Any = MemoryStore(60, 100)
    else:
        server = RedisServer(tmp_path).start()
        store = RedisStore(server.url, 1.0, 60, 1000)
    try:
        now = wall_ms()
        job = Job(id=new_id(), model="m", instances=b"[[[1.0]]]", single=True, priority=0,
                  created_ms=now, expires_ms=now + 60_000)
        await store.submit(job, None, "", 100)
        for ran, attempts in ((False, 0), (True, 1)):  # a model process restarting; a failure
            [taken] = await store.start(await store.take("m", "me", 1))
            assert taken.attempts == attempts + (0 if ran else 1)
            await store.retry(taken, ran=ran)
            again = await store.get("m", job.id)
            assert again is not None and again.status == "queued"
            assert again.attempts == attempts
    finally:
        await store.close()
        if server is not None:
            server.stop()


async def test_a_burst_of_polls_past_the_redis_pool_waits_for_connections(
        tmp_path: Any) -> None:
    server = RedisServer(tmp_path).start()
    try:
        # Commands get a second: this loop's own lateness, with 300 requests in it, is
        # not under test, only the 64 connections of the store's pool.
        async with served(VEGA_REDIS_URL=server.url, VEGA_REDIS_TIMEOUT_MS="1000") as (
                client, _runtime, _):
            job_id = (await submit(client, {"inputs": window(4)})).json()["id"]
            assert (await until_final(client, job_id))["status"] == "done"
            polls = await asyncio.gather(*(client.get(f"/v1/jobs/{job_id}")
                                           for _ in range(300)))  # the pool holds 64
        assert [r.status_code for r in polls] == [200] * 300, {r.text for r in polls}
    finally:
        server.stop()


@pytest.mark.exclusive  # the loop's own lateness is the point: other tests' load adds to it
async def test_a_burst_of_submits_at_the_default_timeouts_is_taken_whole(
        tmp_path: Any) -> None:
    # 300 submits at once keep this loop busy for longer than VEGA_REDIS_TIMEOUT_MS (100 ms,
    # the inline side channel's bound): at that bound 62 of them got 503 "did not answer
    # in time". The job store has a bound of its own, VEGA_JOBS_REDIS_TIMEOUT_MS (1 s),
    # which the loop of a machine shared with other tests' servers can outrun too.
    server = RedisServer(tmp_path).start()
    try:
        async with served(VEGA_REDIS_URL=server.url) as (client, runtime, _):
            assert runtime.settings.redis_timeout_ms == 100  # the default, not widened here
            body = {"inputs": window(256)}
            submits = await asyncio.gather(*(submit(client, body) for _ in range(300)))
            assert [r.status_code for r in submits] == [202] * 300, \
                Counter(r.text for r in submits if r.status_code != 202)
            assert len({r.json()["id"] for r in submits}) == 300
    finally:
        server.stop()


async def test_a_submit_whose_answer_timed_out_is_kept_if_stored_else_withdrawn(
        tmp_path: Any) -> None:
    # A submit whose answer came late (a busy loop or host) but that Redis had run is
    # stored: taken, 202. One Redis has not run yet when the withdrawal comes (still in its
    # input buffer) gets 503 ("nothing was taken"; Nginx sends it to another process), so
    # it must never run here: the withdrawal's marker stops it.
    server = RedisServer(tmp_path).start()
    store = RedisStore(server.url, 1.0, 60, 1000)
    script = store._scripts["submit"]
    late: list[dict[str, Any]] = []

    async def ran_then_timed_out(**kwargs: Any) -> Any:
        await script(**kwargs)  # Redis ran it; its answer came too late for the client
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    async def ran_later(**kwargs: Any) -> Any:
        late.append(kwargs)  # run once the withdrawal has
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    async def ran_and_started(**kwargs: Any) -> Any:
        await script(**kwargs)
        await store.cmd.hset(kwargs["keys"][1], "status", "running")  # a runner's start
        raise redis.exceptions.TimeoutError("Timeout reading from socket")

    try:
        now = wall_ms()
        for fake, model in ((ran_then_timed_out, "a"), (ran_and_started, "b")):
            job = Job(id=new_id(), model=model, instances=b"[[[1.0]]]", single=True,
                      priority=0, created_ms=now, expires_ms=now + 60_000)
            store._scripts["submit"] = fake  # type: ignore[assignment]
            assert await store.submit(job, "k-1", "p", 100) == Submitted(
                job.id, "queued", True)
            assert await store.get(model, job.id) is not None
            assert await store.cmd.xlen(jobs_key(model)) == 1  # one job, to run once
        job = Job(id=new_id(), model="m", instances=b"[[[1.0]]]", single=True,
                  priority=0, created_ms=now, expires_ms=now + 60_000)
        store._scripts["submit"] = ran_later  # type: ignore[assignment]
        with pytest.raises(redis.exceptions.TimeoutError):
            await store.submit(job, "k-1", "p", 100)
        assert await script(**late.pop()) == [4, b""]  # finds the marker: no job
        assert await store.get("m", job.id) is None
        assert await store.cmd.xlen(jobs_key("m")) == 0
        assert await store.cmd.keys("vega:{m}:*idem*") == []  # the key is free for the retry
        # The withdrawal times out as well (Redis ran neither answer in time): still a 503,
        # and the job is withdrawn in the background rather than left to run.
        store._scripts["submit"] = ran_then_timed_out  # type: ignore[assignment]
        withdraw = store._scripts["withdraw"]
        tries: list[int] = []

        async def timed_out_once(**kwargs: Any) -> Any:
            tries.append(1)
            if len(tries) == 1:
                raise redis.exceptions.TimeoutError("Timeout reading from socket")
            return await withdraw(**kwargs)

        store._scripts["withdraw"] = timed_out_once  # type: ignore[assignment]
        job = Job(id=new_id(), model="w", instances=b"[[[1.0]]]", single=True, priority=0,
                  created_ms=now, expires_ms=now + 60_000)
        with pytest.raises(redis.exceptions.TimeoutError):
            await store.submit(job, None, "p", 100)
        for _ in range(100):  # the first retry comes at once
            if len(tries) >= 2 and not store._withdrawing:
                break
            await asyncio.sleep(0.02)
        assert len(tries) == 2
        assert await store.get("w", job.id) is None
        assert await store.cmd.xlen(jobs_key("w")) == 0
        # With an Idempotency-Key it stays: the caller's retry with that key (here or on a
        # peer, perhaps answered 202 already) gets this job, which a late withdrawal would
        # have deleted under it.
        tries.clear()
        job = Job(id=new_id(), model="k", instances=b"[[[1.0]]]", single=True, priority=0,
                  created_ms=now, expires_ms=now + 60_000)
        with pytest.raises(redis.exceptions.TimeoutError):
            await store.submit(job, "k-2", "p", 100)
        assert len(tries) == 1 and not store._withdrawing
        store._scripts["submit"] = script
        retry = Job(id=new_id(), model="k", instances=b"[[[1.0]]]", single=True, priority=0,
                    created_ms=now, expires_ms=now + 60_000)
        assert await store.submit(retry, "k-2", "p", 100) == Submitted(job.id, "queued", False)
        assert await store.cmd.xlen(jobs_key("k")) == 1
    finally:
        await store.close()
        server.stop()


async def paused(runtime: Any) -> None:
    """Stop the runner between takes (its blocking take ends within 0.5 s)."""
    runtime.jobs.taking.clear()
    await asyncio.sleep(0.8)


async def test_a_poison_job_fails_alone_not_the_jobs_batched_with_it() -> None:
    # One job whose window makes the model raise, three good ones batched with it: each
    # runs again alone, so only the poison one fails (retried, the good ones met it
    # again in every batch and were dead-lettered with it).
    async with served(VEGA_MAX_ATTEMPTS="3") as (client, runtime, _model):
        await paused(runtime)
        bad = window(4)
        bad[0][0] = FAIL_MARK
        poison = (await submit(client, {"inputs": bad})).json()["id"]
        good = [(await submit(client, {"inputs": window(4, float(n))})).json()["id"]
                for n in range(3)]
        runtime.jobs.taking.set()
        assert (await until_final(client, poison))["status"] == "failed"
        finals = [await until_final(client, job_id) for job_id in good]
        assert [f["status"] for f in finals] == ["done"] * 3, finals


async def test_a_job_whose_outputs_json_cannot_write_reaches_a_final_state(
        store_env: dict[str, str]) -> None:  # noqa: F811
    # A model answering a column-major (not C-contiguous) array: orjson refused it, the
    # job's task died, and the job was never finished (memory: 'running' for good;
    # Redis: reclaimed and run again, then failed "no result after 3 attempt(s)").
    env = {"VEGA_CLAIM_IDLE_MS": "300", **store_env}
    async with served(**env) as (client, runtime, model):
        class ColumnMajor:  # __call__ is looked up on the type: wrap the module
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __call__(self, x: Any, lengths: Any) -> Any:
                return self.inner(x, lengths).t().contiguous().t()  # same values and shape

        model.module = ColumnMajor(model.module)
        inline = await client.post("/v1/infer", content=orjson.dumps(
            {"instances": [window(4), window(4)]}))
        await paused(runtime)  # two jobs in one batch: rows of a [2, 3] column-major array
        ids = [(await submit(client, {"inputs": window(4)})).json()["id"] for _ in range(2)]
        runtime.jobs.taking.set()
        finals = [await until_final(client, job_id, timeout_s=4) for job_id in ids]
        # Memory: 'still running' for good. Redis: final only after three reclaims, each
        # running the model again, and then "no result after 3 attempt(s)".
        assert all(f["status"] in ("done", "failed") for f in finals), (finals, inline)
        assert not any("no result after" in f.get("error", {}).get("message", "")
                       for f in finals), finals


async def test_two_deletes_of_one_job_count_one_cancellation(tmp_path: Any) -> None:
    server = RedisServer(tmp_path).start()
    try:
        async with served(VEGA_REDIS_URL=server.url) as (client, runtime, _):
            await paused(runtime)
            job_id = (await submit(client, {"inputs": window(4)})).json()["id"]
            first, second = await asyncio.gather(client.delete(f"/v1/jobs/{job_id}"),
                                                 client.delete(f"/v1/jobs/{job_id}"))
            assert {first.status_code, second.status_code} == {200}
            assert runtime.jobs.counts["echo"]["cancelled"] == 1, runtime.jobs.counts
    finally:
        server.stop()


async def test_an_idempotency_key_lives_as_long_as_its_job_s_record(tmp_path: Any) -> None:
    # A job that expired in the backlog is finished when a runner reaches it, and its
    # record lives another result TTL from then: so does its key, or a replay of the
    # same key and body would make a second job meanwhile.
    server = RedisServer(tmp_path).start()
    store = RedisStore(server.url, 1.0, 1.0, 1000)  # results kept 1 s
    try:
        now = wall_ms()
        job = Job(id=new_id(), model="m", instances=b"[[[1.0]]]", single=True, priority=1,
                  created_ms=now, expires_ms=now + 200)
        assert (await store.submit(job, "key", "print", 100)).created
        await asyncio.sleep(0.6)  # a backlog: the runner reaches it after its expiry
        [taken] = await store.take("m", "me", 10)
        await store.finish(taken, "expired")  # what JobRunner._start does
        await asyncio.sleep(0.8)  # key gone (200 + 1000 ms); record kept until ~1.6 s
        assert (await store.get("m", job.id)) is not None  # GET still answers it
        again = Job(id=new_id(), model="m", instances=b"[[[1.0]]]", single=True, priority=1,
                    created_ms=wall_ms(), expires_ms=wall_ms() + 60_000)
        replay = await store.submit(again, "key", "print", 100)
        assert (replay.id, replay.created) == (job.id, False), replay
    finally:
        await store.close()
        server.stop()


async def test_a_runner_claims_nothing_once_told_to_stop_taking(
        store_env: dict[str, str]) -> None:  # noqa: F811
    # A runner waiting for room when the drain begins claimed more jobs as soon as a
    # held one ended.
    env = {"VEGA_MAX_BATCH_SIZE": "1", **store_env}  # holds two jobs at a time
    async with served(**env) as (client, runtime, model):
        model.module.sleep_s = 0.3
        ids = [(await submit(client, {"inputs": window(4, float(n))})).json()["id"]
               for n in range(5)]
        runner = runtime.jobs.runners["echo"]
        for _ in range(200):
            if runner.held_items >= runner.hold_items:
                break
            await asyncio.sleep(0.01)
        held = set(runner.held)
        runtime.jobs.stop_taking()  # what Runtime.drain does first
        await asyncio.sleep(1.5)
        later = [job_id for job_id in ids if job_id not in held and
                 (await client.get(f"/v1/jobs/{job_id}")).json()["status"] != "queued"]
        assert later == [], f"{len(later)} job(s) claimed after stop_taking"


async def test_the_memory_store_bounds_the_bytes_of_the_inputs_it_holds() -> None:
    # Counted in jobs alone, 12-KB gzip bodies inflating to 4 MB each held 9 MB apiece:
    # the bound of 10,000 jobs was 90 GB.
    store = MemoryStore(60, 100, max_bytes=100)
    now = wall_ms()

    def job(size: int) -> Job:
        return Job(id=new_id(), model="m", instances=b"x" * size, single=True, priority=0,
                   created_ms=now, expires_ms=now + 60_000)

    first = job(60)
    assert (await store.submit(first, None, "", 10)).created
    with pytest.raises(VegaError) as refused:
        await store.submit(job(60), None, "", 10)
    assert refused.value.code == "queue_full" and store.held_bytes == 60
    [taken] = await store.take("m", "me", 1)
    await store.finish(taken, "done", b"[1]")  # its inputs are let go with it
    assert store.held_bytes == 0 and (await store.submit(job(60), None, "", 10)).created


async def test_a_request_too_large_to_queue_inline_becomes_a_job_when_asked() -> None:
    # 10 instances against a normal bound of 8: inline no retry fits (422); a caller that
    # would take a job (respond-async) gets one, as for a refusal for load.
    async with served(VEGA_QUEUE_CAPACITY="16", VEGA_NORMAL_WATERMARK="0.5") as (client, _, _m):
        body = orjson.dumps({"instances": [window(4, 0.5)] * 10})
        plain = await client.post("/v1/infer", content=body)
        assert plain.status_code == 422 and "send fewer" in plain.text
        turned = await client.post("/v1/infer", content=body,
                                   headers={"Prefer": "respond-async"})
        assert turned.status_code == 202, turned.text
        assert (await until_final(client, turned.json()["id"]))["status"] == "done"


async def test_with_the_job_store_away_a_refusal_to_turn_into_a_job_stands(
        tmp_path: Any) -> None:
    # Not a 503: behind Nginx a 503 takes this process out of the upstream, and the job
    # store is away for every process alike.
    server = RedisServer(tmp_path).start()
    try:
        async with served(VEGA_REDIS_URL=server.url) as (client, _runtime, _):
            server.stop()
            turned = await client.post("/v1/infer", content=orjson.dumps(
                {"inputs": window(4)}), headers={"Prefer": "respond-async",
                                                 "X-Vega-Deadline-Ms": "1"})
            assert turned.status_code == 422, turned.text  # what it was refused inline
            assert "idle server" in turned.json()["error"]["message"]
    finally:
        server.stop()


async def test_a_job_body_slower_than_any_inline_deadline_is_taken() -> None:
    # The inline bound on a body (VEGA_MAX_DEADLINE_MS) is not a job's: it may wait hours.
    env = {**BASE, "VEGA_MAX_DEADLINE_MS": "1000", "VEGA_DEFAULT_DEADLINE_MS": "500"}
    async with app_in_process(env, [echo("echo")]) as (app, _):
        body = orjson.dumps({"instances": [window(4)], "ttl_s": 600})
        parts = [body[:10], body[10:]]

        async def receive() -> dict[str, Any]:
            if len(parts) == 1:
                await asyncio.sleep(1.5)  # a slow uplink
            if parts:
                chunk = parts.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        sent: list[MutableMapping[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/jobs",
                 "raw_path": b"/v1/jobs", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"vega"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        assert sent[0]["status"] == 202, sent
