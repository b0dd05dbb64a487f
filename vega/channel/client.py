"""The one Redis client factory, and the request path's guard around it.

Every Redis client Vega holds comes from ``connect``: the overflow streams, the shared
cache and idempotency tiers. The request path never waits on Redis longer than
``VEGA_REDIS_TIMEOUT_MS``: the client's socket timeout bounds every command, so no
await is ever cancelled or wrapped in ``wait_for`` (a cancelled redis-py command drops
its connection). After a failure a side tier is skipped for a short while and the
caller works locally.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

T = TypeVar("T")

DOWN_FOR_S = 1.0  # after a failure, skip Redis this long before trying again
CONNECTION_ERRORS = (rexc.ConnectionError, rexc.TimeoutError)


class Unavailable(Exception):
    """Redis did not answer in time (or recently failed): work locally."""


def connect(url: str, timeout_s: float, *, connect_timeout_s: float | None = None,
            max_connections: int = 64) -> Redis:
    """A client for ``url`` whose every command is bounded by ``timeout_s``.

    ``connect_timeout_s`` (default ``timeout_s``) bounds opening a connection; a
    blocking reader passes its block time plus the command timeout as ``timeout_s``
    and the command timeout here. One quick retry on a dropped connection, no more.
    """
    # from_url adds no Retry of its own: say explicitly how little to retry.
    return Redis.from_url(url, socket_timeout=timeout_s,
                          socket_connect_timeout=connect_timeout_s or timeout_s,
                          max_connections=max_connections,
                          retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1,
                                      supported_errors=(rexc.ConnectionError,)))


class SideRedis:
    """One client for the side tiers, and whether it is worth asking right now."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.client = connect(url, timeout_s)
        self._down_until = 0.0
        self.failures = 0

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    async def run(self, op: Callable[[Redis], Awaitable[T]]) -> T:
        """``op(client)``, or Unavailable when Redis is away or too slow."""
        if not self.up:
            raise Unavailable()
        try:
            return await op(self.client)
        except (rexc.RedisError, OSError) as exc:
            self.failures += 1
            self._down_until = time.monotonic() + DOWN_FOR_S
            raise Unavailable() from exc

    async def close(self) -> None:
        await self.client.aclose()
