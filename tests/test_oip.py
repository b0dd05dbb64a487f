"""The Open Inference Protocol (v2) routes, driven by Triton's own client against real servers.

The codec and the request parser are also checked in-process against a fake
model with two inputs (INT64 and BYTES), which no built-in model has.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from starlette.datastructures import Headers
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from tests.servers import VegaProcess, wait_until
from vega.config import load_settings
from vega.errors import VegaError
from vega.httpio import decompress
from vega.models import TensorSpec
from vega.oip.binary import from_binary, from_json, to_binary
from vega.oip.routes import parse_request, request_deadline_ms, request_priority
from vega.records import CRITICAL, NORMAL, SHEDDABLE


@pytest.fixture(scope="module")
def sensor(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module()


@pytest.fixture(scope="module")
def client(sensor: VegaProcess) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(f"127.0.0.1:{sensor.port}") as triton_client:
        yield triton_client


def windows(rows: int, length: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, length, 8)).astype(np.float32)


def v1_outputs(server: VegaProcess, x: np.ndarray) -> np.ndarray:
    response = httpx.post(server.url + "/v1/infer", timeout=30,
                          content=orjson.dumps({"instances": x.tolist()}))
    assert response.status_code == 200, response.text
    return np.asarray(response.json()["outputs"], dtype=np.float32)


def v2_infer(client: triton.InferenceServerClient, x: np.ndarray, binary: bool,
             **kwargs: Any) -> triton.InferResult:
    tensor = triton.InferInput("INPUT__0", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    wanted = [triton.InferRequestedOutput("OUTPUT__0", binary_data=binary)]
    return client.infer("sensor", [tensor], outputs=wanted, **kwargs)


def refusal(call: Callable[[], object]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


# -- a real server, Triton's client ------------------------------------------------


def test_live_ready_and_server_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("sensor")
    assert client.is_model_ready("sensor", "1")
    assert not client.is_model_ready("sensor", "2")
    assert not client.is_model_ready("no-such-model")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "vega"
    assert "binary_tensor_data" in metadata["extensions"]


def test_model_metadata_and_config(client: triton.InferenceServerClient) -> None:
    metadata = client.get_model_metadata("sensor")
    assert metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "INPUT__0", "datatype": "FP32",
                                   "shape": [-1, -1, 8]}]
    assert metadata["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_model_metadata("sensor", "1") == metadata
    assert refusal(lambda: client.get_model_metadata("sensor", "9")).status() == "404"
    config = client.get_model_config("sensor")
    assert config["max_batch_size"] == 32
    assert [t["name"] for t in config["input"]] == ["INPUT__0"]
    assert config["input"][0]["dims"] == [-1, 8]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert [t["name"] for t in config["output"]] == ["OUTPUT__0"]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 5000


def test_json_and_binary_infer_of_several_rows_equal_v1(
        sensor: VegaProcess, client: triton.InferenceServerClient) -> None:
    x = windows(3)
    expected = v1_outputs(sensor, x)
    as_json = v2_infer(client, x, binary=False, request_id="req-7")
    as_binary = v2_infer(client, x, binary=True)
    assert as_json.get_response()["id"] == "req-7"
    assert "data" in as_json.get_output("OUTPUT__0")
    assert "binary_data_size" in as_binary.get_output("OUTPUT__0")["parameters"]
    for result in (as_json, as_binary):
        out = result.as_numpy("OUTPUT__0")
        assert out.shape == (3, 4) and out.dtype == np.float32
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    # Rows come back in request order: each equals that window answered alone.
    for row in range(3):
        alone = v2_infer(client, x[row:row + 1], binary=True).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(alone[0], expected[row], rtol=1e-5, atol=1e-6)


def test_default_outputs_are_binary_and_gzip_bodies_are_read(
        client: triton.InferenceServerClient) -> None:
    x = windows(2, length=16, seed=1)
    tensor = triton.InferInput("INPUT__0", list(x.shape), "FP32").set_data_from_numpy(x)
    plain = client.infer("sensor", [tensor])  # no outputs named: all, binary
    assert "parameters" in plain.get_output("OUTPUT__0")
    packed = client.infer("sensor", [tensor], request_compression_algorithm="gzip")
    np.testing.assert_allclose(packed.as_numpy("OUTPUT__0"), plain.as_numpy("OUTPUT__0"),
                               rtol=1e-5, atol=1e-6)


def test_wrong_datatype_is_a_clear_error(client: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("INPUT__0", [1, 16, 8], "INT32")
    tensor.set_data_from_numpy(np.ones((1, 16, 8), dtype=np.int32))
    error = refusal(lambda: client.infer("sensor", [tensor]))
    assert error.status() == "422"
    assert "datatype INT32 does not match the model's FP32" in error.message()


def test_wrong_shape_is_a_clear_error(client: triton.InferenceServerClient) -> None:
    x = np.ones((2, 16, 7), dtype=np.float32)
    error = refusal(lambda: v2_infer(client, x, binary=True))
    assert error.status() == "422"
    assert "shape [2, 16, 7] does not match [-1, -1, 8]" in error.message()
    too_long = refusal(lambda: v2_infer(client, windows(1, length=600), binary=True))
    assert too_long.status() == "422" and "window length 600" in too_long.message()


def test_priority_level_maps_to_a_class(sensor: VegaProcess,
                                        client: triton.InferenceServerClient) -> None:
    v2_infer(client, windows(1), binary=True, priority=1)
    wanted = {'model="sensor"', 'priority="critical"', 'outcome="ok"'}
    counted = [line for line in httpx.get(sensor.url + "/metrics").text.splitlines()
               if line.startswith("vega_requests_total{")
               and wanted <= set(line.partition("{")[2].partition("}")[0].split(","))]
    assert counted and float(counted[0].rpartition(" ")[2]) >= 1


def test_statistics_count_what_was_served(client: triton.InferenceServerClient) -> None:
    before_ms = int(time.time() * 1000)
    v2_infer(client, windows(2), binary=True)
    (one,) = client.get_inference_statistics("sensor")["model_stats"]
    assert before_ms <= int(one["last_inference"]) <= time.time() * 1000  # epoch ms
    assert one["name"] == "sensor" and one["inference_stats"]["success"]["count"] >= 1
    assert one["inference_count"] >= 2 and one["execution_count"] >= 1
    assert one["inference_stats"]["compute_infer"]["ns"] > 0
    every = client.get_inference_statistics()["model_stats"]
    assert [stats["name"] for stats in every] == ["sensor"]


def test_timeout_in_microseconds_is_the_deadline(client: triton.InferenceServerClient) -> None:
    # 1 µs: past before the request is read (504), or shorter than its batch (422).
    error = refusal(lambda: v2_infer(client, windows(1), binary=True, timeout=1))
    assert error.status() in ("422", "504")
    assert "deadline" in error.message()


def test_raw_binary_body_without_content_type(sensor: VegaProcess) -> None:
    x = windows(2, length=32, seed=3)
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "shape": [2, 32, 8],
                                       "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    response = httpx.post(sensor.url + "/v2/models/sensor/infer", content=header + x.tobytes(),
                          headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200, response.text
    size = int(response.headers["inference-header-content-length"])
    doc = orjson.loads(response.content[:size])
    out = np.frombuffer(response.content[size:], dtype="<f4").reshape(doc["outputs"][0]["shape"])
    np.testing.assert_allclose(out, v1_outputs(sensor, x), rtol=1e-5, atol=1e-6)
    short = httpx.post(sensor.url + "/v2/models/sensor/infer", content=header + x.tobytes()[:-4],
                       headers={"Inference-Header-Content-Length": str(len(header))})
    assert short.status_code == 422 and set(short.json()) == {"error"}


def test_overloaded_server_answers_429_through_the_client(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="1000",
                  VEGA_LENGTH_BUCKETS="512", VEGA_MAX_BATCH_SIZE="1",
                  VEGA_MAX_INFLIGHT_BATCHES="1", VEGA_QUEUE_CAPACITY="4",
                  VEGA_DEFAULT_DEADLINE_MS="20000")
    body = orjson.dumps({"instances": [[[0.5] * 8]], "priority": "critical"})

    def depth() -> int:
        status = httpx.get(server.url + "/v1/status").json()
        return int(sum(status["models"]["echo"]["depth"].values()))

    with ThreadPoolExecutor(6) as pool, \
            triton.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        for _ in range(6):  # critical may fill the whole queue
            pool.submit(httpx.post, server.url + "/v1/infer", content=body, timeout=30)
        wait_until(lambda: depth() >= 3, 10, "a full queue")
        x = np.full((1, 8, 8), 0.5, dtype=np.float32)
        tensor = triton.InferInput("INPUT__0", [1, 8, 8], "FP32").set_data_from_numpy(x)
        normal = refusal(lambda: client.infer("echo", [tensor]))
        sheddable = refusal(lambda: client.infer("echo", [tensor], priority=3))
        raw = httpx.post(server.url + "/v2/models/echo/infer",
                         content=orjson.dumps({"inputs": [{"name": "INPUT__0", "shape": [1, 1, 8],
                                                           "datatype": "FP32",
                                                           "data": [0.5] * 8}]}))
    assert normal.status() == "429" and normal.message().startswith("queue_full")
    assert sheddable.status() == "429" and sheddable.message().startswith("shed")
    assert raw.status_code == 429 and int(raw.headers["retry-after"]) >= 1
    assert set(raw.json()) == {"error"}


# -- in-process: the codec and the request parser ------------------------------------


class TwoInputs:
    """Metadata of a model taking ids (INT64, variable length) and one tag (BYTES)."""

    name, version = "pair", "1"
    inputs = (TensorSpec("ids", "INT64", (-1,)), TensorSpec("tag", "BYTES", (1,)))
    outputs = (TensorSpec("score", "FP32", (1,)),)


def parse(doc: dict[str, Any], binary: bytes = b"", **headers: str) -> Any:
    header = orjson.dumps(doc)
    if binary:
        headers["Inference-Header-Content-Length"] = str(len(header))
    return parse_request(header + binary, Headers(headers), TwoInputs(),  # type: ignore[arg-type]
                         load_settings(environ={}))


def test_rows_of_several_inputs_from_json_and_binary() -> None:
    ids = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    tags = np.array([[b"a"], [b"\x00bc"]], dtype=object)
    raw_tags = serialize_byte_tensor(tags).item()
    from_bytes = parse({"inputs": [
        {"name": "ids", "shape": [2, 3], "datatype": "INT64",
         "parameters": {"binary_data_size": ids.nbytes}},
        {"name": "tag", "shape": [2, 1], "datatype": "BYTES",
         "parameters": {"binary_data_size": len(raw_tags)}}]}, ids.tobytes() + raw_tags)
    from_text = parse({"inputs": [
        {"name": "ids", "shape": [2, 3], "datatype": "INT64", "data": [[1, 2, 3], [4, 5, 6]]},
        {"name": "tag", "shape": [2, 1], "datatype": "BYTES", "data": ["a", "\x00bc"]}]})
    for request in (from_bytes, from_text):
        assert [row["ids"].tolist() for row in request.instances] == [[1, 2, 3], [4, 5, 6]]
        assert [row["tag"].tolist() for row in request.instances] == [[b"a"], [b"\x00bc"]]
        assert [(spec.name, binary) for spec, binary in request.outputs] == [("score", False)]


def test_an_empty_outputs_list_asks_for_every_output() -> None:
    # As when it is left out (Triton's rule), not an answer with no outputs after a model run.
    inputs = [{"name": "ids", "shape": [1, 1], "datatype": "INT64", "data": [1]},
              {"name": "tag", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}]
    for binary in (False, True):
        request = parse({"inputs": inputs, "outputs": [],
                         "parameters": {"binary_data_output": binary}})
        assert [(spec.name, flag) for spec, flag in request.outputs] == [("score", binary)]


@pytest.mark.parametrize("doc, message", [
    ({"inputs": [{"name": "ids", "shape": [1, 2], "datatype": "INT64", "data": [1.5, 2]}]},
     "not INT64 values"),
    ({"inputs": [{"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2]}]},
     "data has 2 elements, shape [1, 3] needs 3"),
    ({"inputs": [{"name": "ids", "shape": [1, 1], "datatype": "INT32", "data": [1]}]},
     "datatype INT32 does not match"),
    ({"inputs": [{"name": "ids", "shape": [1, 1], "datatype": "BF16", "data": [1]}]},
     "datatype 'BF16' is not supported"),
    ({"inputs": [{"name": "ids", "shape": [1, 1], "datatype": "INT64", "data": [1]}]},
     "missing input(s): tag"),
    ({"inputs": [{"name": "other", "shape": [1], "datatype": "INT64", "data": [1]}]},
     "not an input of model 'pair'"),
    ({"inputs": [], "extra": 1}, "unknown field(s): extra"),
    ({"inputs": [{"name": "ids", "shape": [1, 1], "datatype": "INT64", "data": [1],
                  "parameters": {"binary_data_size": 0}}]},
     "give 'data' or parameters.binary_data_size, not both"),
    ({"inputs": [{"name": "ids", "shape": [1, 1], "datatype": "INT64", "data": [1]},
                 {"name": "tag", "shape": [1, 1], "datatype": "BYTES", "data": ["a"]}],
      "outputs": [{"name": "score"}, {"name": "score"}]}, "output 'score': asked for twice"),
    ({"id": "a" * 257, "inputs": []}, "'id' must be a string of at most 256"),  # echoed back
    ({"inputs": [{"name": "ids", "shape": [1, 1], "datatype": "INT64", "data": [1],
                  "parameters": {"shared_memory_region": "r",
                                 "shared_memory_byte_size": 8}}]},
     "input ids: 'shared_memory_region' is not supported by Vega"),  # not the data instead
    ({"inputs": [[1, 2]]}, "inputs[0] must be an object with a 'name' (one of ids, tag)"),
    ({"inputs": [{"shape": [1, 1], "datatype": "INT64", "data": [1]}]},
     "inputs[0] must be an object with a 'name'"),
])
def test_bad_requests_name_what_is_wrong(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(VegaError) as caught:
        parse(doc)
    assert caught.value.status == 422 and message in caught.value.message


def test_binary_codec_round_trips_each_datatype() -> None:
    cases = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT32": np.int32,
             "INT64": np.int64, "BOOL": np.bool_}
    for datatype, dtype in cases.items():
        array: np.ndarray = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
        raw = to_binary(array, datatype)
        assert raw == array.astype(array.dtype.newbyteorder("<")).tobytes()
        back = from_binary(datatype, [2, 3], memoryview(raw), "t")
        assert back.dtype == dtype and np.array_equal(back, array)
        assert np.array_equal(from_json(datatype, [2, 3], array.tolist(), "t"), array)
    words = np.array([b"", b"hello", "é".encode()], dtype=object)
    raw = to_binary(words, "BYTES")
    assert raw == serialize_byte_tensor(words).item()
    assert from_binary("BYTES", [3], memoryview(raw), "t").tolist() == words.tolist()
    with pytest.raises(VegaError, match="runs past the data"):
        from_binary("BYTES", [3], memoryview(raw[:-1]), "t")
    with pytest.raises(VegaError, match="cannot hold"):
        from_binary("BYTES", [10**12], memoryview(raw), "t")
    with pytest.raises(VegaError, match="out of range for INT32"):
        from_json("INT32", [1], [2**40], "t")


def test_priority_and_deadline_rules() -> None:
    settings = load_settings(environ={"VEGA_MAX_DEADLINE_MS": "5000"})
    assert [request_priority(level, None) for level in (None, 0, 1, 2, 3, 9)] == [
        NORMAL, NORMAL, CRITICAL, NORMAL, SHEDDABLE, SHEDDABLE]
    assert request_priority(0, "sheddable") == SHEDDABLE
    assert request_priority("critical", "sheddable") == CRITICAL
    with pytest.raises(VegaError):
        request_priority(-1, None)
    assert request_deadline_ms({"timeout": 250_000}, None, settings) == 250
    assert request_deadline_ms({"timeout": 250_000, "deadline_ms": 100}, "9", settings) == 100
    assert request_deadline_ms({"timeout": 0}, "40", settings) == 40
    assert request_deadline_ms({}, None, settings) == settings.default_deadline_ms
    assert request_deadline_ms({"timeout": 10**12}, None, settings) == 5000


def test_a_compressed_body_is_read_only_whole() -> None:
    doc = b'{"inputs": []}'
    packed = gzip.compress(doc)
    assert decompress(packed, "gzip", 1000) == doc
    for broken in (packed[:-4], packed + b"{}", packed + gzip.compress(b"{}")):
        with pytest.raises(VegaError, match="not one whole gzip stream") as caught:
            decompress(broken, "gzip", 1000)
        assert caught.value.status == 400
    with pytest.raises(VegaError) as caught:
        decompress(packed, "gzip", 5)
    assert caught.value.code == "payload_too_large"
