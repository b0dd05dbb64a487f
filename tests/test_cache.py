"""Response cache: the byte-bounded LRU, keys, and hits against real servers (and Redis)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis

from tests.infra import RedisServer
from tests.inproc import in_process
from tests.models import forwarded, window
from tests.servers import VegaProcess, wait_until
from vega.config import load_settings
from vega.metrics import Metrics
from vega.models import identity, load_model
from vega.pressure.cache import (
    ENTRY_OVERHEAD,
    LruBytes,
    ResponseCache,
    cache_key,
    models_to_cache,
)
from vega.server import _cached_as

ECHO = {"VEGA_MODEL": "python:tests.models:echo", "VEGA_LENGTH_BUCKETS": "16",
        "VEGA_CACHE_BYTES": "1000000"}


def test_lru_stays_within_its_byte_bound_and_evicts_least_recent() -> None:
    lru = LruBytes(max_bytes=10 * (ENTRY_OVERHEAD + 2 + 100))
    for i in range(10):
        lru.put(f"k{i}", bytes(100))
    assert len(lru) == 10 and lru.size == lru.max_bytes
    assert lru.get("k0") is not None  # k0 is now the most recent
    assert lru.put("kA", bytes(100)) == 1
    assert "k1" not in lru and "k0" in lru and "kA" in lru
    assert lru.put("kB", bytes(350)) == 3  # a larger entry pushes out as many as it needs
    assert lru.size <= lru.max_bytes and lru.evictions == 4
    assert lru.put("huge", bytes(lru.max_bytes)) == 0 and "huge" not in lru
    lru.put("kB", bytes(10))  # replacing an entry frees its old size
    assert lru.size <= lru.max_bytes
    assert lru.size == sum(LruBytes.cost(k, v) for k, v in lru._entries.items())


def test_the_lru_holds_about_the_bytes_it_counts_of_orjson_answers() -> None:
    # orjson's output carries the 4-KB buffer it was written in: kept as it came, an
    # LRU of short answers held 13-25 times its bound.
    lru = LruBytes(max_bytes=200_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3000):
            lru.put(f"k{i}", orjson.dumps({"model": "m", "outputs": [i, 0.25, 0.5]}))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert lru.size <= lru.max_bytes and held < 2 * lru.max_bytes, held


def test_keys_are_canonical_and_separate_models_versions_and_shapes() -> None:
    a = cache_key("m", "1", "n", [{"x": 1, "y": [1.5, 2]}])
    assert a == cache_key("m", "1", "n", [{"y": [1.5, 2], "x": 1}])
    assert a.startswith("vega:{m}:cache:")
    others = {cache_key("m", "2", "n", [{"x": 1, "y": [1.5, 2]}]),
              cache_key("n", "1", "n", [{"x": 1, "y": [1.5, 2]}]),
              cache_key("m", "1", "1", [{"x": 1, "y": [1.5, 2]}]),
              cache_key("m", "1", "n", [{"x": 2, "y": [1.5, 2]}])}
    assert a not in others and len(others) == 4


def test_instances_with_no_canonical_form_have_no_key() -> None:
    # A BYTES tensor (object array) or nesting past orjson's writer: not cached, not a 500.
    cache = ResponseCache(1000, {"m": "1"}, Metrics())
    strings = np.empty(2, dtype=object)
    strings[:] = [b"a", b"b"]
    deep: list[Any] = []
    for _ in range(300):
        deep = [deep]
    assert cache.key("m", "n", [strings]) is None and cache.key("m", "n", deep) is None
    assert cache.key("m", "n", [np.zeros(2, dtype=np.float32)]) is not None


class _Fake:
    def __init__(self, deterministic: bool) -> None:
        self.deterministic = deterministic


def test_nondeterministic_models_are_cached_only_when_the_operator_says_so() -> None:
    adapters: dict[str, Any] = {"det": _Fake(True), "random": _Fake(False)}
    on = load_settings(environ={"VEGA_CACHE_BYTES": "1000"})
    assert models_to_cache(on, adapters) == ["det"]
    forced = load_settings(environ={"VEGA_CACHE_BYTES": "1000",
                                    "VEGA_CACHE_NONDETERMINISTIC": "true"})
    assert models_to_cache(forced, adapters) == ["det", "random"]
    some = load_settings(environ={"VEGA_CACHE_BYTES": "1000", "VEGA_CACHE_MODELS": "random",
                                  "VEGA_CACHE_NONDETERMINISTIC": "1"})
    assert models_to_cache(some, adapters) == ["random"]
    assert models_to_cache(load_settings(environ={}), adapters) == []


def test_a_cache_turned_on_that_covers_no_model_is_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    adapters: dict[str, Any] = {"det": _Fake(True)}
    typo = load_settings(environ={"VEGA_CACHE_BYTES": "1000", "VEGA_CACHE_MODELS": "dte"})
    with caplog.at_level("WARNING", logger="vega.pressure.cache"):
        assert models_to_cache(typo, adapters) == []
    assert "VEGA_CACHE_MODELS=dte names none of det" in caplog.text


def stored_in(server: RedisServer, model: str) -> int:
    """Wait for a cache entry of ``model`` in Redis (written after the answer); its TTL, ms."""
    client = redis.Redis.from_url(server.url)
    try:
        pattern = f"vega:{{{model}}}:cache:*"
        wait_until(lambda: client.keys(pattern), 5, f"a cache entry of {model} in Redis")
        ttl: int = client.pttl(client.keys(pattern)[0])
        return ttl
    finally:
        client.close()


def test_a_hit_skips_the_model_and_returns_the_same_bytes(
        vega: Callable[..., VegaProcess], tmp_path: Path) -> None:
    log = str(tmp_path / "forwards")
    server = vega(**ECHO, TEST_FORWARD_LOG=log)
    base = forwarded(log)  # the warm-up's passes
    body = orjson.dumps({"inputs": window(8, 0.25)})
    first = httpx.post(server.url + "/v1/infer", content=body)
    assert first.status_code == 200 and first.headers["x-vega-cache"] == "miss"
    assert forwarded(log) == base + 1
    again = httpx.post(server.url + "/v1/infer", content=orjson.dumps(
        {"inputs": window(8, 0.25), "priority": "sheddable"}))  # class is not in the key
    assert again.status_code == 200 and again.headers["x-vega-cache"] == "hit"
    assert again.content == first.content
    assert forwarded(log) == base + 1

    fresh = httpx.post(server.url + "/v1/infer", content=body,
                       headers={"Cache-Control": "no-cache"})
    assert fresh.headers["x-vega-cache"] == "bypass" and fresh.content == first.content
    assert forwarded(log) == base + 2
    other = httpx.post(server.url + "/v1/infer", content=orjson.dumps(
        {"instances": [window(8, 0.25)]}))  # the list form answers a list: its own entry
    assert other.headers["x-vega-cache"] == "miss"
    assert forwarded(log) == base + 3
    for ident in ("a", "b", "a"):  # an answer echoes the body's id: never another call's
        tagged = httpx.post(server.url + "/v1/infer", content=orjson.dumps(
            {"inputs": window(8, 0.25), "id": ident}))
        assert tagged.json()["id"] == ident
        assert tagged.json()["outputs"] == first.json()["outputs"]
    assert tagged.headers["x-vega-cache"] == "hit"
    assert forwarded(log) == base + 5

    metrics = httpx.get(server.url + "/metrics").text
    assert 'vega_cache_hits_total{model="echo",tier="local"} 2.0' in metrics
    assert 'vega_cache_misses_total{model="echo"} 4.0' in metrics


def test_the_redis_tier_shares_hits_between_processes(
        vega: Callable[..., VegaProcess], redis_server: RedisServer, tmp_path: Path) -> None:
    logs = [str(tmp_path / "a"), str(tmp_path / "b")]
    shared = {**ECHO, "VEGA_REDIS_URL": redis_server.url, "VEGA_CACHE_REDIS_TTL_S": "60"}
    a, b = (vega(**shared, TEST_FORWARD_LOG=log) for log in logs)
    base = [forwarded(log) for log in logs]
    body = orjson.dumps({"inputs": window(4, 0.75)})
    first = httpx.post(a.url + "/v1/infer", content=body)
    assert first.headers["x-vega-cache"] == "miss"
    ttl = stored_in(redis_server, "echo")
    assert isinstance(ttl, int) and 0 < ttl <= 60_000
    second = httpx.post(b.url + "/v1/infer", content=body)
    assert second.headers["x-vega-cache"] == "hit" and second.content == first.content
    assert [forwarded(log) for log in logs] == [base[0] + 1, base[1]]
    assert 'tier="redis"} 1.0' in httpx.get(b.url + "/metrics").text


def test_new_weights_under_the_same_version_share_no_answers(
        vega: Callable[..., VegaProcess], redis_server: RedisServer) -> None:
    shared = {"VEGA_MODEL": "python:tests.models:redeployed", "VEGA_LENGTH_BUCKETS": "16",
              "VEGA_CACHE_BYTES": "1000000", "VEGA_REDIS_URL": redis_server.url,
              "VEGA_CACHE_REDIS_TTL_S": "60"}
    old, new = vega(**shared, TEST_SEED="1"), vega(**shared, TEST_SEED="2")
    body = orjson.dumps({"inputs": window(4, 0.75)})
    first = httpx.post(old.url + "/v1/infer", content=body)
    assert first.headers["x-vega-cache"] == "miss"
    stored_in(redis_server, "redeployed")
    redeployed = httpx.post(new.url + "/v1/infer", content=body)
    assert redeployed.headers["x-vega-cache"] == "miss"  # its own weights' answer
    assert redeployed.json()["outputs"] != first.json()["outputs"]
    again = httpx.post(old.url + "/v1/infer", content=body)
    assert again.headers["x-vega-cache"] == "hit" and again.content == first.content


def test_processes_taking_other_window_lengths_share_no_cached_answer() -> None:
    # The same weights and code, one taking windows of 8 steps and more, one of 16: a
    # 10-step window the second refuses must not be answered it from the first's entry.
    eight, sixteen = (load_model(f"python:tests.models:{name}", "patches")
                      for name in ("patches", "whole_patches_of_16"))
    assert identity(eight) == identity(sixteen)  # overflow: declined per batch instead
    assert _cached_as(eight) != _cached_as(sixteen)


@pytest.mark.parametrize("stored", [
    b"not json", b"[1, 2]", b'{"status": 200}',
    orjson.dumps({"status": 200, "body": "{}", "outcome": "ok",
                  "headers": {"X-Evil": "a\r\nSet-Cookie: session=theirs"}}),
    orjson.dumps({"status": 302, "body": "", "outcome": "ok",
                  "headers": {"Location": "https://elsewhere.example"}}),
])
async def test_a_shared_entry_vega_did_not_write_is_a_miss_not_a_500(
        redis_server: RedisServer, stored: bytes, caplog: pytest.LogCaptureFixture) -> None:
    env = {**ECHO, "VEGA_REDIS_URL": redis_server.url, "VEGA_CACHE_REDIS_TTL_S": "60"}
    body = orjson.dumps({"inputs": window(4, 0.5)})
    async with in_process(env) as (writer, _):
        first = await writer.post("/v1/infer", content=body)
        assert first.status_code == 200 and first.headers["x-vega-cache"] == "miss"
    stored_in(redis_server, "echo")
    entry = redis.Redis.from_url(redis_server.url)
    try:
        key = entry.keys("vega:{echo}:cache:*")[0]
        entry.set(key, stored, px=60_000)  # another program's value under the answer's key
    finally:
        entry.close()
    async with in_process(env) as (reader, _):
        for cached in ("miss", "hit"):  # answered by the model, then kept here as it is
            answer = await reader.post("/v1/infer", content=body)
            assert answer.status_code == 200 and answer.content == first.content
            assert answer.headers["x-vega-cache"] == cached
            assert "set-cookie" not in answer.headers
    assert "is not an answer Vega stored" in caplog.text
