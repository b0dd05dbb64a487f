"""What Vega answers over HTTP, in this process (tests/inproc.py): the status table of
DESIGN.md. Socket-level behaviour (a 413 before the body is read) is in test_hostile.py."""

from __future__ import annotations

import asyncio
import gc
import gzip
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
from vega.models import load_model

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
    (b'{"inputs": [[1e400, 0, 0, 0, 0, 0, 0, 0]]}', "invalid_input"),  # JSON, past a double
    ({"inputs": [[1.0] * 8, [1.0] * 7]}, "invalid_input"),
    ({"inputs": [[0.0] * 8] * 513}, "invalid_input"),
    ({"inputs": []}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "colour": "red"}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "instances": [[[0.0] * 8]]}, "invalid_input"),
    ({"instances": []}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "priority": "urgent"}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "deadline_ms": -5}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "deadline_ms": "soon"}, "invalid_input"),
    ({"inputs": [[0.0] * 8], "id": 7}, "invalid_input"),
    ([1, 2, 3], "invalid_input"),
])
async def test_bad_input_is_a_clear_4xx(sensor: httpx.AsyncClient, body: object, code: str) -> None:
    response = await post(sensor, body)
    assert response.status_code == {"invalid_json": 400, "invalid_input": 422}[code]
    assert error_of(response) == code


async def test_inference_paths_answer_only_post_and_real_paths(sensor: httpx.AsyncClient) -> None:
    # POSTs to the inference paths skip Starlette's router (vega/server.py HotRoutes);
    # anything else must still get what the router says.
    for path in ("/v1/infer", "/v1/models/sensor/infer"):
        wrong = await sensor.get(path)
        assert wrong.status_code == 405 and error_of(wrong) == "method_not_allowed"
        assert wrong.headers["allow"] == "POST"
    for path in ("/v1/models/a/b/infer", "/v1/models//infer", "/v1/infer/", "/nope"):
        answer = await post(sensor, {"inputs": window(4)}, path=path)
        assert answer.status_code == 404 and error_of(answer) == "not_found", path
    v2 = await sensor.get("/v2/models/sensor/nope")  # the protocol's own error shape
    assert v2.status_code == 404 and v2.json()["error"].startswith("not_found: ")
    root = await sensor.post("/v2")  # the server metadata route: a v2 path too
    assert root.status_code == 405 and root.json()["error"].startswith("method_not_allowed: ")
    assert set(root.headers["allow"].split(", ")) == {"GET", "HEAD"}
    jobs = await sensor.put("/v1/jobs/abc")
    assert jobs.status_code == 405 and set(jobs.headers["allow"].split(", ")) == \
        {"GET", "HEAD", "DELETE"}
    assert (await post(sensor, {"inputs": window(4)}, path="/v1/infer")).status_code == 200


async def test_bad_priority_header_is_422(sensor: httpx.AsyncClient) -> None:
    response = await post(sensor, {"inputs": window(4)}, headers={"X-Vega-Priority": "vip"})
    assert response.status_code == 422 and error_of(response) == "invalid_input"
    # A field given as null is not given: the header under it is still read.
    response = await post(sensor, {"inputs": window(4), "priority": None},
                          headers={"X-Vega-Priority": "vip"})
    assert response.status_code == 422 and "vip" in response.json()["error"]["message"]


async def test_a_refused_instance_of_several_is_named(sensor: httpx.AsyncClient) -> None:
    response = await post(sensor, {"instances": [window(4), window(4), [[0.1] * 7]]})
    assert response.status_code == 422 and error_of(response) == "invalid_input"
    assert response.json()["error"]["message"].startswith("instance 2: expected shape [L, 8]")
    alone = await post(sensor, {"inputs": [[0.1] * 7]})
    assert alone.json()["error"]["message"].startswith("expected shape [L, 8]")


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


async def test_a_window_the_model_raises_on_fails_only_its_caller_not_its_batch_mates(
        echo: httpx.AsyncClient) -> None:
    hang = window(8)
    hang[0][0] = -FAIL_MARK  # holds the model 0.6 s: the callers below queue as one batch
    holding = asyncio.ensure_future(post(echo, {"inputs": hang}))
    await asyncio.sleep(0.1)
    bad = window(8, value=1.0)
    bad[0][0] = FAIL_MARK
    bodies = [{"inputs": window(n)} for n in (3, 5, 7)] + [{"inputs": bad}] + \
        [{"inputs": window(n)} for n in (9, 11)]
    answers = await asyncio.gather(*(post(echo, body) for body in bodies))
    assert (await holding).status_code == 200
    assert [a.status_code for a in answers] == [200, 200, 200, 500, 200, 200]
    assert error_of(answers[3]) == "model_error"
    sizes = [outputs_of(a)[2] for a in answers if a.status_code == 200]
    assert sizes[0] == 3.0  # echo: [sum, length, batch size]: answered by a rerun's half
    assert [outputs_of(a)[:2] for a in answers if a.status_code == 200] == [
        [0.5 * 8 * n, float(n)] for n in (3, 5, 7, 9, 11)]


