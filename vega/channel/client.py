"""The one Redis client factory, and the request path's guard around it.

Every Redis client Vega holds comes from ``connect``: the overflow streams, the shared
cache and idempotency tiers. ``VEGA_REDIS_URL`` names one server, a Redis Cluster (seed
nodes) or a Sentinel-managed primary (vega/channel/url.py); ``connect`` returns
redis-py's own client for each, so callers use the same commands on all three as long
as all keys of one command, transaction or script share a slot (vega/channel/keys.py).

The request path never waits on Redis longer than ``VEGA_REDIS_TIMEOUT_MS``: the
client's socket timeout bounds every command, so no await is ever cancelled or wrapped
in ``wait_for`` (a cancelled redis-py command drops its connection). After a failure a
side tier is skipped for a short while and the caller works locally; after a timeout,
only once a probe (a small write, ``probe``) has gone unanswered too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

from redis import exceptions as rexc
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff

from vega.channel.url import CLUSTER, SENTINEL, parse_redis_url

log = logging.getLogger("vega.channel")

T = TypeVar("T")
Client: TypeAlias = "Redis | RedisCluster"

DOWN_FOR_S = 1.0  # after a failure, skip Redis this long before trying again
# What means "Redis is away" (serve locally, reconnect) rather than "Redis refused this":
# a cluster with a slot's primary gone, no seed node answering (RedisClusterException),
# or a Sentinel that names no primary, included; and a Redis that takes no writes (out
# of memory under noeviction, a read-only replica, an ACL without the command), which
# every path of the side channel needs.
CONNECTION_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError,
                     rexc.SlotNotCoveredError, rexc.TryAgainError, rexc.RedisClusterException,
                     rexc.OutOfMemoryError, rexc.ReadOnlyError, rexc.NoPermissionError,
                     rexc.MasterDownError)
PROBE_KEY = "vega:probe"  # written to tell a stall here from a Redis that holds writes


POOL_WAIT_S = 1.0  # the longest a command waits for a free connection
# redis-py's cluster client has no pool that waits: past its connections to a node a
# command fails, so a burst of requests would read as Redis away. Room for a burst.
CLUSTER_NODE_CONNECTIONS = 1024


class Unavailable(Exception):
    """Redis did not answer in time (or recently failed): work locally.

    ``maybe_ran``: the command was sent and timed out, so Redis may have run it."""

    def __init__(self, maybe_ran: bool = False) -> None:
        super().__init__()
        self.maybe_ran = maybe_ran


def connect(url: str, timeout_s: float, *, connect_timeout_s: float | None = None,
            max_connections: int = 64) -> Client:
    """A client for ``url`` (``VEGA_REDIS_URL``) whose every command is bounded by ``timeout_s``.

    ``connect_timeout_s`` (default ``timeout_s``) bounds opening a connection; a
    blocking reader passes its block time plus the command timeout as ``timeout_s``
    and the command timeout here. One quick retry on a dropped connection, no more
    (a cluster's redirects are followed besides). Nothing connects until the first
    command. Raises ValueError for a URL that names no Redis (config validates it first).
    """
    target = parse_redis_url(url)
    connect_s = connect_timeout_s or timeout_s
    # from_url adds no Retry of its own: say explicitly how little to retry.
    retry = Retry(ExponentialBackoff(cap=0.05, base=0.01), 1,
                  supported_errors=(rexc.ConnectionError,))
    common: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_s,
                              "max_connections": max_connections, "retry": retry}
    if target.mode == CLUSTER:
        return _Cluster(startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                        username=target.username, password=target.password, ssl=target.tls,
                        **{**common, "max_connections": max(max_connections,
                                                            CLUSTER_NODE_CONNECTIONS)})
    if target.mode == SENTINEL:
        own = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_s,
               "ssl": target.tls}
        sentinels = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]  # typed in 8.2
            list(target.nodes), sentinel_kwargs=own)
        client = sentinels.master_for(
            target.service, redis_class=_SentinelClient,
            connection_pool_class=_WaitingSentinelPool, db=target.db,
            username=target.username, password=target.password, ssl=target.tls,
            timeout=max(POOL_WAIT_S, timeout_s), **common)
        assert isinstance(client, _SentinelClient)
        client.sentinels = sentinels
        return client
    # Past max_connections a command waits for a free connection, a second at most: a
    # burst of job polls is local queueing, not Redis failing, and must not fail commands
    # (a result not stored is a job run twice). Each command itself keeps ``timeout_s``.
    pool = BlockingConnectionPool.from_url(url, timeout=max(POOL_WAIT_S, timeout_s), **common)
    return Redis.from_pool(pool)


class _WaitingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """The Sentinel's pool, which waits for a free connection as the standalone one does."""


class _SentinelClient(Redis):
    """A client of the primary a Sentinel names, which closes its connections to the
    Sentinels with its own (each new connection to the primary asked them where it is)."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinels is not None:
            for sentinel in self.sentinels.sentinels:
                await sentinel.aclose()


def sharded(client: Client) -> bool:
    """Whether keys of different slots may live on different servers (a Redis Cluster)."""
    return isinstance(client, RedisCluster)


def said(error: BaseException) -> str:
    """A Redis error for a log line: redis-py's repr names only its kind, not Redis's words."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _closed_under(error: Exception) -> rexc.ConnectionError:
    return rexc.ConnectionError(f"connection closed under a command: {error!r}")


def _cluster_away(error: rexc.RedisClusterException) -> rexc.ConnectionError:
    return rexc.ConnectionError(f"the cluster did not answer: {error!r}")


class _Cluster(RedisCluster):
    """redis-py's cluster client, made to fail only with RedisErrors.

    No node answering (or a slot without one) raises RedisClusterException, which is
    not a RedisError: here it becomes the connection error that every caller treats
    as Redis away. After a timeout redis-py disconnects a node's idle connections while
    other commands may be starting on them; those fail with the transport's
    RuntimeError or AttributeError, which become connection errors too.
    """

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        try:
            return await super().initialize(*args, **kwargs)
        except rexc.RedisClusterException as error:
            raise _cluster_away(error) from error

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except rexc.RedisClusterException as error:
            raise _cluster_away(error) from error
        except (RuntimeError, AttributeError) as error:
            raise _closed_under(error) from error

    def pipeline(self, transaction: Any | None = None,
                 shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # refused there
        return _ClusterPipeline(self, transaction)  # type: ignore[abstract]


class _ClusterPipeline(ClusterPipeline):
    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return await super().execute(*args, **kwargs)
        except rexc.RedisClusterException as error:
            raise _cluster_away(error) from error
        except (RuntimeError, AttributeError) as error:
            raise _closed_under(error) from error


async def leave_group(client: Client, stream: str, group: str, consumer: str) -> None:
    """Delete ``consumer`` from ``stream``'s ``group`` if it holds no entry (its reads
    have stopped): restarts under new names would pile names up in the group forever.
    One holding entries stays, for a peer to reclaim them. Best effort."""
    try:
        if not await client.xpending_range(stream, group, min="-", max="+", count=1,
                                           consumername=consumer):
            await client.xgroup_delconsumer(stream, group, consumer)
    except (rexc.RedisError, OSError):
        pass


def probe(client: Client) -> Awaitable[Any]:
    """One cheap write: answered only by a Redis that takes writes now."""
    return client.set(PROBE_KEY, b"1", px=1000)


class StallCheck:
    """Whether a command that timed out met Redis away or a stall of this process.

    A stall (a burst's long loop turns, a collection) times out every command in flight
    across it though Redis answered, and acting on it as an outage (taking every hand-off
    back, skipping the shared tiers) costs more than the stall did. One probe at a time
    decides: unanswered, ``lost(error)``; answered, ``stalled()``. The probe is a write:
    a Redis that answers reads but holds writes (CLIENT PAUSE WRITE, as a failover does)
    serves none of Vega's paths."""

    def __init__(self, ping: Callable[[], Awaitable[Any]],
                 lost: Callable[[BaseException], None], stalled: Callable[[], None] = lambda: None,
                 spawn: Callable[[Awaitable[None]], asyncio.Future[Any]] = asyncio.ensure_future
                 ) -> None:
        self._ping, self._lost, self._stalled, self._spawn = ping, lost, stalled, spawn
        self._checking: asyncio.Future[Any] | None = None
        self.stalls = 0

    def timed_out(self, error: BaseException) -> None:
        if self._checking is None or self._checking.done():
            self._checking = self._spawn(self._check(error))

    async def _check(self, error: BaseException) -> None:
        try:
            await self._ping()
        except (rexc.RedisError, OSError):
            self._lost(error)
            return
        self.stalls += 1
        self._stalled()
        log.info("a redis command timed out (%s), but redis answers: a stall here", said(error))

    async def close(self) -> None:
        if (checking := self._checking) is not None and not checking.done():
            checking.cancel()
            await asyncio.gather(checking, return_exceptions=True)


class SideRedis:
    """One client for the side tiers, and whether it is worth asking right now."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.client = connect(url, timeout_s)
        self._down_until = 0.0
        self.timeouts = StallCheck(lambda: probe(self.client), lambda _error: self._down())

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    async def run(self, op: Callable[[Client], Awaitable[T]]) -> T:
        """``op(client)``, or Unavailable when Redis is away or too slow."""
        if not self.up:
            raise Unavailable()
        try:
            return await op(self.client)
        except rexc.TimeoutError as exc:
            self.timeouts.timed_out(exc)  # a stall here must not turn the tiers off
            raise Unavailable(maybe_ran=True) from exc
        except (rexc.RedisError, OSError) as exc:
            self._down()
            raise Unavailable() from exc

    def _down(self) -> None:
        self._down_until = time.monotonic() + DOWN_FOR_S

    async def close(self) -> None:
        await self.timeouts.close()
        await self.client.aclose()
