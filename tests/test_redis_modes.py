"""Redis past one server: ``VEGA_REDIS_URL`` for a Cluster and for Sentinel, checked and used.

Against a real three-primary Redis Cluster: one runtime in this process (heartbeats,
the node registry, a hand-off taken back), then two real processes (overflow between
them, the shared cache tier and idempotency keys across them). Against a real
primary, replica and Sentinel: the primary killed under load, requests served locally
through the failover with the books kept, overflow back on the new primary.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.books import Books, offer, steady
from tests.infra import require
from tests.inproc import in_process
from tests.models import echo, forwarded, ledger, tagged, window
from tests.redis_topologies import Cluster, SentinelSet, spread
from tests.servers import ROOT, VegaProcess, metric, wait_until
from tests.test_cluster import CLUSTER_ENV, check_outputs, outcomes, peers_of, send
from tests.test_streams import (
    check_an_unclaimed_hand_off_is_taken_back,
    check_the_solo_heartbeat,
    solo_runtime,
)
from vega.channel.client import connect
from vega.channel.keys import NODES, node_key, overflow_key, reply_key
from vega.channel.url import CLUSTER, SENTINEL, STANDALONE, parse_redis_url
from vega.config import ConfigError, load_settings
from vega.runtime import Runtime

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

# -- the setting ---------------------------------------------------------------------


@pytest.mark.parametrize("url, mode, nodes, service, db", [
    ("redis://h:6380/2", STANDALONE, (), "", 0),
    ("unix:///run/redis.sock", STANDALONE, (), "", 0),
    ("redis+cluster://h1:7000,h2:7001", CLUSTER, (("h1", 7000), ("h2", 7001)), "", 0),
    ("rediss+cluster://:pw@h1", CLUSTER, (("h1", 6379),), "", 0),
    ("redis+sentinel://s1:26379,[::1]:26380/main", SENTINEL,
     (("s1", 26379), ("::1", 26380)), "main", 0),
    ("redis+sentinel://u:p%40ss@s1/main/3", SENTINEL, (("s1", 26379),), "main", 3),
])
def test_urls_name_the_topology(url: str, mode: str, nodes: tuple[tuple[str, int], ...],
                                service: str, db: int) -> None:
    target = parse_redis_url(url)
    assert (target.mode, target.nodes, target.service, target.db) == (mode, nodes, service, db)
    if "p%40ss" in url:
        assert (target.username, target.password) == ("u", "p@ss")


@pytest.mark.parametrize("url", [
    "http://h:6379", "redis+cluster://", "redis+cluster://h1:7000,", "redis+cluster://h:99999",
    "redis+cluster://h1:7000/1", "redis+cluster://h1:7000?x=1", "redis+sentinel://s1:26379",
    "redis+sentinel://s1:26379/", "redis+sentinel://s1/main/x", "redis+sentinel://s 1/main",
])
def test_malformed_urls_are_refused_naming_the_variable(url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(environ={"VEGA_REDIS_URL": url})
    assert str(refused.value).startswith("VEGA_REDIS_URL=")


def test_a_malformed_url_stops_the_start_with_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vega", "serve"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
             "VEGA_REDIS_URL": "redis+sentinel://:s3cret@s1:26379,s2:26379"})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "VEGA_REDIS_URL" in lines[0] and "redis+sentinel" in lines[0]
    assert "s3cret" not in done.stderr and ":***@s1:26379,s2:26379" in lines[0]


# -- one runtime in this process against the cluster ---------------------------------


@pytest.fixture
async def runtime(redis_cluster: Cluster) -> AsyncIterator[Runtime]:
    async with solo_runtime(redis_cluster.url) as rt:
        yield rt


async def test_heartbeats_and_the_node_registry_work_across_the_cluster_s_slots(
        runtime: Runtime, redis_cluster: Cluster) -> None:
    # The keys one beat writes live on more than one primary: the pipeline crossed slots.
    assert len(spread(redis_cluster, [node_key("solo"), NODES, overflow_key("echo"),
                                      reply_key("solo")])) > 1
    client: Any = connect(redis_cluster.url, 2.0)
    try:
        await check_the_solo_heartbeat(runtime, client)
        assert await client.zscore(NODES, "solo") is not None
    finally:
        await client.aclose()


@pytest.mark.exclusive  # the take-back must run within the item's 300-ms deadline
async def test_a_hand_off_nobody_takes_is_taken_back_through_the_cluster(
        runtime: Runtime) -> None:
    # The origin's timer and its take-back script answer, with keys on several primaries.
    await check_an_unclaimed_hand_off_is_taken_back(runtime)
    assert runtime.streams is not None
    assert runtime.streams.metrics.redis_up._value.get() == 1  # no command was refused


async def test_a_cluster_not_up_yet_is_redis_away_until_it_comes_up(
        tmp_path: Path) -> None:
    # No node answering raises redis-py's RedisClusterException, not a RedisError: it
    # must read as Redis away (local work, reconnect), not escape as a 500 or end the
    # reconnect task for good.
    require("redis-server", "redis-cli")
    cluster = Cluster(tmp_path)
    env = {"VEGA_REDIS_URL": cluster.url, "VEGA_LENGTH_BUCKETS": "16",
           "VEGA_HEARTBEAT_MS": "100"}
    try:
        async with in_process(env, [echo("echo")]) as (client, rt):
            assert rt.streams is not None and not rt.streams.up
            reply = await client.post("/v1/infer", json={"inputs": window(4)},
                                      headers={"Idempotency-Key": "k-1"})
            assert reply.status_code == 200, reply.text
            await asyncio.to_thread(cluster.up)
            for _ in range(300):
                if rt.streams.up:
                    break
                await asyncio.sleep(0.05)
            assert rt.streams.up, "overflow never reached the cluster once it was up"
        # Leaving while the cluster is away (its goodbye unanswered) ends the stop too.
        cluster.stop_all()
        async with in_process(env, [echo("echo")]) as (client, rt):
            assert rt.streams is not None and not rt.streams.up
    finally:
        cluster.stop_all()


# -- two real processes against the cluster ------------------------------------------


@pytest.fixture(scope="module")
def cluster_pair(redis_cluster: Cluster, vega_module: Callable[..., VegaProcess],
                 tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[VegaProcess, VegaProcess, list[str]]]:
    """A and B, slow (40 ms a batch), with the shared cache tier and idempotency keys on."""
    logs = [str(tmp_path_factory.mktemp("forwards") / name) for name in ("a", "b")]
    env = {**CLUSTER_ENV, "VEGA_REDIS_URL": redis_cluster.url, "TEST_SLEEP_MS": "40",
           "VEGA_CACHE_BYTES": "1000000", "VEGA_CACHE_REDIS_TTL_S": "60"}
    a = vega_module(VEGA_NODE_ID="A", TEST_FORWARD_LOG=logs[0], **env)
    b = vega_module(VEGA_NODE_ID="B", TEST_FORWARD_LOG=logs[1], **env)
    wait_until(lambda: peers_of(a) == ["B"] and peers_of(b) == ["A"], 10, "heartbeats")
    yield a, b, logs


@pytest.mark.exclusive
async def test_skewed_load_overflows_between_two_processes_on_the_cluster(
        cluster_pair: tuple[VegaProcess, VegaProcess, list[str]]) -> None:
    a, b, _ = cluster_pair
    values = [1000.0 + i for i in range(160)]  # distinct bodies: no cache hits
    responses = await send(a.url, values, concurrency=40)
    assert outcomes(responses) == Counter(ok=160)
    check_outputs(values, responses)
    assert metric(b, "vega_overflow_batches_total", direction="in") > 0  # B stole
    assert metric(a, "vega_overflow_batches_total", direction="out") > 0
    assert metric(a, "vega_requests_total", outcome="ok") >= 160
    assert metric(b, "vega_requests_total") == 0  # B answered A's callers through A
    assert metric(a, "vega_redis_up") == 1 and metric(b, "vega_redis_up") == 1


def test_the_shared_cache_tier_serves_one_process_s_answer_to_the_other(
        cluster_pair: tuple[VegaProcess, VegaProcess, list[str]]) -> None:
    a, b, logs = cluster_pair
    body = orjson.dumps({"inputs": window(4, 0.125)})
    first = httpx.post(a.url + "/v1/infer", content=body, timeout=10)
    assert first.status_code == 200 and first.headers["x-vega-cache"] == "miss"
    runs = [forwarded(log) for log in logs]

    def hit() -> bool:
        again = httpx.post(b.url + "/v1/infer", content=body, timeout=10)
        return again.headers["x-vega-cache"] == "hit" and again.content == first.content
    wait_until(hit, 5, "B to find A's answer in the cluster")  # A writes it in the background
    assert [forwarded(log) for log in logs] == runs  # B did not run it
    assert metric(b, "vega_cache_hits_total", tier="redis") >= 1


async def test_an_idempotency_key_runs_once_across_the_two_processes(
        cluster_pair: tuple[VegaProcess, VegaProcess, list[str]]) -> None:
    a, b, logs = cluster_pair
    body = orjson.dumps({"inputs": window(8, 0.375)})
    before = sum(forwarded(log) for log in logs)

    async def post(url: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as client:
            return await client.post(url + "/v1/infer", content=body,
                                     headers={"Idempotency-Key": "order-11",
                                              "Content-Type": "application/json"})
    first = await post(a.url)
    together = await asyncio.gather(post(b.url), post(a.url), post(b.url))
    assert {r.status_code for r in [first, *together]} == {200}
    assert {r.content for r in together} == {first.content}
    assert all(r.headers.get("idempotent-replayed") == "true" for r in together)
    # Cache misses ran it once on A; the repeats on B were replays from the cluster.
    assert sum(forwarded(log) for log in logs) == before + 1


# -- Sentinel: the primary killed mid-load -------------------------------------------


def labelled(item_id: int, priority: str) -> bytes:
    return orjson.dumps({"inputs": tagged(item_id, length=2), "priority": priority,
                         "deadline_ms": 3000})


async def test_a_sentinel_failover_mid_load_keeps_the_books_and_overflow_resumes(
        redis_sentinel: SentinelSet, vega: Callable[..., VegaProcess], tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    env = {**CLUSTER_ENV, "VEGA_REDIS_URL": redis_sentinel.url, "TEST_SLEEP_MS": "40",
           "TEST_LEDGER": str(ran)}
    a = vega(VEGA_NODE_ID="A", **env)
    b = vega(VEGA_NODE_ID="B", **env)
    wait_until(lambda: peers_of(a) == ["B"] and peers_of(b) == ["A"], 10, "heartbeats")
    books = Books()
    # 150/s for 8 s at A, which alone runs ~100/s: overflow to B until the primary dies.
    load = asyncio.ensure_future(offer(a.url, steady(150, 8, labelled), books))
    await asyncio.to_thread(wait_until, lambda: metric(
        b, "vega_overflow_batches_total", direction="in") > 0, 10, "B to be stealing")
    await asyncio.to_thread(redis_sentinel.fail_over)
    await load
    assert books.problems(ledger(str(ran)), reruns_allowed=True) == [], books.summary()
    tally = books.tally()
    assert tally["200"] > 0.5 * books.sent, books.summary()
    assert "redis unreachable" in a.log()  # it noticed, and served locally meanwhile
    assert metric(a, "vega_requests_total") == books.sent  # every request answered once
    # Both back on the new primary, stealing again.
    await asyncio.to_thread(wait_until, lambda: metric(a, "vega_redis_up") == 1 and
                            metric(b, "vega_redis_up") == 1 and peers_of(a) == ["B"], 20,
                            "both on the new primary")
    stolen = metric(b, "vega_overflow_batches_total", direction="in")
    values = [2000.0 + i for i in range(120)]
    assert outcomes(await send(a.url, values, concurrency=40)) == Counter(ok=120)
    assert metric(b, "vega_overflow_batches_total", direction="in") > stolen
    assert redis_sentinel.primary_port() == redis_sentinel.replica