async def test_deadline_passing_while_running_is_504(echo: httpx.AsyncClient) -> None:
    hang = window(8)
    hang[0][0] = -FAIL_MARK
    response = await post(echo, {"inputs": hang, "deadline_ms": 300})
    assert response.status_code == 504 and error_of(response) == "deadline_exceeded"


async def test_a_request_of_several_windows_past_its_deadline_leaves_no_error_unread(
        echo: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    # asyncio logs a failed future nobody read as an ERROR: under overload, one line for
    # every request of several windows that timed out or was refused part-way.
    hang = window(8)
    hang[0][0] = -FAIL_MARK
    with caplog.at_level("ERROR", logger="asyncio"):
        response = await post(echo, {"instances": [hang, window(8)], "deadline_ms": 300})
        await asyncio.sleep(0.01)  # the windows' cancellation reaches what awaited them
        gc.collect()
    assert response.status_code == 504 and error_of(response) == "deadline_exceeded"
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_deadline_header_and_priority_header_are_honoured(echo: httpx.AsyncClient) -> None:
    response = await post(echo, {"inputs": window(8), "priority": None, "deadline_ms": None},
                    headers={"X-Vega-Priority": "critical", "X-Vega-Deadline-Ms": "9000"})
    assert response.status_code == 200
    # 1 ms cannot cover the deadline margin (2 ms) even on an idle server: refused up
    # front, not run late, and not told to retry (no retry could meet it).
    hopeless = await post(echo, {"inputs": window(8)}, headers={"X-Vega-Deadline-Ms": "1"})
    assert hopeless.status_code == 422 and error_of(hopeless) == "invalid_input"
    assert "on an idle server" in hopeless.json()["error"]["message"]
    assert "retry-after" not in hopeless.headers
    metrics = (await echo.get("/metrics")).text
    assert 'vega_requests_total{model="echo",outcome="ok",priority="critical"}' in metrics


async def test_a_deadline_counts_from_arrival_not_from_the_last_byte_of_the_body(
        echo: httpx.AsyncClient) -> None:
    body = orjson.dumps({"inputs": window(8)})

    async def slowly() -> AsyncIterator[bytes]:
        yield body[:10]
        await asyncio.sleep(0.5)  # a slow upload outlives the deadline it names
        yield body[10:]

    late = await echo.post("/v1/infer", content=slowly(),
                           headers={"X-Vega-Deadline-Ms": "200"})
    assert late.status_code == 504 and error_of(late) == "deadline_exceeded"
    # The idempotent path counts from arrival too: the expired attempt is not kept.
    keyed = await echo.post("/v1/infer", content=slowly(),
                            headers={"X-Vega-Deadline-Ms": "200", "Idempotency-Key": "slow"})
    assert keyed.status_code == 504
    assert (await post(echo, {"inputs": window(8)}, headers={"Idempotency-Key": "slow"})
            ).status_code == 200


async def test_status_models_metrics_and_health(echo: httpx.AsyncClient) -> None:
    assert (await echo.get("/healthz")).json() == {"status": "ok"}
    assert (await echo.get("/readyz")).status_code == 200
    status = (await echo.get("/v1/status")).json()
    assert status["ready"] is True
    assert set(status["models"]["echo"]["depth"]) == {"critical", "normal", "sheddable"}
    assert status["models"]["echo"]["service_rate_items_per_s"] > 0
    assert status["models"]["echo"]["service_rate_cost_per_s"] >= \
        status["models"]["echo"]["service_rate_items_per_s"]  # an item costs a unit or more
    assert status["models"]["echo"]["queue_interval_ms"] >= 100.0  # the default, or more
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
        # critical: on a loaded test machine a slow first batch must not shed these
        answers = await asyncio.gather(*(post(client, {"inputs": window(n),
                                                       "priority": "critical"})
                                         for n in lengths))
        assert [len(outputs_of(answer)) for answer in answers] == lengths
        assert {len(row) for answer in answers for row in outputs_of(answer)} == {3}
        both = outputs_of(await post(client, {"instances": [window(2), window(9)],
                                              "priority": "critical"}))
        assert [len(rows) for rows in both] == [2, 9]
        metadata = (await client.get("/v2/models/per_step")).json()
        assert metadata["outputs"][0]["shape"] == [-1, -1, 3]


async def test_windows_shorter_than_a_user_module_takes_are_refused_and_the_rest_served(
) -> None:
    # An eager module at the defaults (a model process), with mixed lengths in flight.
    module = load_model("python:tests.models:patches")
    module.load("cpu")
    lengths = [8, 13, 100, 256, 40, 9]
    sent = [module.example(n).round(4) for n in lengths]
    async with in_process({"VEGA_MODEL": "python:tests.models:patches"}) as (client, runtime):
        assert runtime.served(None).batcher.config.buckets[0] >= 8
        answers = await asyncio.gather(
            *(post(client, {"inputs": w.tolist()}) for w in sent),
            post(client, {"inputs": window(3)}),
            post(client, {"instances": [window(8), window(7)]}))
        for window_sent, answer in zip(sent, answers):
            expected = module.run([module.decode(window_sent.tolist())[0]], len(window_sent))[0]
            np.testing.assert_allclose(outputs_of(answer), expected, rtol=1e-5, atol=1e-5)
        for refused, message in zip(answers[-2:], ("outside 8..256", "instance 1: window")):
            assert refused.status_code == 422 and error_of(refused) == "invalid_input"
            assert message in refused.json()["error"]["message"]
        tensor = {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 5, 8], "data": [0.5] * 40}
        v2 = await post(client, {"inputs": [tensor]}, "/v2/models/patches/infer")
        assert v2.status_code == 422 and "outside 8..256" in v2.text
        described = (await client.get("/v1/models")).json()["models"][0]
        assert (described["min_length"], described["max_length"]) == (8, 256)


