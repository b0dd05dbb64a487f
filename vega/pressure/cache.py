"""Response cache: answers already given, keyed by model, version and canonical input.

Two tiers. An in-process LRU bounded in bytes answers first; an optional shared tier
in Redis (``vega:{model}:cache:<digest>``, with a TTL) lets processes use each
other's answers. A miss costs at most one Redis round trip, bounded by the client's
socket timeout; the Redis write after a miss does not hold up the answer. What is
stored is the reply as sent (body and headers), so a hit returns the same bytes.

The key is a digest of the model name, its version and a digest of its weights (where
the adapter gives one: a redeploy with new weights starts afresh even under the same
version), how the protocol renders the
answer (``/v1``: ``inputs`` or ``instances``; v2: the outputs asked for and the id),
and the orjson re-serialisation of the parsed instances with sorted keys: bodies that
differ only in whitespace or key order share an entry.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

from vega.calls import stored_reply
from vega.channel.client import SideRedis, Unavailable
from vega.channel.keys import cache_entry_key
from vega.config import Settings
from vega.httpio import kept
from vega.metrics import Metrics
from vega.models import ModelAdapter

log = logging.getLogger("vega.pressure.cache")

ENTRY_OVERHEAD = 100  # bytes charged per entry besides key and value (dict, node, object)


def cache_key(model: str, version: str, variant: str, instances: Any) -> str:
    """The Redis-ready key of one request's answer (the model in a hash tag); ``variant``
    is how the protocol renders it (vega.calls.Call)."""
    digest = hashlib.blake2b(digest_size=20)
    for part in (model.encode(), version.encode(), variant.encode()):
        digest.update(len(part).to_bytes(4, "big") + part)
    digest.update(orjson.dumps(instances,
                               option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY))
    return cache_entry_key(model, digest.hexdigest())


class LruBytes:
    """A least-recently-used map of bytes whose total size stays within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self.evictions = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @staticmethod
    def cost(key: str, value: bytes) -> int:
        return len(key) + len(value) + ENTRY_OVERHEAD

    def get(self, key: str) -> bytes | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: bytes) -> int:
        """Store ``value``; return how many entries were evicted to make room."""
        cost = self.cost(key, value)
        if cost > self.max_bytes:
            return 0  # would evict everything and still not fit
        old = self._entries.pop(key, None)
        if old is not None:
            self.size -= self.cost(key, old)
        evicted = 0
        while self.size + cost > self.max_bytes:
            old_key, old_value = self._entries.popitem(last=False)
            self.size -= self.cost(old_key, old_value)
            evicted += 1
        self._entries[key] = kept(value)  # what it counts is what it holds
        self.size += cost
        self.evictions += evicted
        return evicted


class ResponseCache:
    """The two tiers over the models that opted in."""

    def __init__(self, max_bytes: int, models: Mapping[str, str], metrics: Metrics,
                 redis: SideRedis | None = None, redis_ttl_s: float = 0.0) -> None:
        """``models``: each cached model's name and its ``identity``."""
        self.lru = LruBytes(max_bytes)
        self.models = dict(models)
        self.metrics = metrics
        self.redis = redis if redis_ttl_s > 0 else None
        self._ttl_ms = max(1, int(1000 * redis_ttl_s))
        self._writes: set[asyncio.Task[None]] = set()

    def covers(self, model: str) -> bool:
        return model in self.models

    def key(self, model: str, variant: str, instances: Any) -> str | None:
        """The key of a covered model's answer to ``instances``, rendered as ``variant``;
        None where they have no canonical form (nested past orjson's 254 levels, which its
        parser allows; a BYTES tensor): such a request is not cached, and the model's own
        check answers it, as it would with no cache (not a 500)."""
        try:
            return cache_key(model, self.models[model], variant, instances)
        except orjson.JSONEncodeError:
            return None

    async def get(self, model: str, key: str) -> bytes | None:
        """The stored body, from this process or Redis; counts hits and misses."""
        value = self.lru.get(key)
        if value is not None:
            self.metrics.cache_hits.labels(model, "local").inc()
            return value
        if self.redis is not None and self.redis.up:
            try:
                raw = await self.redis.run(lambda r: r.get(key))
            except Unavailable:
                raw = None
            value = raw.encode() if isinstance(raw, str) else raw
            if value is not None and not _an_answer(value):
                log.warning("cache entry %s in Redis is not an answer Vega stored; ignored",
                            key)
                value = None
            if value is not None:
                self.metrics.cache_hits.labels(model, "redis").inc()
                self._keep(model, key, value)
                return value
        self.metrics.cache_misses.labels(model).inc()
        return None

    def put(self, model: str, key: str, body: bytes) -> None:
        """Keep ``body`` here; write it to Redis in the background (never awaited here)."""
        self._keep(model, key, body)
        if self.redis is not None and self.redis.up:
            task = asyncio.ensure_future(self._write(key, body))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    def _keep(self, model: str, key: str, body: bytes) -> None:
        evicted = self.lru.put(key, body)
        if evicted:
            self.metrics.cache_evictions.labels(model).inc(evicted)
        self.metrics.cache_bytes.set(self.lru.size)

    async def _write(self, key: str, body: bytes) -> None:
        assert self.redis is not None
        try:
            await self.redis.run(lambda r: r.set(key, body, px=self._ttl_ms))
        except Unavailable:
            pass  # the local tier has it; Redis is skipped for a while

    async def close(self) -> None:
        """Let background writes finish (each is bounded by the Redis timeout)."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)


def _an_answer(value: bytes) -> bool:
    """Whether a value read from the shared tier is a 200 reply as ``put`` writes it:
    anything else there (written by another program, or cut short) would be answered
    from this process's own tier until evicted, each time as a 500."""
    try:
        reply = stored_reply(orjson.loads(value))
    except orjson.JSONDecodeError:
        return False
    return reply is not None and reply.status == 200


def models_to_cache(settings: Settings, adapters: Mapping[str, ModelAdapter]) -> list[str]:
    """The models whose answers may be cached: opted in, and deterministic unless overridden."""
    if settings.cache_bytes <= 0:
        return []
    wanted = settings.cache_models
    cached = [name for name, adapter in adapters.items()
              if ("*" in wanted or name in wanted)
              and (getattr(adapter, "deterministic", False) or settings.cache_nondeterministic)]
    if not cached:  # the operator turned the cache on: say why it caches nothing
        log.warning("VEGA_CACHE_BYTES is set but no model's answers are cached: "
                    "VEGA_CACHE_MODELS=%s names none of %s (or only nondeterministic ones, "
                    "which VEGA_CACHE_NONDETERMINISTIC allows)", ",".join(wanted),
                    ", ".join(adapters))
    return cached
