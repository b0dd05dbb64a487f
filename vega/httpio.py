"""Reading requests and writing answers, shared by the /v1 and /v2 routes.

Size-limited body reading, JSON parsing, the priority and deadline rules, the error
response, the inference routes' request (``HotRequest``) and answer (``Sent``) and the
hang-up check. Nothing here knows the runtime.
"""

from __future__ import annotations

import asyncio
import math
import re
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from vega.calls import Reply
from vega.config import Settings
from vega.errors import VegaError
from vega.records import NORMAL, PRIORITY_BY_NAME, PRIORITY_NAMES

JSON = "application/json"


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status,
                    headers=headers, media_type=JSON)


def kept(data: bytes) -> bytes:
    """An exact-size copy of bytes to keep for long: orjson's output carries the 4-KB
    buffer it was written in, whatever its length (an LRU of short answers held 13x
    its byte bound)."""
    return bytes(memoryview(data))


def _plain(value: Any) -> Any:
    """What orjson cannot write itself: an array not in C order (a transposed output)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"type {type(value).__name__} is not JSON serializable")


def outputs_json(doc: Any) -> bytes:
    """``doc`` (a model's outputs within an answer) as JSON; a non-finite output refused.

    JSON has no NaN or infinity (orjson writes ``null``, as JavaScript does), so a number
    the model failed to compute would reach the caller as a ``null`` it may not check for.
    A body holds ``null`` only for such a value or a string containing it, so the outputs
    are walked only then.
    """
    try:
        body = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY, default=_plain)
    except TypeError as error:
        raise VegaError("model_error", f"the model's output cannot be written as JSON: "
                        f"{error}") from None
    if b"null" in body and not _finite(doc):
        raise VegaError("model_error", "the model answered NaN or infinity, which JSON cannot "
                        "carry (a binary /v2 output carries it as it is)")
    return body


def _finite(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())
    if isinstance(value, (float, np.floating)):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


class Sent:
    """A reply as its two ASGI messages, with the headers a Starlette Response would
    give it, but none of its machinery: this is the hot path's one answer, sent by
    ``vega.server.HotRoutes`` message by message (an ASGI app's call would be one more
    coroutine a request)."""

    __slots__ = ("start", "body")

    def __init__(self, reply: Reply) -> None:
        headers = [(b"content-length", str(len(reply.body)).encode())]
        if reply.body and reply.media_type:
            headers.append((b"content-type", reply.media_type.encode("latin-1")))
        headers += [(key.lower().encode("latin-1"), value.encode("latin-1"))
                    for key, value in reply.headers.items()]
        self.start = {"type": "http.response.start", "status": reply.status, "headers": headers}
        self.body = {"type": "http.response.body", "body": reply.body}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """As an ASGI app: the endpoint's contract on the Starlette routes it is also on."""
        await send(self.start)
        await send(self.body)


class IndexedHeaders(Headers):
    """Starlette's ``Headers``, looked up in a dict built once.

    An inference request asks for its headers about eight times, most of them absent
    (priority, deadline, idempotency key, Prefer); each lookup scanned the whole list
    and raised KeyError for a missing one. As in ``Headers``, the first of a repeated
    name is the one a lookup returns.
    """

    def __init__(self, scope: Scope) -> None:
        super().__init__(scope=scope)
        self._index = {key.decode("latin-1"): value.decode("latin-1")
                       for key, value in reversed(self._list)}

    def __getitem__(self, key: str) -> str:
        return self._index[key.lower()]

    def __contains__(self, key: Any) -> bool:
        return key.lower() in self._index

    def get(self, key: str, default: Any = None) -> Any:
        return self._index.get(key.lower(), default)


class HotRequest(Request):
    """The request the inference routes read: its headers indexed once, up front."""

    # A plain attribute where Starlette has a property: read about ten times a request,
    # each read of a property is a Python call. (Set on the class so that it shadows the
    # property, which would otherwise refuse the assignment.)
    headers: IndexedHeaders = None  # type: ignore[assignment]

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        super().__init__(scope, receive, send)
        self.headers = IndexedHeaders(scope)


def error_response(error: VegaError) -> Response:
    return json_response(error.body(), error.status, error.headers())


async def read_body(request: Request, limit: int, wait_s: float) -> bytes:
    """The whole body, or 413 as soon as it is known to be over ``limit``; 504 when it
    has not all come within ``wait_s`` (the longest deadline: no answer could be in time,
    and a body held open would hold its bytes and its connection for good).

    Read from the ASGI messages themselves: Starlette's stream generator costs more loop
    time than the read. A caller that hangs up meanwhile raises ClientDisconnect.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise VegaError("invalid_json", "Content-Length is not a number")
        if int(declared) > limit:
            raise VegaError("payload_too_large", f"body over {limit} bytes")
    receive = request.receive
    chunks: list[bytes] = []
    size = 0
    late_at: float | None = None
    while True:
        if late_at is None:  # the first read: in one, most often, and then no timer
            message = await receive()
        else:
            try:
                async with asyncio.timeout_at(late_at):
                    message = await receive()
            except TimeoutError:
                raise VegaError("deadline_exceeded", f"the body did not arrive within "
                                f"{wait_s:g} s") from None
        if message["type"] != "http.request":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise VegaError("payload_too_large", f"body over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)  # one chunk comes back as it is, not copied
        if late_at is None:
            late_at = asyncio.get_running_loop().time() + wait_s


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo a gzip/deflate ``Content-Encoding``, never inflating past ``limit`` bytes."""
    if not encoding or encoding.strip().lower() == "identity":
        return body
    wbits = {"gzip": 31, "deflate": 15}.get(encoding.strip().lower())
    if wbits is None:
        raise VegaError("invalid_json", f"Content-Encoding {encoding!r} is not supported")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise VegaError("invalid_json", f"body is not valid {encoding}: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise VegaError("payload_too_large", f"body inflates to over {limit} bytes")
    if not inflater.eof or inflater.unused_data:  # cut short, or more after its end
        raise VegaError("invalid_json", f"body is not one whole {encoding} stream")
    return out


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("number is infinity"):  # JSON, but past a double: a value
            raise VegaError("invalid_input", f"a number too large: {exc}") from None
        raise VegaError("invalid_json", f"body is not JSON: {exc}") from None


def parse_priority(value: Any, default: int = NORMAL) -> int:
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lower() in PRIORITY_BY_NAME:
        return PRIORITY_BY_NAME[value.strip().lower()]
    raise VegaError("invalid_input", f"priority {str(value)[:40]!r} is not one of "
                    f"{', '.join(PRIORITY_NAMES)}")


def named_priority(value: str | None) -> int | None:
    """The class ``value`` names, None where it names none or no known one: the lenient
    ``parse_priority``, for a guess made before the body is parsed (the body's class wins
    over the header's, and the parse refuses a bad one that stands)."""
    return PRIORITY_BY_NAME.get(value.strip().lower()) if value else None


# After a "priority" key: the colon and the string value, as JSON may space them.
_PRIORITY_VALUE = re.compile(rb'[ \t\n\r]*:[ \t\n\r]*"([^"\\]*)"')
# A valid /v1 body holds at most 7 strings: 4 keys, the class, a deadline as text, an id.
_MOST_QUOTES = 16


def scanned_priority(body: bytes, header: str | None) -> int | None:
    """The class a /v1 body will be taken at, read from its text without parsing it;
    None where only the parse can tell.

    With one ``{`` (no object but the body itself) and no backslash (no escaped key),
    a valid body's ``"priority"`` followed by a colon is its top-level key, and without
    one the body names no class. A body this misreads is not valid JSON, and at worst is
    refused for load before the parse would have said so. It hops from quote to quote
    (memchr), a few per body: 2-4 us for 5-20 KB, where a search for the key itself took
    8 us at 20 KB (a fifth of the parse it spares).
    """
    first = body.find(b"{")
    if first == -1 or body.find(b"{", first + 1) != -1 or b"\\" in body:
        return None
    value, found = header, False
    at, quotes = body.find(b'"'), 0
    while at != -1:
        quotes += 1
        if quotes > _MOST_QUOTES:
            return None
        if body.startswith(b'priority"', at + 1):
            match = _PRIORITY_VALUE.match(body, at + 10)
            if found or match is None:  # twice, or not a key with a string value
                return None
            value, found = match.group(1).decode("utf-8", "replace"), True
            at = match.end() - 1
        at = body.find(b'"', at + 1)
    return NORMAL if value is None else named_priority(value)  # None: the parse answers it


def claimed_priority(body: bytes, headers: Headers) -> int | None:
    """``scanned_priority`` of a body sent as its text; None for a compressed one, whose
    bytes are not its text (a scan of them misreads the class): only the parse can tell."""
    encoding = headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() != "identity":
        return None
    return scanned_priority(body, headers.get("x-vega-priority"))


def parse_deadline_ms(value: Any, settings: Settings) -> float:
    """A positive number of milliseconds, capped at VEGA_MAX_DEADLINE_MS."""
    if value is None:
        return settings.default_deadline_ms
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise VegaError("invalid_input", "deadline_ms must be a positive number of milliseconds")
    return float(min(value, settings.max_deadline_ms))


def hung_up(receive: Receive) -> Callable[[], bool] | None:
    """A cheap "has the caller hung up?" where the server offers one, else None.

    uvicorn's request cycle (whose bound ``receive`` Starlette passes through) keeps a
    ``disconnected`` flag that its connection_lost sets. Reading it costs nothing, where
    a task per request awaiting the disconnect message cost a sizeable share of the
    loop's time. Under other servers callers that hang up are not noticed before their
    items run; their answers are dropped.
    """
    cycle: Any = getattr(receive, "__self__", None)
    if not isinstance(getattr(cycle, "disconnected", None), bool):
        return None
    return lambda: bool(cycle.disconnected)
