"""The async lane on Redis past one server: a three-primary Cluster, and Sentinel.

Against a real Redis Cluster: in this process (two models, whose keys live on
different primaries), a job answers what /v1/infer answers, an Idempotency-Key makes
one job, a raising model's job is failed and dead-lettered; then two real processes,
a job submitted to one answered through the other, and one killed holding claimed
jobs, which the other finishes. Against a real primary, replica and Sentinel: jobs
submitted before the primary is killed are all done after the failover; one
submitted during it is accepted or refused 503 ``not_ready``, never lost.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.models import FAIL_MARK, echo, ledger, tagged, window
from tests.redis_topologies import Cluster, SentinelSet, spread
from tests.servers import VegaProcess, wait_until
from tests.test_jobs import BASE, settled, submit, until_final
from tests.test_jobs_cluster import job, kill_a_holder_and_finish_through_b
from tests.test_jobs_cluster import submit as submit_to
from vega.channel.client import connect
from vega.channel.keys import dlq_key, job_dead_key, job_key, jobs_key
from vega.config import load_settings
from vega.models import ModelAdapter
from vega.runtime import Runtime
from vega.server import create_app

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

MODELS = ("echo", "sensor")  # their hash tags fall in different thirds of the slots
# On two shared CPUs a 100 ms command can time out, and after a timeout the cluster
# client drops the node's idle connections under commands starting on them.
SLACK = {"VEGA_REDIS_TIMEOUT_MS": "1000"}

# -- in this process, on the cluster -------------------------------------------------


@asynccontextmanager
async def served(url: str, **env: str) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime, Any]]:
    """The app with both models on ``url``, and a plain client to look at Redis with."""
    settings = load_settings(environ={**BASE, "VEGA_REDIS_URL": url, **SLACK, **env})
    models: list[ModelAdapter] = [echo(name) for name in MODELS]
    app, runtime = create_app(settings, models)
    await runtime.start()
    await runtime.wait_ready()
    look: Any = connect(url, 2.0)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://vega") as client:
            yield client, runtime, look
    finally:
        await look.aclose()
        await runtime.stop()


async def test_jobs_of_two_models_answer_what_infer_answers_from_two_primaries(
        redis_cluster: Cluster) -> None:
    async with served(redis_cluster.url) as (client, runtime, look):
        ids = {}
        for model in MODELS:
            for body in ({"inputs": window(7, 0.25)},
                         {"instances": [window(3, 1.0), window(12, 2.0)]}):
                inline = await client.post(f"/v1/models/{model}/infer",
                                           content=orjson.dumps(body))
                accepted = await client.post(f"/v1/models/{model}/jobs",
                                             content=orjson.dumps({**body, "ttl_s": 60}))
                assert accepted.status_code == 202, accepted.text
                job_id = accepted.json()["id"]
                ids[job_id] = model
                final = await until_final(client, job_id)
                assert final["status"] == "done" and final["model"] == model
                # Batch size is echo's third output: compare the sums and lengths only.
                got = final["outputs"] if "instances" in body else [final["outputs"]]
                want = inline.json()["outputs"]
                want = want if "instances" in body else [want]
                assert [row[:2] for row in got] == [row[:2] for row in want]
        records = [job_key(model, job_id) for job_id, model in ids.items()]
        assert all([await look.exists(key) for key in records])  # results, kept with a TTL
        assert all([0 < await look.pttl(key) for key in records])
        assert all([await look.xlen(jobs_key(model)) == 0 for model in MODELS])  # all acked
        assert len(spread(redis_cluster, records)) == 2  # each model's keys on its own primary
        for model in MODELS:
            status = (await client.get("/v1/status")).json()["models"][model]["jobs"]
            assert status["durable"] is True and status["counts"]["done"] == 2
        assert runtime.jobs.durable


@pytest.mark.parametrize("topology", ["redis_cluster", "redis_sentinel"])
async def test_a_burst_past_the_client_s_connections_is_served(
        request: pytest.FixtureRequest, topology: str) -> None:
    # 300 polls at once, past the 64 connections a pool holds: they wait for one (or the
    # cluster's nodes take them), as on one server, not 503 "the job store is unreachable".
    url = request.getfixturevalue(topology).url
    # Seconds, not one, for a command and a wait for a connection: on a CI host busy with
    # the rest of the suite, a Sentinel's 64 new connections (each asks where the primary
    # is) took past a second. A pool without a wait refuses at once, whatever the bound.
    async with served(url, VEGA_REDIS_TIMEOUT_MS="5000") as (client, _runtime, _look):
        job_id = (await submit(client, {"inputs": window(4)})).json()["id"]
        assert (await until_final(client, job_id))["status"] == "done"
        polls = await asyncio.gather(*(client.get(f"/v1/jobs/{job_id}") for _ in range(300)))
    assert [r.status_code for r in polls] == [200] * 300, {r.text for r in polls}


async def test_an_idempotency_key_makes_one_job_on_the_cluster(redis_cluster: Cluster) -> None:
    async with served(redis_cluster.url) as (client, runtime, look):
        body = {"inputs": window(5, 0.75), "ttl_s": 30}
        async def keyed_submit() -> httpx.Response:
            # A 503 (the store did not answer in time) may or may not have stored the
            # job: the contract is to retry with the same key (docs/jobs.md).
            for _ in range(5):
                answer = await submit(client, body, **{"Idempotency-Key": "k-c1"})
                if answer.status_code != 503:
                    return answer
                await asyncio.sleep(0.1)
            return answer

        answers = await asyncio.gather(*(keyed_submit() for _ in range(6)))
        assert {a.status_code for a in answers} == {202}
        assert len({a.json()["id"] for a in answers}) == 1
        # At least five replays: the cluster client may resend a submit whose answer it
        # timed out on, and the script, finding its own job, answers that as a replay too.
        assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) >= 5
        other = await submit(client, {"inputs": window(6), "ttl_s": 30},
                             **{"Idempotency-Key": "k-c1"})
        assert other.status_code == 422
        final = await until_final(client, answers[0].json()["id"])
        assert final["status"] == "done"
        await settled(runtime)
        assert runtime.jobs.counts["echo"]["done"] == 1
        held = [key async for key in look.scan_iter(match="vega:{echo}:jobs:idem:*")]
        assert len(held) >= 1  # the key's record, on the cluster


async def test_a_raising_model_s_job_is_failed_and_dead_lettered_on_the_cluster(
        redis_cluster: Cluster) -> None:
    async with served(redis_cluster.url, VEGA_MAX_ATTEMPTS="2") as (client, runtime, look):
        before = await look.xlen(dlq_key("sensor"))
        bad = window(4)
        bad[0][0] = FAIL_MARK
        accepted = await client.post("/v1/models/sensor/jobs", content=orjson.dumps(
            {"inputs": bad, "ttl_s": 60}))
        assert accepted.status_code == 202
        final = await until_final(client, accepted.json()["id"])
        assert final["status"] == "failed" and final["error"]["code"] == "model_error"
        assert "dead-lettered" in final["error"]["message"]
        entries: Any = await look.xrange(dlq_key("sensor"))
        assert len(entries) == before + 1
        assert entries[-1][1][b"kind"] == b"job"
        assert entries[-1][1][b"job"] == job_key("sensor", accepted.json()["id"]).encode()
        assert int(await look.get(job_dead_key("sensor"))) >= 1
        assert await look.xlen(jobs_key("sensor")) == 0  # acknowledged and gone
        metrics = (await client.get("/metrics")).text
        assert 'vega_jobs_retried_total{model="sensor"} 1.0' in metrics


# -- two real processes on the cluster -----------------------------------------------


@dataclass
class Pair:
    a: VegaProcess
    b: VegaProcess
    ledger: str


JOB_ENV = {"VEGA_MODEL": "python:tests.models:echo", "VEGA_LENGTH_BUCKETS": "16",
           "VEGA_CLAIM_IDLE_MS": "500", "VEGA_MAX_BATCH_SIZE": "4", "TEST_SLEEP_MS": "150",
           "VEGA_CAPACITY_SAMPLE_S": "0.1", **SLACK}


@pytest.fixture(scope="module")
def pair(redis_cluster: Cluster, vega_module: Callable[..., VegaProcess],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    book = str(tmp_path_factory.mktemp("jobs-cluster") / "ledger")
    env = {**JOB_ENV, "VEGA_REDIS_URL": redis_cluster.url, "TEST_LEDGER": book}
    a, b = vega_module(VEGA_NODE_ID="A", **env), vega_module(VEGA_NODE_ID="B", **env)
    yield Pair(a, b, book)


def test_a_job_submitted_to_one_process_is_answered_by_the_other_on_the_cluster(
        pair: Pair, redis_cluster: Cluster) -> None:
    accepted = submit_to(pair.a, {"inputs": tagged(1001), "ttl_s": 60},
                         **{"Idempotency-Key": "pair-1"})
    assert accepted.status_code == 202
    job_id = accepted.json()["id"]
    again = submit_to(pair.b, {"inputs": tagged(1001), "ttl_s": 60},
                      **{"Idempotency-Key": "pair-1"})
    assert again.status_code == 202 and again.json()["id"] == job_id  # one job, both doors
    final = wait_until(lambda: (doc := job(pair.b, job_id))["status"] == "done" and doc,
                       30, "the job done, seen through B")
    assert final["outputs"][1] == 16.0  # echo's second output: the window's length
    assert job(pair.a, job_id) == final
    assert Counter(ledger(pair.ledger))[1001] == 1


@pytest.mark.exclusive
def test_jobs_held_by_a_killed_process_are_finished_by_the_other_on_the_cluster(
        pair: Pair) -> None:
    kill_a_holder_and_finish_through_b(pair.a, pair.b, pair.ledger)


# -- Sentinel: the primary killed with jobs queued and held --------------------------


def status_when_answering(proc: VegaProcess, job_id: str) -> str | None:
    """A job's status; None while the job store is away (503 not_ready, as the contract says)."""
    response = httpx.get(f"{proc.url}/v1/jobs/{job_id}", timeout=10)
    if response.status_code == 503:
        assert response.json()["error"]["code"] == "not_ready", response.text
        return None
    assert response.status_code == 200, response.text
    return str(response.json()["status"])


