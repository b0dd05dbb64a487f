"""What the two sides of overflow share: the connection, this node, and its models.

The origin's side (``vega.streams.Streams``) and the thief's side
(``vega.channel.steal.Thief``) each hold one ``Link`` rather than each other, so a
thief can be built and tested alone: give it a link to a Redis, a models map and a
``run_local``. The origin sets the callbacks it cares about (``on_error`` to take its
batches back when Redis goes away, ``take_back`` for a batch of its own that its
thief read while idle, ``reposted`` for one its busy thief put back under a new id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from redis import exceptions as rexc

from vega.batcher import Batcher
from vega.channel.client import Client, connect, said, sharded
from vega.channel.keys import GROUP, overflow_key
from vega.config import Settings
from vega.metrics import Metrics
from vega.models import ModelAdapter, identity
from vega.quarantine import Quarantine
from vega.records import Batch

log = logging.getLogger("vega.streams")
TIMEOUT_GRACE_S = 2.0  # Redis timing out at the first connect for less is not warned of

RunLocal = Callable[[Batch], Awaitable[None]]
Models = Mapping[str, tuple[ModelAdapter, Batcher]]


def _log_refused(error: BaseException) -> None:
    log.error("redis refused a command: %s", said(error))


def _no_take_back(key: str, why: str) -> None:
    """A link without an origin side has no batches of its own to take back."""


def _no_repost(key: str, entry_id: Any) -> None:
    """A link without an origin side has no hand-offs to follow."""


class Link:
    """One process's end of the side channel: settings, node id, clients, shared state."""

    def __init__(self, settings: Settings, node: str, metrics: Metrics, models: Models,
                 run_local: RunLocal, runnable: Callable[[], bool] = lambda: True) -> None:
        self.settings = settings
        # Inputs that took a model process down here (the executor's, once the runtime
        # sets it): the heartbeat shares those refused, and takes in the peers'.
        self.quarantine = Quarantine()
        self.runnable = runnable  # whether a model can run a batch here now
        self.node = node
        self.metrics = metrics
        self.models = dict(models)
        # A batch runs only where its model's version and weights are the same (a rolling
        # deploy's processes share the stream): each entry and heartbeat carries these.
        self.identities = {name: identity(adapter) for name, (adapter, _) in models.items()}
        self.run_local = run_local
        self.timeout_s = settings.redis_timeout_ms / 1000
        self.cmd = self.client(self.timeout_s)  # every non-blocking command
        self.sharded = sharded(self.cmd)  # a Redis Cluster: one transaction, one slot
        self.up_event = asyncio.Event()  # set while Redis answers
        self.stealing = True  # False once draining: read no more peers' batches
        # Batches handed off, stolen from peers, and taken back from the stream, so far.
        self.counts = {"offered": 0, "taken": 0, "taken_back": 0}
        self.on_error: Callable[[BaseException], None] = _log_refused
        self.take_back: Callable[[str, str], None] = _no_take_back
        self.reposted: Callable[[str, Any], None] = _no_repost  # our batch, under a new id

    def lending(self) -> bool:
        """Whether peers' batches may run here now: not draining, and no model process
        restarting (a batch taken then would fail, though a peer could have run it)."""
        return self.stealing and self.runnable()

    def client(self, timeout_s: float) -> Client:
        """A client of its own (a blocking reader's), commands bounded by ``timeout_s``."""
        return connect(self.settings.redis_url, timeout_s, connect_timeout_s=self.timeout_s)

    @property
    def up(self) -> bool:
        return self.up_event.is_set()

    def redis_error(self, error: BaseException) -> None:
        self.on_error(error)

    async def reach(self) -> tuple[float, int]:
        """Wait until Redis answers (retrying with backoff) and every model's group is
        there; the round trip of a steal until one is measured, and the server's clock (ms)."""
        delay_s = 0.1
        told: set[type] = set()  # why tries failed: each new reason is a WARNING
        began = time.monotonic()
        while True:
            try:
                pings = []
                for _ in range(3):  # the least of three: one slow first ping is noise
                    started = time.perf_counter()
                    await self.cmd.ping()
                    pings.append(time.perf_counter() - started)
                seconds, micros = await self.cmd.time()
                for model in self.models:
                    await self.ensure_group(model)
                # A steal's round trip: XADD, XREADGROUP, XADD, XREAD.
                return 4 * min(pings), seconds * 1000 + micros // 1000
            except rexc.RedisError as error:
                # A timeout in the first seconds is as often this process busy starting
                # (its loop late to read the answer) as Redis away: a WARNING if it lasts.
                early = isinstance(error, rexc.TimeoutError) and \
                    time.monotonic() - began < TIMEOUT_GRACE_S
                level = logging.DEBUG if early or type(error) in told else logging.WARNING
                if not early:
                    told.add(type(error))  # a password changed while it was away, say
                log.log(level, "redis connect failed: %s; next try in %.1f s", said(error),
                        delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(5.0, delay_s * 2)

    async def ensure_group(self, model: str) -> None:
        try:
            await self.cmd.xgroup_create(overflow_key(model), GROUP, id="$", mkstream=True)
        except rexc.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    def done_ttl_ms(self, remaining_s: float) -> int:
        """How long a batch's "answered" mark must outlive its deadline."""
        return int(max(0.0, 1000 * remaining_s) + 2 * self.settings.claim_idle_ms + 1000)


def log_end(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("overflow task died: %r", task.exception(), exc_info=task.exception())


async def stop_tasks(tasks: Iterable[asyncio.Future[Any]], timeout_s: float) -> set[Any]:
    """Cancel ``tasks`` and wait up to ``timeout_s`` for them to end; those still running.

    A cancellation can be lost inside redis-py's blocking reads (redis/redis-py#2028):
    the loop then reads on. So each one still running after a read's length is
    cancelled again, at whatever it awaits next."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    pending = {task for task in tasks if not task.done()}
    while pending and loop.time() < end:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(1.0, end - loop.time()))
    return pending
