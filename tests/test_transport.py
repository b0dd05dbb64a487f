"""vega.transport through a real uvicorn server on uvloop (the loop `vega serve` runs):
a response sent in one go reaches its socket in one write; streamed, HEAD and
closing responses still arrive whole."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from vega.transport import OneWriteProtocol

BODY = b"x" * 3000


class Socket:
    """The socket's own transport, recording each write that reaches it."""

    writes: list[bytes] = []

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def write(self, data: bytes) -> None:
        Socket.writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Recorded(OneWriteProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(Socket(transport))  # type: ignore[arg-type]


async def whole(_: Request) -> Response:
    return Response(BODY, media_type="application/octet-stream")


async def streamed(_: Request) -> StreamingResponse:
    async def parts() -> Any:
        for part in (b"one,", b"two,", b"three"):
            await asyncio.sleep(0.01)
            yield part

    return StreamingResponse(parts(), media_type="text/plain")


APP = Starlette(routes=[Route("/whole", whole, methods=["GET", "HEAD"]),
                        Route("/streamed", streamed)])


async def _exchange() -> dict[str, Any]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(APP, http=Recorded, lifespan="off",
                                           log_level="warning"))
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    seen: dict[str, Any] = {}
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):  # keep-alive: one connection, a write each
                Socket.writes.clear()
                got = await client.get("/whole")
                seen.setdefault("whole", []).append((got.status_code, got.content,
                                                     list(Socket.writes)))
            Socket.writes.clear()
            head = await asyncio.wait_for(client.head("/whole"), 5)
            seen["head"] = (head.status_code, head.headers["content-length"], list(Socket.writes))
            Socket.writes.clear()
            got = await asyncio.wait_for(client.get("/streamed"), 5)
            seen["streamed"] = (got.status_code, got.content, list(Socket.writes))
            Socket.writes.clear()
            got = await client.get("/whole", headers={"connection": "close"})
            seen["close"] = (got.status_code, got.content, list(Socket.writes))
    finally:
        server.should_exit = True
        await serving
    return seen


def test_each_response_reaches_its_socket_whole_and_in_one_write() -> None:
    seen = uvloop.run(_exchange())
    for status, body, writes in seen["whole"]:
        assert (status, body) == (200, BODY)
        assert len(writes) == 1 and writes[0].startswith(b"HTTP/1.1 200 OK\r\n")
        assert writes[0].endswith(b"\r\n\r\n" + BODY)

    status, length, writes = seen["head"]
    assert (status, length) == (200, str(len(BODY))) and len(writes) == 1

    status, body, writes = seen["streamed"]
    assert (status, body) == (200, b"one,two,three")
    assert len(writes) > 1  # a part sent on a later turn leaves on its own

    status, body, writes = seen["close"]
    assert (status, body) == (200, BODY) and len(writes) == 1
    assert b"connection: close\r\n" in writes[0]
