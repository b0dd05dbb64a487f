"""Hostile input, generated: always an answer from DESIGN.md's table, never a 5xx or a crash."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.hostile import SLOW, allowed, json_values
from tests.models import window
from tests.servers import VegaProcess

HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=80)

rows = st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(),
                          st.booleans(), st.none(), st.text(max_size=3)), min_size=0, max_size=10)
windows = st.lists(rows, min_size=0, max_size=40)


@pytest.fixture(scope="module")
def server(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module(VEGA_MODEL="python:tests.models:echo", VEGA_MAX_BODY_BYTES="100000")


@pytest.fixture(scope="module")
def client(server: VegaProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def check(client: httpx.Client, content: bytes, headers: dict[str, str] | None = None) -> None:
    response = client.post("/v1/infer", content=content, headers=headers)
    assert allowed(response.status_code, response.content), (response.status_code,
                                                              response.text[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["code"] and error["message"]



@SLOW
@given(body=json_values)
def test_any_json_value_is_refused_cleanly(client: httpx.Client, body: object) -> None:
    check(client, json.dumps(body).encode())  # json: integers of any size


@SLOW
@given(inputs=windows, priority=st.one_of(st.none(), json_values),
       deadline=st.one_of(st.none(), json_values, st.floats()))
def test_malformed_windows_priorities_and_deadlines(client: httpx.Client, inputs: object,
                                                   priority: object, deadline: object) -> None:
    doc: dict[str, object] = {"inputs": inputs}
    if priority is not None:
        doc["priority"] = priority
    if deadline is not None:
        doc["deadline_ms"] = deadline
    check(client, json.dumps(doc, allow_nan=True).encode())  # NaN/Infinity as raw tokens


@SLOW
@given(raw=st.binary(max_size=2000))
def test_arbitrary_bytes(client: httpx.Client, raw: bytes) -> None:
    check(client, raw)


@SLOW
@given(priority=HEADER_TEXT, deadline=HEADER_TEXT, request_id=HEADER_TEXT)
def test_arbitrary_headers(client: httpx.Client, priority: str, deadline: str,
                           request_id: str) -> None:
    check(client, orjson.dumps({"inputs": window(4)}), {
        "X-Vega-Priority": priority, "X-Vega-Deadline-Ms": deadline, "X-Request-Id": request_id})


@pytest.mark.parametrize("content", [
    b"[" * 200_000,  # nesting far past any parser's limit, under the size limit
    b'{"inputs": [' + b"[1e308,-1e308,0,0,0,0,0,0]," * 100 + b"[0,0,0,0,0,0,0,0]]}",
    b'{"inputs": [[' + b"9" * 5000 + b',0,0,0,0,0,0,0]]}',
    b'{"inputs": ' + b"[0.5, " * 3 + b"]",
    b'{"inputs": [[NaN,0,0,0,0,0,0,0]]}',
    b'{"inputs": [[1,2,3,4,5,6,7,8]], "deadline_ms": 1e400}',
    b'{"instances": [' + b'[[0,0,0,0,0,0,0,0]],' * 300 + b'[[0,0,0,0,0,0,0,0]]]}',
    "{\"inputs\": \"\udcff\"}".encode("utf-8", "surrogatepass"),
])
def test_known_nasty_bodies(client: httpx.Client, content: bytes) -> None:
    check(client, content)


def test_413_is_answered_without_reading_the_rest(server: VegaProcess) -> None:
    # Declared too long: refused from the headers, before a byte of the body is sent.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


def test_a_header_without_end_is_431_once_the_head_passes_64_kib(server: VegaProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 1 << 20:  # a megabyte of one header, a few kilobytes at a time
                sock.sendall(b"a" * 4096)
                sent += 4096
        except OSError:  # refused and closed: the rest could not be sent
            pass
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    assert b'"code":"headers_too_large"' in reply


@pytest.mark.parametrize("headers", [
    b"X-Big: " + b"a" * 70_000 + b"\r\n",  # one header, a whole head in one write
    b"".join(b"X-H%d: " % n + b"b" * 1000 + b"\r\n" for n in range(80)),  # many of them
])
def test_a_whole_request_with_a_head_over_64_kib_is_431(
        server: VegaProcess, headers: bytes) -> None:
    body = orjson.dumps({"inputs": window(8)})
    request = (b"POST /v1/infer HTTP/1.1\r\nHost: x\r\n" + headers
               + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    assert b'"code":"headers_too_large"' in reply


def test_a_head_over_64_kib_sent_in_two_reads_is_431(server: VegaProcess) -> None:
    # The read a request begins in counts too: it was dropped, and a head of 70 KB sent
    # as 70 KB then the rest was served.
    body = orjson.dumps({"inputs": window(8)})
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000)
        time.sleep(0.3)  # read on its own
        sock.sendall(b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]


def test_a_flood_of_what_is_not_http_is_logged_once_with_the_server_s_time(
        server: VegaProcess) -> None:
    # A TLS client or a scanner on the plain port: uvicorn warns once a connection.
    assert server.log_path is not None
    before = len(server.log_path.read_text(errors="replace"))
    for _ in range(40):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n")
            sock.recv(4096)
    time.sleep(0.3)
    flood = server.log_path.read_text(errors="replace")[before:]
    lines = [line for line in flood.splitlines() if "Invalid HTTP request" in line]
    assert len(lines) <= 1, lines[:3]  # once in REPEAT_EVERY_S, with a count after it
    written = [line for line in server.log_path.read_text(errors="replace").splitlines()
               if "Invalid HTTP request" in line]
    assert written and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING uvicorn.error: ",
                                written[0]), written[0]


def test_still_serving_after_all_that(client: httpx.Client, server: VegaProcess) -> None:
    assert client.post("/v1/infer", content=orjson.dumps({"inputs": window(8)})).status_code == 200
    # No hostile body reached the model and made it fail (labels are sorted, so match the
    # outcome label on its own, not next to the one before it).
    assert 'outcome="model_error"' not in client.get("/metrics").text
    assert server.proc is not None and server.proc.poll() is None
