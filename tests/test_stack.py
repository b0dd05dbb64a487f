"""The request stack (vega.stack) in this process: every protocol gets every layer, and
the guard answers and counts whatever a layer raises."""

from __future__ import annotations

import asyncio
import gzip
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Message

from tests.inproc import app_in_process, in_process
from tests.models import echo, forwarded, window
from vega.httpio import HotRequest, IndexedHeaders, scanned_priority
from vega.pressure.cache import ResponseCache
from vega.records import PRIORITY_NAMES
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

    def counted(self, outcome: str, priority: str | None = None) -> float:
        total = 0.0
        for metric in self.runtime.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels["outcome"] == outcome \
                        and priority in (None, sample.labels["priority"]):
                    total += sample.value
        return total


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    model = echo("echo")
    async with in_process({"VEGA_CACHE_BYTES": "1000000"}, [model]) as (client, runtime):
        log = tmp_path / "forward.log"
        model.module.forward_log = str(log)  # count forward passes from here on
        yield Served(client, runtime, log)


class Gated:
    """A module that runs only once ``gate`` is set: its queue stays as the test filled it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def __call__(self, *args: Any) -> Any:
        assert self.gate.wait(30)
        return self.inner(*args)


async def test_a_critical_request_refused_before_its_body_is_read_counts_as_critical() -> None:
    # The class only in the body; the queue full even for critical, so the request is
    # refused before its body is read: it still counts as critical (VegaCriticalRefused
    # reads that label), not as the header's default.
    model = echo("echo")
    env = {"VEGA_EXECUTOR": "thread", "VEGA_QUEUE_CAPACITY": "2", "VEGA_MAX_BATCH_SIZE": "1",
           "VEGA_MAX_INFLIGHT_BATCHES": "1", "VEGA_CODEL_INTERVAL_MS": "60000",
           "VEGA_DEFAULT_DEADLINE_MS": "30000"}
    async with in_process(env, [model]) as (client, runtime):
        gated = Gated(model.module)
        model.module = gated
        body = orjson.dumps({"inputs": window(16), "priority": "critical"})
        batcher = runtime.models["echo"].batcher
        admitted = []
        for running, queued in ((1, 0), (1, 1), (1, 2)):  # then the queue is at its bound
            admitted.append(asyncio.ensure_future(client.post("/v1/infer", content=body)))
            for _ in range(500):
                if (batcher.inflight, batcher.depth()) == (running, queued):
                    break
                await asyncio.sleep(0.01)
        refused = [await client.post("/v1/infer", content=body) for _ in range(5)]
        gated.gate.set()
        assert [r.status_code for r in await asyncio.gather(*admitted)] == [200] * 3
    assert [r.json()["error"]["code"] for r in refused] == ["queue_full"] * 5
    counted = {s.labels["priority"]: s.value for m in runtime.metrics.rejections.collect()
               for s in m.samples if s.name.endswith("_total")}
    assert counted == {"critical": 5.0}


async def test_a_503_is_counted_not_logged(served: Served, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    # A burst or a stop answers thousands of 503s (and 504s) a second: a log line each
    # would flood the journal.
    path, body = PATHS["v1"]
    monkeypatch.setattr(served.runtime, "draining", True)
    with caplog.at_level(logging.INFO, logger="vega"):
        assert (await served.client.post(path, content=body)).status_code == 503
    assert served.counted("draining") == 1
    assert not caplog.records


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


async def test_a_body_nested_past_what_a_cache_key_can_write_gets_the_model_s_422(
        served: Served) -> None:
    # orjson parses deeper nesting (1024 levels) than it writes (254): keyed, it was a 500.
    deep = b'{"inputs": ' + b"[" * 300 + b"]" * 300 + b"}"
    response = await served.client.post(PATHS["v1"][0], content=deep)
    assert response.status_code == 422, response.text
    assert "x-vega-cache" not in response.headers  # not looked up, not stored
    assert served.counted("internal_error") == 0


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


@pytest.mark.parametrize("body, header, claimed", [
    (b'{"inputs": [[1.0]], "priority": "sheddable"}', None, "sheddable"),
    (b'{"priority" :\n "Critical ", "inputs": [[1.0]]}', "sheddable", "critical"),  # body wins
    (b'{"inputs": [[1.0]]}', None, "normal"),
    (b'{"inputs": [[1.0]]}', "sheddable", "sheddable"),
    (b'{"inputs": [[1.0]]}', "urgent", None),  # the parse refuses it
    (b'{"inputs": [[1.0]], "priority": "urgent"}', None, None),
    (b'{"inputs": [[1.0]], "priority": 2}', None, None),
    (b'{"inputs": [[1.0]], "priority": "normal", "priority": "critical"}', None, None),
    (b'{"inputs": [[1.0]], "id": {"priority": "sheddable"}}', None, None),  # not top-level
    (b'{"inputs": [[1.0]], "id": "{", "priority": "sheddable"}', None, None),
    (b'{"inputs": [[1.0]], "id": "priority"}', None, None),  # a value, not a key
    (b'{"inputs": [[1.0]], "\\u0070riority": "sheddable"}', None, None),  # an escaped key
])
def test_the_class_a_v1_body_names_is_read_without_parsing_it(
        body: bytes, header: str | None, claimed: str | None) -> None:
    assert orjson.loads(body)  # each is JSON that the parse would read
    found = scanned_priority(body, header)
    assert (None if found is None else PRIORITY_NAMES[found]) == claimed


@pytest.mark.parametrize("raw", [
    [],
    [(b"host", b"vega"), (b"x-vega-priority", b"critical"), (b"content-length", b"12")],
    [(b"idempotency-key", b"first"), (b"accept", b"*/*"), (b"idempotency-key", b"second")],
    [(b"prefer", b"respond-async, wait=5"), (b"x-caf\xe9", b"cr\xe8me"), (b"prefer", b"")],
])
def test_indexed_headers_answer_as_starlette_s_do(raw: list[tuple[bytes, bytes]]) -> None:
    """The hot path's header lookups: same value (the first of a repeated name), same
    absence, any case of the name asked for."""
    indexed, plain = IndexedHeaders({"headers": list(raw)}), Headers(raw=list(raw))
    names = {key.decode("latin-1") for key, _ in raw} | {"idempotency-key", "x-vega-deadline-ms"}
    for name in names | {name.upper() for name in names}:
        assert (name in indexed) == (name in plain)
        assert indexed.get(name) == plain.get(name)
        assert indexed.get(name, "none") == plain.get(name, "none")
        if name in plain:
            assert indexed[name] == plain[name]
        else:
            with pytest.raises(KeyError):
                indexed[name]
    assert indexed.getlist("prefer") == plain.getlist("prefer")
    assert indexed.items() == plain.items()


def test_the_hot_request_reads_its_headers_from_the_index() -> None:
    """``HotRequest.headers`` is the index built once, the same object on every read."""
    scope = {"type": "http", "headers": [(b"x-vega-priority", b"critical")]}

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    async def send(message: Message) -> None:
        del message

    request = HotRequest(scope, receive, send)
    assert isinstance(request.headers, IndexedHeaders)
    assert request.headers is request.headers
    assert request.headers.get("X-Vega-Priority") == "critical"
    assert Request(scope).headers.get("x-vega-priority") == "critical"  # Starlette's own


@pytest.fixture
async def crowded(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
                  ) -> AsyncIterator[Served]:
    """Room for critical items only: two queued behind one running (0.6 s a batch);
    settings of the test's own as its parameter, if any."""
    monkeypatch.setenv("TEST_SLEEP_MS", "600")
    model = echo("echo")
    env = {"VEGA_QUEUE_CAPACITY": "4", "VEGA_NORMAL_WATERMARK": "0.5",
           "VEGA_SHED_WATERMARK": "0.25", "VEGA_MAX_BATCH_SIZE": "1",
           "VEGA_MAX_INFLIGHT_BATCHES": "1", "VEGA_WARMUP_BATCHES": "0",
           **getattr(request, "param", {})}
    async with in_process(env, [model]) as (client, runtime):
        fills = [asyncio.create_task(client.post("/v1/infer", content=orjson.dumps(
            {"inputs": window(8), "priority": "critical", "deadline_ms": 10000})))
            for _ in range(3)]
        batcher = runtime.models["echo"].batcher
        while batcher.depth() < 2:
            await asyncio.sleep(0.01)
        yield Served(client, runtime, Path())
        assert all(r.status_code == 200 for r in await asyncio.gather(*fills))