def test_jobs_submitted_before_a_sentinel_failover_are_all_done_after_it(
        redis_sentinel: SentinelSet, vega: Callable[..., VegaProcess], tmp_path: Path) -> None:
    book = str(tmp_path / "ledger")
    proc = vega(**JOB_ENV, VEGA_REDIS_URL=redis_sentinel.url, TEST_LEDGER=book)
    ids = {}
    for tag in range(5000, 5060):  # ~2.4 s of work at 4 items per 150 ms
        response = submit_to(proc, {"inputs": tagged(tag), "ttl_s": 120})
        assert response.status_code == 202
        ids[tag] = response.json()["id"]
    during: list[httpx.Response] = []
    stop = threading.Event()

    def keep_submitting() -> None:  # through the failover window
        tag = 6000
        while not stop.is_set():
            during.append(submit_to(proc, {"inputs": tagged(tag), "ttl_s": 120}))
            tag += 1
            stop.wait(0.05)

    assert job(proc, ids[5059])["status"] in ("queued", "running")  # work spans the failover
    # Killed at once: a 202 means a replica has the job too (the submit waits for it).
    submitter = threading.Thread(target=keep_submitting)
    submitter.start()
    try:
        redis_sentinel.fail_over()
        wait_until(lambda: status_when_answering(proc, ids[5000]) in ("queued", "running",
                                                                      "done"),
                   30, "the job store answering again")
    finally:
        stop.set()
        submitter.join()
    assert {r.status_code for r in during} <= {202, 503}
    refused = [r.json()["error"]["code"] for r in during if r.status_code == 503]
    assert set(refused) <= {"not_ready"}
    for number, response in enumerate(during):
        if response.status_code == 202:
            ids[6000 + number] = response.json()["id"]

    def all_final() -> dict[int, Any] | None:
        docs = {tag: httpx.get(f"{proc.url}/v1/jobs/{job_id}", timeout=10)
                for tag, job_id in ids.items()}
        if any(d.status_code != 200 for d in docs.values()):
            return None
        bodies = {tag: d.json() for tag, d in docs.items()}
        return bodies if all(b["status"] not in ("queued", "running")
                             for b in bodies.values()) else None

    finals = wait_until(all_final, 60, "every accepted job final after the failover")
    assert {d["status"] for d in finals.values()} == {"done"}  # none lost, none failed
    runs = Counter(ledger(book))
    assert [tag for tag in ids if runs[tag] < 1] == []
    assert redis_sentinel.primary_port() == redis_sentinel.replica
