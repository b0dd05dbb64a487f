"""The side channel's edges: what a peer may write that the checks must refuse cleanly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import redis.exceptions as rexc

from vega.channel.link import Link
from vega.channel.wire import WireError, decode_reply
from vega.config import load_settings
from vega.metrics import Metrics

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


async def test_redis_out_of_reach_is_logged_once_for_each_new_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    # Back with another password while it was away: that reason must reach the log, not
    # hide behind the first one at DEBUG.
    failures: list[Exception] = [rexc.ConnectionError("refused"), rexc.TimeoutError("slow"),
                                 rexc.ConnectionError("refused"),
                                 rexc.AuthenticationError("invalid password"),
                                 rexc.AuthenticationError("invalid password")]

    class Answering:
        async def ping(self) -> bool:
            if failures:
                raise failures.pop(0)
            return True

        async def time(self) -> tuple[int, int]:
            return 1, 0

    async def run_local(batch: Any) -> None:
        return None

    link = Link(load_settings(environ={"VEGA_REDIS_URL": "redis://127.0.0.1:1/0"}), "n",
                Metrics(), {}, run_local)
    link.cmd = Answering()  # type: ignore[assignment]
    with caplog.at_level("DEBUG", logger="vega"):
        await link.reach()
    said = [(r.levelname, r.getMessage().split(":")[1].strip()) for r in caplog.records
            if "redis connect failed" in r.getMessage()]
    # The timeout comes within the first seconds: a busy start as often as Redis away,
    # so it is not warned of (test_streams: one that lasts is).
    assert [level for level, _ in said] == ["WARNING", "DEBUG", "DEBUG", "WARNING", "DEBUG"]
    assert said[3][1] == "AuthenticationError"
