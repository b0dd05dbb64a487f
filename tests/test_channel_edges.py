"""The side channel's edges: what a peer may write that the checks must refuse cleanly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from vega.channel.wire import WireError, decode_reply

CODES = frozenset({"model_error", "declined", "dead_letter"})


def raw_reply(meta: dict[str, Any], data: bytes = b"") -> dict[bytes, bytes]:
    return {b"v": b"2", b"meta": orjson.dumps(meta), b"data": data}


HEAD = {"batch": "o.b.1", "node": "peer", "infer_ms": 1}


@pytest.mark.parametrize("meta", [
    {**HEAD, "error": {"code": ["declined"], "message": "x"}},  # TypeError: unhashable
    {**HEAD, "error": {"code": {"a": 1}, "message": "x"}},
    {**HEAD, "arrays": [{"dtype": "float32", "shape": [65536] * 4}]},  # int64 size wraps to 0
    {**HEAD, "arrays": [{"dtype": "float32", "shape": [1 << 24, 1 << 24]}]},
    {**HEAD, "arrays": [{"dtype": ["float32"], "shape": [1]}]},  # TypeError: unhashable
])
def test_a_malformed_reply_raises_only_wire_error(meta: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        decode_reply(raw_reply(meta), 1, CODES)
