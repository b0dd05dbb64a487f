"""The request stack (vega.stack) in this process: every protocol gets every layer, and
the guard answers and counts whatever a layer raises."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Message

from tests.inproc import app_in_process, in_process
from tests.models import echo, forwarded, window
from vega.pressure.cache import ResponseCache
from vega.runtime import Runtime

V1 = orjson.dumps({"inputs": window(8)})
V2 = orjson.dumps({"inputs": [{"name": "INPUT__0", "shape": [1, 8, 8], "datatype": "FP32",
                               "data": [0.5] * 64}]})
V2_BINARY_OUT = orjson.dumps({"inputs": [{"name": "INPUT__0", "shape": [1, 8, 8],
                                          "datatype": "FP32", "data": [0.5] * 64}],
                              "outputs": [{"name": "OUTPUT__0",
                                           "parameters": {"binary_data": True}}]})
PATHS = {"v1": ("/v1/infer", V1), "v2": ("/v2/models/echo/infer", V2)}


class Served:
    def __init__(self, client: httpx.AsyncClient, runtime: Runtime, log: Path) -> None:
        self.client = client
        self.runtime = runtime
        self.log = log

    def forwarded(self) -> int:
        return forwarded(str(self.log))

    def counted(self, outcome: str) -> float:
        total = 0.0
        for metric in self.runtime.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels["outcome"] == outcome:
                    total += sample.value
        return total


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    model = echo("echo")
    async with in_process({"VEGA_CACHE_BYTES": "1000000"}, [model]) as (client, runtime):
        log = tmp_path / "forward.log"
        model.module.forward_log = str(log)  # count forward passes from here on
        yield Served(client, runtime, log)


@pytest.mark.parametrize("protocol", ["v1", "v2"])
async def test_a_layer_that_raises_gets_a_counted_json_500(
        served: Served, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path, body = PATHS[protocol]

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug in the cache")

    monkeypatch.setattr(ResponseCache, "put", broken)
    response = await served.client.post(path, content=body)
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    if protocol == "v1":
        assert error["code"] == "internal_error" and "a bug" not in error["message"]
    else:
        assert error.startswith("internal_error:")
    assert served.counted("internal_error") == 1
    assert served.runtime.ready  # the process goes on serving
    monkeypatch.undo()
    assert (await served.client.post(path, content=body)).status_code == 200


@pytest.mark.parametrize("protocol", ["v1", "v2"])
async def test_cache_serves_both_protocols_the_same_bytes(served: Served, protocol: str) -> None:
    path, body = PATHS[protocol]
    first = await served.client.post(path, content=body)
    again = await served.client.post(path, content=body)
    assert first.status_code == again.status_code == 200
    assert first.headers["x-vega-cache"] == "miss" and again.headers["x-vega-cache"] == "hit"
    assert again.content == first.content
    assert served.forwarded() == 1  # the second answer came from the cache


async def test_v1_and_v2_answers_do_not_share_a_cache_entry(served: Served) -> None:
    v1 = await served.client.post(PATHS["v1"][0], content=V1)
    v2 = await served.client.post(PATHS["v2"][0], content=V2)
    assert v1.headers["x-vega-cache"] == v2.headers["x-vega-cache"] == "miss"
    assert "model_name" in v2.json() and "model" in v1.json()


async def test_binary_v2_answers_are_cached_whole(served: Served) -> None:
    first = await served.client.post(PATHS["v2"][0], content=V2_BINARY_OUT)
    again = await served.client.post(PATHS["v2"][0], content=V2_BINARY_OUT)
    assert first.headers["content-type"] == "application/octet-stream"
    assert again.headers["x-vega-cache"] == "hit" and again.content == first.content
    assert again.headers["inference-header-content-length"] == \
        first.headers["inference-header-content-length"]


@pytest.mark.parametrize("protocol", ["v1", "v2"])
async def test_idempotency_keys_work_on_both_protocols(served: Served, protocol: str) -> None:
    path, body = PATHS[protocol]
    keyed = {"Idempotency-Key": f"order-{protocol}", "Cache-Control": "no-store"}
    first = await served.client.post(path, content=body, headers=keyed)
    again = await served.client.post(path, content=body, headers=keyed)
    assert first.status_code == again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert served.forwarded() == 1
    other = body.replace(b"0.5", b"0.25")
    conflict = await served.client.post(path, content=other, headers=keyed)
    assert conflict.status_code == 422
    malformed = await served.client.post(path, content=body,
                                         headers={"Idempotency-Key": "has space"})
    assert malformed.status_code == 422


async def test_a_caller_that_hangs_up_while_sending_its_body_is_counted_as_gone() -> None:
    messages: Iterator[Message] = iter([
        {"type": "http.request", "body": V1[:10], "more_body": True}, {"type": "http.disconnect"}])

    async def receive() -> Message:
        return next(messages)

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/infer", "raw_path": b"/v1/infer",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "headers": [(b"content-type", b"application/json")]}
    async with app_in_process({}, [echo("echo")]) as (app, runtime):
        await app(scope, receive, send)
    outcomes = {sample.labels["outcome"]: sample.value
                for metric in runtime.metrics.requests.collect() for sample in metric.samples
                if sample.name.endswith("_total")}
    assert outcomes == {"disconnected": 1.0}  # not an internal error
    assert sent[0]["status"] == 499
