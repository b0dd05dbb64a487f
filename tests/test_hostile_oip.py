"""Hostile Open Inference Protocol bodies, generated: binary headers that lie, truncated
tensors, wrong shapes and types. Always a 4xx in the protocol's shape, never a 5xx, and
callers sending good requests meanwhile are still answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.hostile import SLOW, allowed, json_values
from tests.servers import VegaProcess

PATH = "/v2/models/echo/infer"
DATATYPES = st.sampled_from(["FP32", "FP64", "FP16", "INT32", "INT64", "BOOL", "BYTES", "fp32",
                             "", "FP8", "UINT8"])
SHAPES = st.lists(st.integers(min_value=-3, max_value=600), min_size=0, max_size=4)


@pytest.fixture(scope="module")
def server(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module(VEGA_MODEL="python:tests.models:echo", VEGA_MAX_BODY_BYTES="200000")


@pytest.fixture(scope="module")
def client(server: VegaProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


Headers = dict[str, str] | dict[bytes, bytes]


def check(client: httpx.Client, content: bytes, headers: Headers) -> None:
    response = client.post(PATH, content=content, headers=headers)
    assert allowed(response.status_code, response.content), (response.status_code,
                                                              response.text[:300])
    if response.status_code != 200 and response.headers.get("content-type", "").startswith(
            "application/json"):
        assert isinstance(response.json()["error"], str)


def binary_body(header: dict[str, object], raw: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + raw, len(head)


@SLOW
@given(datatype=DATATYPES, shape=SHAPES, declared=st.integers(min_value=-10, max_value=10**6),
       raw=st.binary(max_size=3000), header_lie=st.integers(min_value=-50, max_value=50))
def test_binary_bodies_that_lie(client: httpx.Client, datatype: str, shape: list[int],
                                declared: int, raw: bytes, header_lie: int) -> None:
    body, head_length = binary_body({"inputs": [{
        "name": "INPUT__0", "datatype": datatype, "shape": shape,
        "parameters": {"binary_data_size": declared}}]}, raw)
    check(client, body, {"Inference-Header-Content-Length": str(head_length + header_lie)})


@SLOW
@given(rows=st.integers(min_value=0, max_value=4), length=st.integers(min_value=0, max_value=40),
       cut=st.integers(min_value=0, max_value=64))
def test_truncated_tensors(client: httpx.Client, rows: int, length: int, cut: int) -> None:
    x = np.ones((rows, length, 8), dtype=np.float32).tobytes()
    raw = x[:max(0, len(x) - cut)]
    body, head_length = binary_body({"inputs": [{
        "name": "INPUT__0", "datatype": "FP32", "shape": [rows, length, 8],
        "parameters": {"binary_data_size": len(x)}}]}, raw)
    check(client, body, {"Inference-Header-Content-Length": str(head_length)})


@SLOW
@given(inputs=json_values, parameters=json_values, outputs=json_values)
def test_any_json_request(client: httpx.Client, inputs: object, parameters: object,
                          outputs: object) -> None:
    doc = {"inputs": inputs, "parameters": parameters, "outputs": outputs}
    check(client, json.dumps(doc).encode(), {})


@pytest.mark.parametrize("headers", [
    {"Inference-Header-Content-Length": "abc"},
    {"Inference-Header-Content-Length": "-1"},
    {"Inference-Header-Content-Length": "99999999999999999999"},
    {b"Inference-Header-Content-Length": b"\xb2"},  # latin-1 for a digit to str.isdigit
    {"Content-Encoding": "gzip"},
    {"Content-Encoding": "br"},
])
def test_lying_transport_headers(client: httpx.Client, headers: Headers) -> None:
    check(client, b'{"inputs": []}' + b"\x00" * 64, headers)


async def test_good_callers_are_served_during_a_hostile_flood(server: VegaProcess) -> None:
    good = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4, 8],
                        "data": [0.5] * 32}]}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        async def hostile() -> int:
            response = await client.post(PATH, content=b"{" * 5000 + b"\xff" * 1000,
                                         headers={"Inference-Header-Content-Length": "3"})
            return response.status_code

        async def friendly() -> int:
            return (await client.post(PATH, json=good)).status_code

        statuses = await asyncio.gather(*([hostile() for _ in range(200)] +
                                          [friendly() for _ in range(20)]))
    assert set(statuses[:200]) <= {400, 422}, set(statuses[:200])
    assert statuses[200:] == [200] * 20
