"""The fallback model: under a backlog, degradable classes get its answers; critical does not."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.inproc import BASE, in_process
from tests.models import window
from tests.servers import VegaProcess, wait_until
from vega.config import load_settings
from vega.models.loader import ModelLoadError
from vega.server import create_app

SLOW = {"VEGA_MODEL": "python:tests.models:echo", "TEST_SLEEP_MS": "300",
        "VEGA_MAX_BATCH_SIZE": "1", "VEGA_MAX_INFLIGHT_BATCHES": "1",
        "VEGA_LENGTH_BUCKETS": "16", "VEGA_QUEUE_CAPACITY": "20",
        "VEGA_DEFAULT_DEADLINE_MS": "20000", "VEGA_CODEL_INTERVAL_MS": "20000"}


def body(priority: str) -> bytes:
    return orjson.dumps({"inputs": window(8), "priority": priority})


async def send(client: httpx.AsyncClient, url: str, priorities: list[str]
               ) -> list[httpx.Response]:
    return list(await asyncio.gather(*(client.post(url + "/v1/infer", content=body(p))
                                       for p in priorities)))


def queued(url: str) -> int:
    depth = httpx.get(url + "/v1/status").json()["models"]["echo"]["depth"]
    return int(sum(depth.values()))


async def test_under_a_backlog_degradable_classes_get_the_fallback(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(**SLOW, VEGA_FALLBACK_MODEL="python:tests.models:echo_fast",
                  VEGA_DEGRADE_WATERMARK="0.1")  # 2 of 20 queued
    async with httpx.AsyncClient(timeout=30) as client:
        status = (await client.get(server.url + "/v1/status")).json()
        assert status["fallback_model"] == "echo_fast"
        # Critical work is never degraded: it builds the backlog on the main model.
        backlog = asyncio.ensure_future(send(client, server.url, ["critical"] * 5))
        await asyncio.to_thread(wait_until, lambda: queued(server.url) >= 3, 10, "a backlog")
        measured = await send(client, server.url, ["normal"] * 3 + ["sheddable"] * 3
                              + ["critical"] * 2)
        first = await backlog
        metrics = (await client.get(server.url + "/metrics")).text
    assert [r.status_code for r in first + measured] == [200] * 13, [
        r.text for r in first + measured]
    assert all(r.json()["model"] == "echo" for r in first)
    for r in measured[:6]:
        assert r.json()["model"] == "echo_fast" and r.headers["x-vega-degraded"] == "1"
        assert r.json()["outputs"][1] == 8.0  # the same inputs, answered by the fallback
    for r in measured[6:]:
        assert r.json()["model"] == "echo" and "x-vega-degraded" not in r.headers
    assert 'vega_degraded_total{model="echo",priority="sheddable"} 3.0' in metrics
    assert 'vega_degraded_total{model="echo",priority="critical"}' not in metrics


async def test_requests_the_main_model_would_refuse_go_to_the_fallback(
        vega: Callable[..., VegaProcess]) -> None:
    common = {**SLOW, "VEGA_QUEUE_CAPACITY": "8", "VEGA_SHED_WATERMARK": "0.25",
              "VEGA_NORMAL_WATERMARK": "0.5"}
    plain = vega(**common)
    degrading = vega(**common, VEGA_FALLBACK_MODEL="python:tests.models:echo_fast",
                     VEGA_DEGRADE_WATERMARK="1", VEGA_DEGRADE_CLASSES="sheddable")
    async with httpx.AsyncClient(timeout=30) as client:
        without, with_fallback = await asyncio.gather(
            send(client, plain.url, ["sheddable"] * 10),
            send(client, degrading.url, ["sheddable"] * 10))
        normal = await send(client, degrading.url, ["normal"] * 6)  # not a degradable class
    refused = sum(r.status_code == 429 for r in without)
    assert refused >= 6
    # The fallback has its own (same-sized) queue, but it empties far faster.
    assert sum(r.status_code == 429 for r in with_fallback) < refused
    assert sum(r.status_code == 200 and r.json()["model"] == "echo_fast"
               for r in with_fallback) >= 2
    assert all(r.status_code == 429 or r.json()["model"] == "echo" for r in normal)


async def test_with_no_room_even_for_critical_degradable_requests_still_get_the_fallback(
        vega: Callable[..., VegaProcess]) -> None:
    # Refused unread as if critical (the most the body could claim), they never reached
    # the idle fallback: 429 queue_full for every class.
    # A batch takes 2 s; critical callers keep coming until four are queued, the bound
    # (they end well within the 20-s deadline, so none is refused for time).
    server = vega(**{**SLOW, "VEGA_QUEUE_CAPACITY": "4", "TEST_SLEEP_MS": "2000"},
                  VEGA_FALLBACK_MODEL="python:tests.models:echo_fast")
    async with httpx.AsyncClient(timeout=30) as client:
        backlog: list[asyncio.Future[httpx.Response]] = []
        try:
            for _ in range(100):
                if await asyncio.to_thread(queued, server.url) >= 4:
                    break
                backlog.append(asyncio.ensure_future(client.post(
                    server.url + "/v1/infer", content=body("critical"))))
                await asyncio.sleep(0.2)
            else:
                answered = [f.result().text for f in backlog if f.done() and not f.exception()]
                pytest.fail(f"the queue never filled: {answered}")
            measured = await send(client, server.url, ["normal", "sheddable", "critical"])
        finally:
            for waiting in backlog:  # their answers take seconds more, and are not tested
                waiting.cancel()
            await asyncio.gather(*backlog, return_exceptions=True)
    assert [r.status_code for r in measured] == [200, 200, 429], [r.text for r in measured]
    assert [r.json()["model"] for r in measured[:2]] == ["echo_fast"] * 2


async def test_a_degraded_answer_is_marked_and_not_cached_on_either_protocol() -> None:
    env = {"VEGA_MODEL": "python:tests.models:echo", "VEGA_LENGTH_BUCKETS": "16",
           "VEGA_FALLBACK_MODEL": "python:tests.models:echo_fast",
           "VEGA_DEGRADE_WATERMARK": "0",  # every degradable request goes to the fallback
           "VEGA_CACHE_BYTES": "1000000"}
    v2 = orjson.dumps({"inputs": [{"name": "INPUT__0", "shape": [1, 8, 8], "datatype": "FP32",
                                   "data": sum(window(8), [])}]})
    async with in_process(env) as (client, _runtime):
        for path, content in (("/v1/infer", body("normal")),
                              ("/v2/models/echo/infer", v2)):
            answers = [await client.post(path, content=content) for _ in range(2)]
            assert [r.status_code for r in answers] == [200, 200], answers[0].text
            assert [r.headers.get("x-vega-degraded") for r in answers] == ["1", "1"], path
            # The main model would answer it otherwise: a later call must not get this one.
            assert [r.headers["x-vega-cache"] for r in answers] == ["miss", "miss"], path
        kept = [await client.post("/v1/infer", content=body("critical")) for _ in range(2)]
    assert [r.headers["x-vega-cache"] for r in kept] == ["miss", "hit"]  # critical: the main's


async def test_a_degraded_window_the_main_model_would_refuse_is_refused_all_the_same() -> None:
    # patches takes 8..256 steps, its fallback any length: a caller's answer or refusal must
    # not hang on whether the server was loaded enough to degrade it.
    env = {"VEGA_MODEL": "python:tests.models:patches",
           "VEGA_FALLBACK_MODEL": "python:tests.models:patch_means",
           "VEGA_DEGRADE_WATERMARK": "0"}  # every degradable request goes to the fallback
    tensor = {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 3, 8], "data": [0.5] * 24}
    async with in_process(env) as (client, _runtime):
        fine = await client.post("/v1/infer", json={"inputs": window(16)})
        assert fine.status_code == 200 and fine.headers["x-vega-degraded"] == "1"
        for length in (3, 300):
            short = await client.post("/v1/infer", json={"inputs": window(length)})
            assert short.status_code == 422, short.text
            assert f"window length {length} outside 8..256" in short.text
        both = await client.post("/v1/infer", json={"instances": [window(9), window(2)]})
        assert both.status_code == 422 and "instance 1: window length 2" in both.text
        v2 = await client.post("/v2/models/patches/infer", json={"inputs": [tensor]})
        assert v2.status_code == 422 and "outside 8..256" in v2.text


async def test_a_fallback_that_answers_in_another_shape_is_refused_at_start() -> None:
    # Known only once both are loaded: one row per step against one number per window.
    env = {**BASE, "VEGA_MODEL": "python:tests.models:per_step",
           "VEGA_FALLBACK_MODEL": "python:tests.models:window_sum"}
    _app, runtime = create_app(load_settings(environ=env))
    await runtime.start()
    try:
        with pytest.raises(ModelLoadError, match=r"answers different outputs from 'per_step' "
                                                 r"\(per_step: \[-1, 3\], window_sum: \[\]\)"):
            await runtime.wait_ready()
        assert not runtime.ready
    finally:
        await runtime.stop()


def test_a_fallback_for_shorter_windows_is_refused_at_start() -> None:
    # Degraded to it, a window the main model takes would be refused 422 invalid_input.
    env = {**BASE, "VEGA_MODEL": "python:tests.models:window_sum",
           "VEGA_FALLBACK_MODEL": "python:tests.models:short_window_sum"}
    with pytest.raises(ModelLoadError, match=r"windows of at most 100 steps, 'window_sum' of 512"):
        create_app(load_settings(environ=env))
    env = {**BASE, "VEGA_MODEL": "python:tests.models:patches",
           "VEGA_FALLBACK_MODEL": "python:tests.models:whole_patches_of_16"}
    with pytest.raises(ModelLoadError, match=r"windows of at least 16 steps, 'patches' of 8"):
        create_app(load_settings(environ=env))