# Cut short: the parse would answer 400 invalid_json; refused for load first, it is never parsed.
TRUNCATED = b'{"priority": "%s", "inputs": [[0.5, 0.5'


@pytest.mark.parametrize("priority, code", [("normal", "queue_full"), ("sheddable", "shed")])
async def test_load_refuses_a_body_for_the_class_it_names_before_parsing_it(
        crowded: Served, priority: str, code: str) -> None:
    refused = await crowded.client.post("/v1/infer", content=TRUNCATED % priority.encode())
    assert refused.status_code == 429 and refused.json()["error"]["code"] == code
    assert "retry-after" in refused.headers
    assert crowded.counted(code, priority) == 1  # under the class the body named


async def test_a_body_that_names_no_class_is_refused_for_its_header_s_class(
        crowded: Served) -> None:
    refused = await crowded.client.post("/v1/infer", content=b'{"inputs": [[0.5',
                                        headers={"X-Vega-Priority": "sheddable"})
    assert refused.json()["error"]["code"] == "shed"
    assert crowded.counted("shed", "sheddable") == 1


@pytest.mark.parametrize("header", ["normal", "sheddable"])
async def test_the_body_s_class_wins_over_the_header_s_under_load(
        crowded: Served, header: str) -> None:
    # Critical still has room: the body is parsed, as a request of that class would be.
    response = await crowded.client.post("/v1/infer", content=TRUNCATED % b"critical",
                                         headers={"X-Vega-Priority": header})
    assert response.json()["error"]["code"] == "invalid_json"


