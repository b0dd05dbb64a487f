"""HTTP behaviour of one real `vega serve` process: the status table of DESIGN.md."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import orjson
import pytest

from tests.models import FAIL_MARK, window
from tests.servers import VegaProcess


@pytest.fixture(scope="module")
def sensor(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module(VEGA_MAX_BODY_BYTES="200000", VEGA_TORCH_THREADS="1")


@pytest.fixture(scope="module")
def echo(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module(VEGA_MODEL="python:tests.models:echo", TEST_HANG_MS="600",
                       VEGA_MAX_WAIT_MS="2")


def post(server: VegaProcess, body: object, path: str = "/v1/infer",
         headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"])
    return str(body["error"]["code"])


def test_answers_one_window_with_outputs_and_server_timing(sensor: VegaProcess) -> None:
    response = post(sensor, {"inputs": window(20)})
    assert response.status_code == 200
    outputs = response.json()["outputs"]
    assert len(outputs) == 4 and sum(outputs) == pytest.approx(1.0, abs=1e-5)
    timing = response.headers["server-timing"]
    assert timing.startswith("queue;dur=") and ", infer;dur=" in timing


def test_same_window_alone_or_batched_gives_the_same_answer(sensor: VegaProcess) -> None:
    rng = np.random.default_rng(1)
    windows = [rng.standard_normal((n, 8)).tolist() for n in (5, 40, 33)]
    together = post(sensor, {"instances": windows}).json()["outputs"]
    alone = [post(sensor, {"inputs": w}).json()["outputs"] for w in windows]
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_instances_are_answered_in_order(echo: VegaProcess) -> None:
    windows = [window(n, value=float(n)) for n in (300, 2, 40, 7, 100)]
    response = post(echo, {"instances": windows})
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
def test_bad_input_is_a_clear_4xx(sensor: VegaProcess, body: object, code: str) -> None:
    response = post(sensor, body)
    assert response.status_code == {"invalid_json": 400, "invalid_input": 422}[code]
    assert error_of(response) == code


def test_inference_paths_answer_only_post_and_real_paths(sensor: VegaProcess) -> None:
    # POSTs to the inference paths skip Starlette's router (vega/server.py HotRoutes);
    # anything else must still get what the router says.
    assert httpx.get(sensor.url + "/v1/infer").status_code == 405
    assert httpx.get(sensor.url + "/v1/models/sensor/infer").status_code == 405
    for path in ("/v1/models/a/b/infer", "/v1/models//infer", "/v1/infer/"):
        assert post(sensor, {"inputs": window(4)}, path=path).status_code in (404, 307), path
    assert post(sensor, {"inputs": window(4)}, path="/v1/infer").status_code == 200


def test_bad_priority_header_is_422(sensor: VegaProcess) -> None:
    response = post(sensor, {"inputs": window(4)}, headers={"X-Vega-Priority": "vip"})
    assert response.status_code == 422 and error_of(response) == "invalid_input"


def test_unknown_model_is_404(sensor: VegaProcess) -> None:
    response = post(sensor, {"inputs": window(4)}, path="/v1/models/nope/infer")
    assert response.status_code == 404 and error_of(response) == "model_not_found"
    assert post(sensor, {"inputs": window(4)}, path="/v1/models/sensor/infer").status_code == 200


def test_body_over_the_limit_is_413_declared_or_streamed(sensor: VegaProcess) -> None:
    big = b'{"inputs": [' + b"[0,0,0,0,0,0,0,0]," * 20000 + b"[0,0,0,0,0,0,0,0]]}"
    response = post(sensor, big)
    assert response.status_code == 413 and error_of(response) == "payload_too_large"

    def chunks() -> Iterator[bytes]:
        yield big[:1000]
        yield big[1000:]

    streamed = httpx.post(sensor.url + "/v1/infer", content=chunks(), timeout=30)
    assert streamed.status_code == 413


def test_413_is_answered_without_reading_the_rest(sensor: VegaProcess) -> None:
    with socket.create_connection(("127.0.0.1", sensor.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


def test_model_error_is_500_for_that_batch_only(echo: VegaProcess) -> None:
    bad = window(8, value=1.0)
    bad[0][0] = FAIL_MARK
    response = post(echo, {"inputs": bad})
    assert response.status_code == 500 and error_of(response) == "model_error"
    assert post(echo, {"inputs": window(8)}).status_code == 200
    assert httpx.get(echo.url + "/readyz").status_code == 200


def test_deadline_passing_while_running_is_504(echo: VegaProcess) -> None:
    hang = window(8)
    hang[0][0] = -FAIL_MARK
    response = post(echo, {"inputs": hang, "deadline_ms": 300})
    assert response.status_code == 504 and error_of(response) == "deadline_exceeded"


def test_deadline_header_and_priority_header_are_honoured(echo: VegaProcess) -> None:
    response = post(echo, {"inputs": window(8)},
                    headers={"X-Vega-Priority": "critical", "X-Vega-Deadline-Ms": "9000"})
    assert response.status_code == 200
    # 1 ms cannot cover the batching window (2 ms): refused up front, not run late.
    hopeless = post(echo, {"inputs": window(8)}, headers={"X-Vega-Deadline-Ms": "1"})
    assert hopeless.status_code == 429 and error_of(hopeless) == "deadline_unmeetable"
    assert int(hopeless.headers["retry-after"]) >= 1
    metrics = httpx.get(echo.url + "/metrics").text
    assert 'vega_requests_total{model="echo",outcome="ok",priority="critical"}' in metrics


def test_status_models_metrics_and_health(echo: VegaProcess) -> None:
    assert httpx.get(echo.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(echo.url + "/readyz").status_code == 200
    status = httpx.get(echo.url + "/v1/status").json()
    assert status["ready"] is True
    assert set(status["models"]["echo"]["depth"]) == {"critical", "normal", "sheddable"}
    assert status["models"]["echo"]["service_rate_items_per_s"] > 0
    models = httpx.get(echo.url + "/v1/models").json()["models"]
    assert models[0]["name"] == "echo" and models[0]["inputs"][0]["shape"] == [-1, 8]
    metrics = httpx.get(echo.url + "/metrics").text
    for name in ("vega_requests_total", "vega_rejections_total", "vega_queue_depth",
                 "vega_queue_wait_seconds", "vega_batch_size", "vega_batch_padding_ratio",
                 "vega_inference_seconds", "vega_request_seconds", "vega_inflight_batches",
                 "vega_service_rate_items_per_second", "vega_redis_up"):
        assert f"# TYPE {name} " in metrics, name
