"""Loop lag: non-critical requests refused while the event loop itself runs late."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.inproc import in_process
from tests.models import window
from vega.errors import VegaError
from vega.pressure.looplag import LoopLag
from vega.records import CRITICAL, NORMAL, SHEDDABLE

ECHO = {"VEGA_MODEL": "python:tests.models:echo", "VEGA_LENGTH_BUCKETS": "16",
        "VEGA_CACHE_BYTES": "1000000"}  # limit: the default 1-s deadline / 8 = 125 ms


async def held_turns(lag: LoopLag, turns: int, held_s: float) -> None:
    """``turns`` turns of the loop, each held ``held_s`` while requests keep coming."""
    for _ in range(turns):
        lag.touch()
        lag.touch()  # a second request after the probe was armed: the flood goes on
        time.sleep(held_s)
        # The probe, overdue, fires in the loop's next turn, after this task's step: two
        # turns, not a timed sleep, which on a loaded host can outlast the re-armed probe
        # as well (its lateness, read after, then was that of a probe in time).
        for _ in range(2):
            await asyncio.sleep(0)


async def held_until_all_refused(lag: LoopLag, most: int = 40) -> None:
    """Late turns (150 ms) until every non-critical request is refused, at most ``most``:
    on a loaded host a probe may fire in time between two held turns, and the next late
    turn then starts a new run instead of adding to the share."""
    for _ in range(most):
        if lag.share == 1.0:
            return
        await held_turns(lag, 1, held_s=0.15)


def refusals(lag: LoopLag, priority: int, requests: int) -> list[tuple[int, VegaError]]:
    """The requests refused among ``requests`` checks: (index, error)."""
    refused = []
    for index in range(requests):
        try:
            lag.check(priority)
        except VegaError as error:
            refused.append((index, error))
    return refused


async def test_a_late_loop_refuses_a_growing_share_of_non_critical_requests() -> None:
    lag = LoopLag(deadline_s=0.8)  # turns past 100 ms are late
    await held_turns(lag, 3, held_s=0.02)
    assert lag.share == 0.0 and not refusals(lag, NORMAL, 50)  # 20-ms turns are in time
    await held_turns(lag, 1, held_s=0.15)
    assert lag.lag_s > 0.1 and lag.share == 0.0  # one late turn is a hiccup, not a flood
    await held_turns(lag, 2, held_s=0.15)
    assert 0.2 < lag.share < 0.5  # ~0.15 for each late turn after the first
    refused = refusals(lag, NORMAL, 100)
    assert abs(len(refused) - round(100 * lag.share)) <= 1
    gaps = {b - a for (a, _), (b, _) in zip(refused, refused[1:])}
    assert gaps <= {int(1 / lag.share), int(1 / lag.share) + 1}  # spread evenly, not in runs
    assert {e.code for _, e in refused} == {"queue_full"}
    assert all(e.headers()["Retry-After"] == "1" for _, e in refused)
    assert {e.code for _, e in refusals(lag, SHEDDABLE, 20)} == {"shed"}
    assert not refusals(lag, CRITICAL, 100)
    await held_until_all_refused(lag)
    assert lag.share == 1.0 and len(refusals(lag, NORMAL, 20)) == 20


async def test_the_share_falls_back_as_the_loop_keeps_time_requests_or_not() -> None:
    lag = LoopLag(deadline_s=0.8)
    await held_until_all_refused(lag)
    assert lag.share == 1.0
    began = time.monotonic()
    while time.monotonic() - began < 0.3:  # turns in time, requests still coming
        lag.touch()
        lag.touch()
        await asyncio.sleep(0.01)
    assert 0.4 < lag.share < 0.9  # less by the time the loop kept time: ~0.3
    await held_until_all_refused(lag)
    assert lag.share == 1.0
    await asyncio.sleep(1.2)  # the flood over: probes in time bring the share back to 0
    assert lag.share == 0.0 and not refusals(lag, NORMAL, 20)
    await asyncio.sleep(0.05)
    assert not lag.armed  # and then stop: no timer while nothing comes


async def test_a_late_loop_refuses_even_cached_answers_but_never_critical() -> None:
    body = {"inputs": window(16), "priority": "critical"}
    async with in_process(ECHO) as (client, runtime):
        first = await client.post("/v1/infer", json=body)
        assert first.status_code == 200 and first.headers["x-vega-cache"] == "miss"
        await held_turns(runtime.lag, 8, held_s=0.2)  # past the 125-ms limit, turn on turn
        normal = [await client.post("/v1/infer", json={**body, "priority": "normal"})
                  for _ in range(10)]
        sheddable = await client.post("/v1/infer", json={**body, "priority": "sheddable"})
        # Not turned into a job: that would be more work for the loop, not less.
        later = await client.post("/v1/infer", json={**body, "priority": "sheddable"},
                                  headers={"Prefer": "respond-async"})
        critical = await client.post("/v1/infer", json=body)
        status = (await client.get("/v1/status")).json()
        metrics = (await client.get("/metrics")).text
    refused = [r for r in normal if r.status_code == 429]
    assert len(refused) >= 8  # the share near 1: the cached answer did not save them
    assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert "event loop" in refused[0].json()["error"]["message"]
    assert sheddable.status_code == 429 and sheddable.json()["error"]["code"] == "shed"
    assert later.status_code == 429 and later.json()["error"]["code"] == "shed"
    assert critical.status_code == 200 and critical.headers["x-vega-cache"] == "hit"
    assert status["loop"]["refused"] == len(refused) + 2 and status["loop"]["lag_ms"] >= 0
    assert status["models"]["echo"]["jobs"]["depth"] == 0  # no job made of a refusal
    assert gauge(metrics, "vega_loop_refused_share") > 0.5
    assert gauge(metrics, "vega_loop_refused_total") == len(refused) + 2
    assert "vega_loop_lag_seconds" in metrics


def gauge(metrics: str, name: str) -> float:
    [line] = [line for line in metrics.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.parametrize("held_s", [0.0, 0.05])
async def test_a_loop_in_time_refuses_nothing(held_s: float) -> None:
    body = {"inputs": window(16)}
    async with in_process(ECHO) as (client, _runtime):
        for _ in range(5):
            answers = [await client.post("/v1/infer", json=body) for _ in range(3)]
            assert [a.status_code for a in answers] == [200, 200, 200]
            time.sleep(held_s)
            await asyncio.sleep(0.01)
        status = (await client.get("/v1/status")).json()
    assert status["loop"]["refused"] == 0 and status["loop"]["refused_share"] == 0.0
