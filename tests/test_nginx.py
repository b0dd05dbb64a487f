"""What a caller gets through the repository's nginx.conf when a Vega process behind it
fails: stand-in processes that read a request and die, or answer and count, and real ones."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from tests.infra import Nginx, require
from tests.models import window
from tests.servers import VegaProcess, free_port
from tests.test_cluster import CLUSTER_ENV, warming_process
from vega.lab.cluster import render_nginx

pytestmark = pytest.mark.slow

ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n"
          b'{"outputs": []}')


class StandIn:
    """A process on a free port that reads each request whole, then answers 200, hangs up
    without a word (as one killed while running it would: ``dies``), or says nothing until
    Nginx hangs up (as one frozen would: ``hangs``); ``read`` counts them."""

    def __init__(self, dies: bool, hangs: bool = False) -> None:
        self.dies = dies
        self.hangs = hangs
        self.read = 0
        self.port = 0
        self.handlers: set[asyncio.Task[None]] = set()  # Nginx keeps connections open

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.read += 1
                if self.dies:
                    writer.transport.abort()
                    return
                if self.hangs:
                    await reader.read()  # until Nginx gives up on it
                    return
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@asynccontextmanager
async def stand_ins(*dies: bool, hangs: bool = False) -> AsyncIterator[list[StandIn]]:
    made = [StandIn(d, hangs) for d in dies]
    servers = [await asyncio.start_server(s.serve, "127.0.0.1", 0) for s in made]
    for stand_in, server in zip(made, servers):
        stand_in.port = server.sockets[0].getsockname()[1]
    try:
        yield made
    finally:
        for server in servers:
            server.close()
        handlers = [task for stand_in in made for task in stand_in.handlers]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


async def test_an_inline_request_a_process_read_and_died_on_is_not_run_again(
        nginx: Callable[[Sequence[str]], Nginx]) -> None:
    """A process that dies after reading an inline request may have run it (an input that
    crashes its model would take a second process down): Nginx answers 502 process_lost
    rather than send it to another. Each request reaches one process, once."""
    async with stand_ins(True, False) as (dying, live):
        proxy = nginx([f"127.0.0.1:{dying.port}", f"127.0.0.1:{live.port}"])
        paths = ["/v1/infer"] * 6 + ["/v2/models/echo/infer"] * 2
        async with httpx.AsyncClient(timeout=30) as client:
            answers = [await client.post(proxy.url + path, json={"inputs": window(2)})
                       for path in paths]
    assert dying.read >= 1  # least_conn sent it the first request
    assert dying.read + live.read == len(answers), (dying.read, live.read)
    lost = [(path, a) for path, a in zip(paths, answers) if a.status_code != 200]
    assert len(lost) == dying.read
    for path, answer in lost:
        assert answer.status_code == 502 and "retry-after" not in answer.headers
        error = answer.json()["error"]
        code = error["code"] if path.startswith("/v1/") else error.split(":")[0]
        assert code == "process_lost", answer.text


async def test_a_request_that_reached_no_process_is_sent_to_another(
        nginx: Callable[[Sequence[str]], Nginx]) -> None:
    """A process gone while idle (nothing listens): its connect fails, nothing was sent,
    so the request, a POST too, goes to the other process at once."""
    async with stand_ins(False) as (live,):
        proxy = nginx([f"127.0.0.1:{free_port()}", f"127.0.0.1:{live.port}"])
        async with httpx.AsyncClient(timeout=30) as client:
            codes = Counter([(await client.post(proxy.url + path, json={
                "inputs": window(2)})).status_code
                for path in ["/v1/infer"] * 4 + ["/v2/models/echo/infer"] * 2])
    assert codes == Counter({200: 6}) and live.read == 6


async def test_inline_requests_move_off_a_warming_process(
        vega: Callable[..., VegaProcess], nginx: Callable[[Sequence[str]], Nginx]) -> None:
    """A process warming up answers 503 not_ready (refused before any work): Nginx sends
    the inline POST to the ready one, so no caller sees that 503."""
    warming = await warming_process(vega)
    ready = vega(**CLUSTER_ENV)
    proxy = nginx([f"127.0.0.1:{warming.port}", f"127.0.0.1:{ready.port}"])
    async with httpx.AsyncClient(timeout=30) as client:
        codes = Counter([(await client.post(proxy.url + "/v1/infer", json={
            "inputs": window(2)})).status_code for _ in range(8)])
    assert codes == Counter({200: 8}), codes


async def test_a_process_that_read_a_request_and_froze_gets_a_json_504_from_nginx(
        tmp_path: Path) -> None:
    """A process frozen (SIGSTOP) or hung past proxy_read_timeout (VEGA_MAX_DEADLINE_MS
    + 5 s, here 1 s + 5 s): the caller gets 504 deadline_exceeded in the route's error
    shape, as Vega gives at a deadline, not Nginx's HTML page; it is not sent elsewhere."""
    require("nginx")
    async with stand_ins(False, False, hangs=True) as frozen:
        upstreams = [f"127.0.0.1:{stand_in.port}" for stand_in in frozen]
        proxy = Nginx(upstreams, tmp_path)
        proxy.conf.write_text(render_nginx(upstreams, f"127.0.0.1:{proxy.port}", tmp_path,
                                           max_deadline_ms=1000))
        proxy.start()
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                v1, v2 = await asyncio.gather(*(client.post(proxy.url + path, json={
                    "inputs": window(2)}) for path in ("/v1/infer", "/v2/models/echo/infer")))
        finally:
            proxy.stop()
    assert sum(stand_in.read for stand_in in frozen) == 2  # each read once, not resent
    assert v1.status_code == 504 and v1.json()["error"]["code"] == "deadline_exceeded", v1.text
    assert v2.status_code == 504 and v2.json()["error"].startswith("deadline_exceeded")
    assert "retry-after" not in v1.headers