async def test_a_nan_output_is_a_model_error_in_json_and_as_it_is_in_binary() -> None:
    # A user's module answers NaN for a window its scaling cannot take (a constant one):
    # JSON would carry it as null, which a caller may read as an answer.
    rising = [[float(step)] * 8 for step in range(6)]
    async with in_process({"VEGA_MODEL": "python:tests.models:spread_scaled"}) as (client, _):
        assert len(outputs_of(await post(client, {"inputs": rising}))) == 8
        for body in ({"inputs": window(6)}, {"instances": [rising, window(6)]}):
            answer = await post(client, body)
            assert answer.status_code == 500 and error_of(answer) == "model_error"
            assert "NaN" in answer.json()["error"]["message"]
        assert len(outputs_of(await post(client, {"instances": [rising, rising]}))) == 2
        v2 = "/v2/models/spread_scaled/infer"
        x = np.full((1, 6, 8), 0.5, np.float32)
        tensor = {"name": "INPUT__0", "datatype": "FP32", "shape": [1, 6, 8]}
        as_json = await post(client, {"inputs": [{**tensor, "data": x.ravel().tolist()}]}, v2)
        assert as_json.status_code == 500 and "model_error" in as_json.json()["error"]
        header = orjson.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": x.nbytes}}],
                               "parameters": {"binary_data_output": True}})
        as_binary = await client.post(v2, content=header + x.tobytes(), headers={
            "Inference-Header-Content-Length": str(len(header))})
        assert as_binary.status_code == 200
        length = int(as_binary.headers["inference-header-content-length"])
        assert np.isnan(np.frombuffer(as_binary.content[length:], np.float32)).all()


async def test_a_gzip_body_is_read_on_v1_as_on_v2(sensor: httpx.AsyncClient) -> None:
    body = orjson.dumps({"inputs": window(20)})
    plain = outputs_of(await post(sensor, body))
    packed = await post(sensor, gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert outputs_of(packed) == plain
    cut = await post(sensor, gzip.compress(body)[:-4], headers={"Content-Encoding": "gzip"})
    assert cut.status_code == 400 and error_of(cut) == "invalid_json"


async def test_a_request_whose_own_batches_outlast_the_interval_is_422_not_a_429(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 256 windows are 8 batches of 40 ms run one after another: the later ones would wait
    # past the interval in force and be shed at dispatch as a standing queue's, on an idle
    # server too, so a 429 would send its caller back to the same refusal for ever.
    monkeypatch.setenv("TEST_SLEEP_MS", "40")
    async with in_process({}, [echo_model("echo")]) as (client, runtime):
        interval_s = runtime.models["echo"].batcher.standing_after_s
        whole = await post(client, {"instances": [window(8)] * 256})
        assert whole.status_code == 422 and error_of(whole) == "invalid_input", whole.text
        assert "send fewer per request" in whole.json()["error"]["message"]
        assert "retry-after" not in whole.headers
        # Two batches: the second starts well within the interval, and is served.
        assert 40e-3 < interval_s
        fits = await post(client, {"instances": [window(8)] * 64})
        assert fits.status_code == 200, fits.text
        critical = await post(client, {"instances": [window(8)] * 256, "priority": "critical"})
        assert critical.status_code == 200, critical.text  # never shed at dispatch
