"""uvicorn's httptools protocol, writing each response to its socket once, not twice.

uvicorn writes a response's status line and headers when the app sends
``http.response.start`` and its body when the app sends the body: two ``send`` calls on
the socket, and a client that wakes for the headers and again for the body. Here the
protocol's writes within one turn of the event loop are joined and written at the start
of the next turn, so a response sent in one go leaves as one write. A response streamed
over several turns still leaves a write a turn; close() writes what is held first.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from vega.errors import VegaError


class JoinedWrites:
    """A transport that holds writes until the loop's next turn, then writes them as one.

    Everything else goes to the socket's transport as it is.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held.clear()
        if not self._transport.is_closing():  # the peer left meanwhile: nobody to tell
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    # Called for every request: passed on directly, not through __getattr__.
    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# The most a request line and headers may take: httptools has no bound, and joins a long
# header chunk by chunk (quadratic: 64 MiB held the loop 4 s).
MAX_HEAD_BYTES = 64 * 1024
HEAD_TOO_LARGE = orjson.dumps(VegaError(
    "headers_too_large", f"request line and headers over {MAX_HEAD_BYTES} bytes").body())


class OneWriteProtocol(HttpToolsProtocol):
    """What ``vega serve`` gives uvicorn as its HTTP protocol (``uvicorn.Config(http=...)``),
    which also refuses a request whose head passes ``MAX_HEAD_BYTES`` (431)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(cast(asyncio.Transport, JoinedWrites(
            cast(asyncio.Transport, transport))))
        self._head_bytes = 0  # read while a request's headers are not all in; -1 once they are
        self._reading = 0  # the size of the read being parsed
        self._began_in = 0  # the size of the read the request began in
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._head_bytes >= 0:
            self._head_bytes += len(data)
        self._reading = len(data)
        super().data_received(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes, self._began_in = 0, self._reading

    def on_headers_complete(self) -> None:
        read, self._head_bytes = self._began_in + self._head_bytes, -1
        # The reads since the message began (the first whole: a part of it may be the
        # request before, or this one's body) bound its head; past the bound, measure the
        # request line and headers uvicorn has parsed. No request is started for one over.
        if read > MAX_HEAD_BYTES and len(self.url) + sum(
                len(name) + len(value) + 4 for name, value in self.headers) > MAX_HEAD_BYTES:
            self._refuse_head()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def _refuse_head(self) -> None:
        self._refused = True
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                b"content-length: " + str(len(HEAD_TOO_LARGE)).encode() + b"\r\n\r\n"
                + HEAD_TOO_LARGE)
            self.transport.close()
