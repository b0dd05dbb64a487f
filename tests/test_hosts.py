"""Two Vega hosts and one host with Redis and Nginx, as network namespaces (DESIGN.md:
nothing in Vega assumes one host): overflow, a killed thief and a cut link, across hosts."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.models import FAIL_MARK
from tests.netns import Hosts
from tests.servers import VegaProcess, metric, wait_until
from tests.test_cluster import (
    CLUSTER_ENV,
    check_outputs,
    hang_on_thief_then_kill_it,
    outcomes,
    send,
)

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

REDIS_PORT = 6390
PASSWORD = "vega-test-password"
Cluster = tuple[Hosts, Callable[..., VegaProcess], str]
VEGA_PORT = 8000


@pytest.fixture
def cluster(hosts: type[Hosts], tmp_path: Path) -> Iterator[Cluster]:
    """Factory: the three hosts up, Redis on `store`; returns (hosts, start_vega(name, env))."""
    topology = hosts(["a", "b", "store"]).up()
    store = topology.address["store"]
    redis_proc = subprocess.Popen(
        [*topology.prefix("store"), "redis-server", "--bind", store, "--port", str(REDIS_PORT),
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
         "--requirepass", PASSWORD],  # reached over a network: a password, as in production
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://:{PASSWORD}@{store}:{REDIS_PORT}/0"
    wait_until(lambda: _pings(url), 10, "redis on the store host")
    started: list[VegaProcess] = []

    def start(name: str, **env: str) -> VegaProcess:
        proc = VegaProcess({**CLUSTER_ENV, "VEGA_REDIS_URL": url, "VEGA_NODE_ID": name.upper(),
                            **env}, log_path=tmp_path / f"vega-{name}.log", port=VEGA_PORT,
                           host=topology.address[name], prefix=topology.prefix(name))
        started.append(proc)
        return proc.start()

    yield topology, start, url
    for proc in started:
        proc.kill()
    redis_proc.kill()
    redis_proc.wait()


def _pings(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def peers(proc: VegaProcess) -> list[str]:
    return [p["node"] for p in httpx.get(proc.url + "/v1/status", timeout=5).json()["peers"]]


async def test_overflow_crosses_hosts(cluster: Cluster) -> None:
    _topology, start, _url = cluster
    a = start("a", TEST_SLEEP_MS="40")
    b = start("b", TEST_SLEEP_MS="40")
    wait_until(lambda: peers(a) == ["B"], 15, "heartbeats across hosts")
    values = [float(i % 50) for i in range(160)]
    responses = await send(a.url, values, concurrency=40)
    assert outcomes(responses) == Counter(ok=160)
    check_outputs(values, responses)
    assert metric(b, "vega_overflow_batches_total", direction="in") > 0
    assert metric(a, "vega_requests_total") == 160


async def test_killed_thief_on_another_host_is_reclaimed(cluster: Cluster) -> None:
    _topology, start, url = cluster
    a = start("a", TEST_SLEEP_MS="300", TEST_HANG_MS="3000")
    b = start("b", TEST_HANG_MS="60000")
    wait_until(lambda: peers(a) == ["B"], 15, "heartbeats across hosts")
    answer = await hang_on_thief_then_kill_it(a, b, url)
    assert answer.status_code == 200
    assert answer.json()["outputs"][0] == pytest.approx(-FAIL_MARK + 0.5 * 15)


async def test_cutting_a_hosts_link_ends_in_explicit_answers(cluster: Cluster) -> None:
    topology, start, _url = cluster
    a = start("a", TEST_SLEEP_MS="40")
    b = start("b", TEST_SLEEP_MS="40")
    wait_until(lambda: peers(a) == ["B"], 15, "heartbeats across hosts")
    values = [float(i % 50) for i in range(300)]
    load = asyncio.ensure_future(send(a.url, values, concurrency=40, deadline_ms=3000))
    await asyncio.to_thread(wait_until, lambda: metric(
        b, "vega_overflow_batches_total", direction="in") > 0, 10, "B to steal")
    topology.cut("b")  # B keeps running, unreachable: its stolen batches never come back
    try:
        responses = await asyncio.wait_for(load, 60)  # never a hang
    finally:
        topology.mend("b")
    counts = outcomes(responses)
    assert counts["ok"] > 0 and set(counts) <= {"ok", "deadline_exceeded", "deadline_unmeetable",
                                         "model_error"}, counts
    check_outputs(values, responses)
    assert metric(a, "vega_requests_total") == 300
