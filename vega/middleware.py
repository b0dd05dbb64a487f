"""The HTTP edge: bearer-token authentication and request ids, as plain ASGI middleware.

Both run before routing, so an unauthenticated request costs no parsing. Client
request ids are untrusted text: only a short, safe form of one reaches logs. While the
process drains, every response says ``Connection: close``: a keep-alive client then
sends its next request on a new connection (to a peer, behind a balancer), not onto
this one just as it closes, unanswered.
"""

from __future__ import annotations

import hmac
import itertools
import re
import uuid
from collections.abc import Iterable
from typing import Protocol

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID = b"x-request-id"
CONNECTION_CLOSE = (b"connection", b"close")
_SAFE_ID = re.compile(r"[^A-Za-z0-9._:-]")
MAX_ID_CHARS = 64


_PREFIX = uuid.uuid4().hex[:12]  # per process; a counter makes each id unique in it
_counter = itertools.count(1)


def clean_request_id(raw: bytes | None) -> str:
    """The client's id cut to 64 safe characters, or a fresh one if nothing is left."""
    if raw:
        cleaned = _SAFE_ID.sub("", raw[:256].decode("latin-1"))[:MAX_ID_CHARS]
        if cleaned:
            return cleaned
    return f"{_PREFIX}-{next(_counter):x}"


class Lifecycle(Protocol):
    draining: bool


class _Open:
    draining = False


class RequestIdMiddleware:
    """Puts a safe ``vega.request_id`` in the scope and echoes it as ``X-Request-Id``;
    adds ``Connection: close`` while ``lifecycle.draining``."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle = _Open()) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = None
        for name, value in scope["headers"]:  # a plain loop: cheaper than a generator here
            if name == REQUEST_ID:
                raw = value
                break
        request_id = clean_request_id(raw)
        scope["vega.request_id"] = request_id
        lifecycle = self.lifecycle

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REQUEST_ID, request_id.encode())]
                if lifecycle.draining:
                    headers.append(CONNECTION_CLOSE)
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)


class BearerAuthMiddleware:
    """401 unless ``Authorization: Bearer <token>`` names one of ``tokens``.

    Paths in ``open_paths`` (health, metrics by default) need no token. Tokens are
    compared in constant time.
    """

    def __init__(self, app: ASGIApp, tokens: Iterable[str], open_paths: Iterable[str]) -> None:
        self.app = app
        self.tokens = [token.encode() for token in tokens if token]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.tokens or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and self._known(token.strip()):
            await self.app(scope, receive, send)
            return
        message = "missing or unknown bearer token"
        body = orjson.dumps({"error": f"unauthorized: {message}"}  # each protocol's shape
                            if scope["path"].startswith("/v2") else
                            {"error": {"code": "unauthorized", "message": message}})
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="vega"')]})
        await send({"type": "http.response.body", "body": body})

    def _known(self, token: bytes) -> bool:
        # Check all of them so the time taken does not say which one nearly matched.
        return any([hmac.compare_digest(token, known) for known in self.tokens])
