"""What Vega answers over HTTP, in this process (tests/inproc.py): the status table of
DESIGN.md. Socket-level behaviour (a 413 before the body is read) is in test_hostile.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import pytest_asyncio

from tests.inproc import in_process
from tests.models import FAIL_MARK, window
from tests.models import echo as echo_model

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sensor() -> AsyncIterator[httpx.AsyncClient]:
    async with in_process({"VEGA_MAX_BODY_BYTES": "200000"}) as (client, _):
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def echo() -> AsyncIterator[httpx.AsyncClient]:
    model = echo_model("echo")
    model.module.hang_s = 0.6  # a window marked -FAIL_MARK hangs this long
    async with in_process({"VEGA_MAX_WAIT_MS": "2"}, [model]) as (client, _):
        yield client


async def post(client: httpx.AsyncClient, body: object, path: str = "/v1/infer",
               headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return await client.post(path, content=content, headers=headers)


def outputs_of(response: httpx.Response) -> Any:
    assert response.status_code == 200, (response.status_code, response.text)
    return response.json()["outputs"]


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"])
    return str(body["error"]["code"])


async def test_answers_one_window_with_outputs_and_server_timing(sensor: httpx.AsyncClient) -> None:
    response = await post(sensor, {"inputs": window(20)})
    assert response.status_code == 200
    outputs = response.json()["outputs"]
    assert len(outputs) == 4 and sum(outputs) == pytest.approx(1.0, abs=1e-5)
    timing = response.headers["server-timing"]
    assert timing.startswith("queue;dur=") and ", infer;dur=" in timing


async def test_same_window_alone_or_batched_gives_the_same_answer(
        sensor: httpx.AsyncClient) -> None:
    rng = np.random.default_rng(1)
    windows = [rng.standard_normal((n, 8)).tolist() for n in (5, 40, 33)]
    together = outputs_of(await post(sensor, {"instances": windows}))
    alone = [outputs_of(await post(sensor, {"inputs": w})) for w in windows]
    np.testing.assert_allclose(together, alone, atol=1e-5)


async def test_instances_are_answered_in_order(echo: httpx.AsyncClient) -> None:
    windows = [window(n, value=float(n)) for n in (300, 2, 40, 7, 100)]
    response = await post(echo, {"instances": windows})
    assert response.status_code == 200
    sums = [row[0] for row in response.json()["outputs"]]
    assert sums == [n * n * 8 for n in (300, 2, 40, 7, 100)]


@pytest.mark.parametrize("body, code", [
    (b"{not json", "invalid_json"),
    (b'{"inputs": "\xff\xfe"}', "invalid_json"),
    (b"", "invalid_json"),
    ({"inputs": [[1.0, 2.0]]}, "invalid_input"),
    ({"inputs": [["a"] * 8]}, "invalid_input"),
    ({"inputs": [[True] * 8]}, "invalid_input"),
    ({"inputs": [[1e39] * 8]}, "invalid_input"),
    ({"inputs": [[1.0] * 8, [1.0] * 7]}, "invalid_input"),
    ({"inputs": [[0.0] * 8] * 513}, "invalid_input"),
    ({"inputs": []}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "colour": "red"}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "instances": [[[0.0] * 8]]}, "invalid_input"),
    ({"instances": []}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "priority": "urgent"}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "deadline_ms": -5}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "deadline_ms": "soon"}, "invalid_input"),
    ([1, 2, 3], "invalid_input"),
])
async def test_bad_input_is_a_clear_4xx(sensor: httpx.AsyncClient, body: object, code: str) -> None:
    response = await post(sensor, body)
    assert response.status_code == {"invalid_json": 400, "invalid_input": 422}[code]
    assert error_of(response) == code


async def test_inference_paths_answer_only_post_and_real_paths(sensor: httpx.AsyncClient) -> None:
    # POSTs to the inference paths skip Starlette's router (vega/server.py HotRoutes);
    # anything else must still get what the router says.
    assert (await sensor.get("/v1/infer")).status_code == 405
    assert (await sensor.get("/v1/models/sensor/infer")).status_code == 405
    for path in ("/v1/models/a/b/infer", "/v1/models//infer", "/v1/infer/"):
        answer = await post(sensor, {"inputs": window(4)}, path=path)
        assert answer.status_code in (404, 307), path
    assert (await post(sensor, {"inputs": window(4)}, path="/v1/infer")).status_code == 200


async def test_bad_priority_header_is_422(sensor: httpx.AsyncClient) -> None:
    response = await post(sensor, {"inputs": window(4)}, headers={"X-Vega-Priority": "vip"})
    assert response.status_code == 422 and error_of(response) == "invalid_input"


async def test_unknown_model_is_404(sensor: httpx.AsyncClient) -> None:
    response = await post(sensor, {"inputs": window(4)}, path="/v1/models/nope/infer")
    assert response.status_code == 404 and error_of(response) == "model_not_found"
    named = await post(sensor, {"inputs": window(4)}, path="/v1/models/sensor/infer")
    assert named.status_code == 200


async def test_body_over_the_limit_is_413_declared_or_streamed(sensor: httpx.AsyncClient) -> None:
    big = b'{"inputs": [' + b"[0,0,0,0,0,0,0,0]," * 20000 + b"[0,0,0,0,0,0,0,0]]}"
    response = await post(sensor, big)
    assert response.status_code == 413 and error_of(response) == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:
        yield big[:1000]
        yield big[1000:]

    streamed = await sensor.post("/v1/infer", content=chunks())
    assert streamed.status_code == 413


async def test_model_error_is_500_for_that_batch_only(echo: httpx.AsyncClient) -> None:
    bad = window(8, value=1.0)
    bad[0][0] = FAIL_MARK
    response = await post(echo, {"inputs": bad})
    assert response.status_code == 500 and error_of(response) == "model_error"
    assert (await post(echo, {"inputs": window(8)})).status_code == 200
    assert (await echo.get("/readyz")).status_code == 200


async def test_deadline_passing_while_running_is_504(echo: httpx.AsyncClient) -> None:
    hang = window(8)
    hang[0][0] = -FAIL_MARK
    response = await post(echo, {"inputs": hang, "deadline_ms": 300})
    assert response.status_code == 504 and error_of(response) == "deadline_exceeded"


async def test_deadline_header_and_priority_header_are_honoured(echo: httpx.AsyncClient) -> None:
    response = await post(echo, {"inputs": window(8)},
                    headers={"X-Vega-Priority": "critical", "X-Vega-Deadline-Ms": "9000"})
    assert response.status_code == 200
    # 1 ms cannot cover the batching window (2 ms): refused up front, not run late.
    hopeless = await post(echo, {"inputs": window(8)}, headers={"X-Vega-Deadline-Ms": "1"})
    assert hopeless.status_code == 429 and error_of(hopeless) == "deadline_unmeetable"
    assert int(hopeless.headers["retry-after"]) >= 1
    metrics = (await echo.get("/metrics")).text
    assert 'vega_requests_total{model="echo",outcome="ok",priority="critical"}' in metrics


async def test_status_models_metrics_and_health(echo: httpx.AsyncClient) -> None:
    assert (await echo.get("/healthz")).json() == {"status": "ok"}
    assert (await echo.get("/readyz")).status_code == 200
    status = (await echo.get("/v1/status")).json()
    assert status["ready"] is True
    assert set(status["models"]["echo"]["depth"]) == {"critical", "normal", "sheddable"}
    assert status["models"]["echo"]["service_rate_items_per_s"] > 0
    assert status["models"]["echo"]["standing_queue"] is False
    assert status["models"]["echo"]["queue_behind"] is False
    models = (await echo.get("/v1/models")).json()["models"]
    assert models[0]["name"] == "echo" and models[0]["inputs"][0]["shape"] == [-1, 8]
    metrics = (await echo.get("/metrics")).text
    for name in ("vega_requests_total", "vega_rejections_total", "vega_queue_depth",
                 "vega_queue_wait_seconds", "vega_batch_size", "vega_batch_padding_ratio",
                 "vega_inference_seconds", "vega_request_seconds", "vega_inflight_batches",
                 "vega_service_rate_items_per_second", "vega_redis_up"):
        assert f"# TYPE {name} " in metrics, name


async def test_a_per_step_model_answers_each_window_with_its_own_rows() -> None:
    # A user's eager module answering one row per step, in its model process (the default):
    # batched with longer windows, each answer still holds its own window's rows, no more.
    env = {"VEGA_MODEL": "python:tests.models:per_step", "VEGA_MAX_WAIT_MS": "20"}
    async with in_process(env) as (client, _):
        lengths = [3, 11, 40]
        answers = await asyncio.gather(*(post(client, {"inputs": window(n)}) for n in lengths))
        assert [len(outputs_of(answer)) for answer in answers] == lengths
        assert {len(row) for answer in answers for row in outputs_of(answer)} == {3}
        both = outputs_of(await post(client, {"instances": [window(2), window(9)]}))
        assert [len(rows) for rows in both] == [2, 9]
        metadata = (await client.get("/v2/models/per_step")).json()
        assert metadata["outputs"][0]["shape"] == [-1, -1, 3]
