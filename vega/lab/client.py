"""The load generator's HTTP/1.1 client parts: where to connect and what bytes to send.

A ``Target`` is the server (host and port, or a unix socket) and builds request bytes;
a ``Kind`` is one request pre-encoded once per (length, class) so the hot path only
writes bytes; ``error_code`` and ``header_seconds`` read just what the engine needs
from an answer; ``http_get`` is one GET on a connection of its own, for the side
channels (/v1/status, /metrics), never the measured path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
import orjson

from vega.lab.traffic import PRIORITIES, TrafficError


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    uds: str | None
    path: str
    token: str | None = None  # sent as a bearer token, for a server with VEGA_AUTH_TOKENS

    @classmethod
    def parse(cls, url: str, path: str, uds: str | None, token: str | None = None) -> Target:
        parts = urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme != "http":
            raise TrafficError(f"url {url!r}: only http:// is supported")
        return cls(parts.hostname or "127.0.0.1", parts.port or 80, uds,
                   parts.path if parts.path not in ("", "/") else path, token or None)

    async def connect(self, factory: Callable[[], asyncio.Protocol]) -> asyncio.Protocol:
        loop = asyncio.get_running_loop()
        if self.uds:
            _, proto = await loop.create_unix_connection(factory, self.uds)
        else:
            _, proto = await loop.create_connection(factory, self.host, self.port)
        return proto

    def request(self, method: str, path: str, body: bytes = b"", headers: str = "") -> bytes:
        """Request bytes; ``headers`` are more header lines, each ending in CRLF."""
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{headers}"
        if self.token:
            head += f"Authorization: Bearer {self.token}\r\n"
        if method == "POST":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body


@dataclass(frozen=True)
class Kind:
    """One pre-encoded request: a (length, class, can wait) combination."""

    data: bytes
    priority: str
    deadline_s: float
    can_wait: bool = False  # sent with Prefer: respond-async: a refusal may become a job


PREFER_ASYNC = "Prefer: respond-async\r\n"


def encode_kinds(target: Target, shapes: set[tuple[int, int, bool]],
                 deadlines: dict[str, float], rng: np.random.Generator
                 ) -> dict[tuple[int, int, bool], Kind]:
    """One Kind per (length, priority index, can wait) in ``shapes``."""
    kinds = {}
    for length, p, wait in sorted(shapes):
        name = PRIORITIES[p]
        rows = np.round(rng.random((length, 8)), 3).tolist()
        body = orjson.dumps({"inputs": rows, "priority": name,
                             "deadline_ms": round(1000 * deadlines[name], 3)})
        data = target.request("POST", target.path, body, PREFER_ASYNC if wait else "")
        kinds[(length, p, wait)] = Kind(data, name, deadlines[name], wait)
    return kinds



def error_code(body: bytes) -> str:
    """``error.code`` of an error body, or "" when it has none."""
    try:
        doc = orjson.loads(body)
        code = doc["error"]["code"] if isinstance(doc, dict) else None
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return ""
    return code if isinstance(code, str) else ""


def header_value(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (given as ``b"\\r\\nname:"``, lower case) in the raw
    response head, its case kept; None when it is absent."""
    at = head.lower().find(name)
    if at < 0:
        return None
    end = head.find(b"\r\n", at + 2)
    return head[at + len(name):end if end > 0 else len(head)].strip()


def header_seconds(head: bytes, name: bytes) -> float:
    """A header's value as seconds (``Retry-After: 2``), or 0 when absent or not a number."""
    at = head.find(name)
    if at < 0:
        return 0.0
    end = head.find(b"\r\n", at + 2)
    try:
        return float(head[at + len(name):end if end > 0 else len(head)].strip())
    except ValueError:
        return 0.0



async def http_get(target: Target, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """One GET on a connection of its own (not the hot path)."""
    async def go() -> tuple[int, bytes]:
        if target.uds:
            reader, writer = await asyncio.open_unix_connection(target.uds)
        else:
            reader, writer = await asyncio.open_connection(target.host, target.port)
        try:
            writer.write(target.request("GET", path)[:-2] + b"Connection: close\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else await reader.read()
            return int(head[9:12]), body
        finally:
            writer.close()
    return await asyncio.wait_for(go(), timeout_s)