def gzipped_scannable(doc: dict[str, Any]) -> bytes:
    """``doc`` gzip'd, varied until its compressed bytes hold one '{' and no backslash:
    bytes a scan for the class would read as a body that names none."""
    for step in range(10_000):
        packed = gzip.compress(orjson.dumps({**doc, "id": str(step)}), mtime=0)
        if packed.count(b"{") == 1 and b"\\" not in packed:
            return packed
    raise AssertionError("no such body")


async def test_a_compressed_body_s_class_is_read_from_its_text(crowded: Served) -> None:
    # Scanned as it came, compressed, it named no class: refused as normal, though critical.
    body = gzipped_scannable({"inputs": window(8), "priority": "critical",
                              "deadline_ms": 10000})
    response = await crowded.client.post("/v1/infer", content=body,
                                         headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200, response.text
    assert crowded.counted("queue_full") == 0


async def test_a_body_that_may_get_in_or_be_answered_without_the_model_is_parsed(
        crowded: Served) -> None:
    room = await crowded.client.post("/v1/infer", content=TRUNCATED % b"critical")
    # An Idempotency-Key's replay needs no room in the queue.
    keyed = await crowded.client.post("/v1/infer", content=TRUNCATED % b"normal",
                                      headers={"Idempotency-Key": "k1"})
    assert [room.json()["error"]["code"], keyed.json()["error"]["code"]] == ["invalid_json"] * 2


@pytest.mark.parametrize("crowded", [{"VEGA_CACHE_BYTES": "1000000"}], indirect=True)
async def test_a_body_a_cached_answer_may_answer_is_parsed_under_load(crowded: Served) -> None:
    for headers in ({}, {"X-Vega-Priority": "normal"}):  # nor refused unread by its header
        response = await crowded.client.post("/v1/infer", content=TRUNCATED % b"normal",
                                             headers=headers)
        assert response.json()["error"]["code"] == "invalid_json"
