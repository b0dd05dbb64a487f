"""Heartbeats: this process's state written to Redis, the live peers' states read back.

Each beat writes ``vega:node:<id>`` (a hash with a TTL of three beats, so a busy
peer's late beat is not death) and the registry ``vega:nodes`` (a sorted set, node
-> last beat), then reads the other live nodes' hashes. The registry is what lists
peers: no SCAN or KEYS, which a Redis Cluster would have to run on every primary.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson
from redis import exceptions as rexc

from vega.channel.keys import NODES, node_key
from vega.channel.link import Link
from vega.channel.wire import wall_ms
from vega.records import PRIORITY_NAMES

log = logging.getLogger("vega.streams")

# Handing a batch off has room while fewer wait on peers than this many per thread they lend
# (the overflow channel and the simulator's model of it both read it from here).
PENDING_PER_SPARE = 2


class Peers:
    """The live peers as their last heartbeats describe them; our own beats."""

    def __init__(self, link: Link, handed_off: Callable[[], int]) -> None:
        self.link = link
        self._handed_off = handed_off  # our batches waiting on peers now
        self.live: list[dict[str, Any]] = []
        self._doubted: dict[str, Any] = {}  # node -> the beat (its time_ms) not believed
        self._refused = 0  # beats read and not believed, at the last beat

    def lent(self, model: str) -> float:
        """Executor threads the live peers can lend for ``model`` (0 when Redis is away)."""
        if not self.link.up:
            return 0.0
        ours = self.link.identities.get(model)
        return float(sum(peer["spare"].get(model, 0) for peer in self.live
                         if peer["stealing"] and isinstance(peer.get("spare"), dict)
                         and isinstance(peer.get("identity"), dict)
                         and peer["identity"].get(model) == ours and not self._doubts(peer)))

    def _doubts(self, peer: dict[str, Any]) -> bool:
        node = peer["node"]
        return node in self._doubted and self._doubted[node] == peer.get("time_ms")

    def doubt(self, node: str | None) -> None:
        """A batch offered on a peer's word came back unrun (it declined, or none read
        it): its last beat is stale, as a burst makes every beat before it, so its spare
        threads count again only from its next one. ``None``: every peer's (which one
        let the batch pass is not known)."""
        for peer in self.live:
            if node is None or peer["node"] == node:
                self._doubted[peer["node"]] = peer.get("time_ms")

    def forget(self) -> None:
        """Redis is away: list no peer (their beats cannot be read) until it is back."""
        self.live = []
        self.link.metrics.peers.set(0)

    async def loop(self) -> None:
        settings = self.link.settings
        while True:
            await self.link.up_event.wait()
            try:
                await self.beat()
            except rexc.TimeoutError as error:
                self.link.redis_error(error)  # a stall here or Redis away: the probe tells
            except rexc.RedisError as error:
                self.forget()  # refused: the peers' beats were not read, none is known alive
                self.link.redis_error(error)
            except Exception:
                self.forget()
                log.exception("heartbeat failed")
            await asyncio.sleep(settings.heartbeat_ms / 1000)

    async def beat(self) -> None:
        link, models = self.link, self.link.models
        now_ms = wall_ms()
        ttl_ms = 3 * link.settings.heartbeat_ms + 500  # a busy peer's late beat is not death
        state = {
            "node": link.node, "time_ms": now_ms, "stealing": int(link.stealing),
            "models": orjson.dumps(list(models)), "identity": orjson.dumps(link.identities),
            "depth": orjson.dumps({m: {p: b.depth(i) for i, p in enumerate(PRIORITY_NAMES)}
                                   for m, (_, b) in models.items()}),
            "service_rate": orjson.dumps({m: round(b.rate.items_per_s, 1)
                                          for m, (_, b) in models.items()}),
            "inflight": sum(b.inflight for _, b in models.values()),
            "handed_off": self._handed_off(),
            "spare": orjson.dumps({m: b.spare_threads if link.lending() else 0
                                   for m, (_, b) in models.items()}),
            "quarantined": orjson.dumps(link.quarantine.shared()),
        }
        async with link.cmd.pipeline(transaction=False) as pipe:
            pipe.hset(node_key(link.node), mapping=state)  # type: ignore[arg-type]
            pipe.pexpire(node_key(link.node), ttl_ms)
            pipe.zadd(NODES, {link.node: now_ms})
            pipe.zremrangebyscore(NODES, 0, now_ms - ttl_ms)
            pipe.zrange(NODES, 0, -1)
            *_, nodes = await pipe.execute()
        others = [n.decode() for n in nodes if n.decode() != link.node]
        async with link.cmd.pipeline(transaction=False) as pipe:
            for other in others:
                pipe.hgetall(node_key(other))
            # A key of another type (WRONGTYPE) fails only its own beat, not every peer's.
            states = await pipe.execute(raise_on_error=False) if others else []
        self.live = [peer for peer in map(_peer, states) if peer is not None]
        refused = sum(1 for state in states if state) - len(self.live)  # not expired: refused
        if refused != self._refused:  # said when it changes, not at every beat
            self._refused = refused
            if refused:
                log.warning("%d peer heartbeat(s) in Redis refused: not what Vega writes, "
                            "or over %d bytes", refused, MAX_BEAT_BYTES)
        for peer in self.live:  # what took a peer's process down, with the same model
            for model, digests in peer["quarantined"].items():
                if model in link.identities and \
                        peer["identity"].get(model) == link.identities[model]:
                    link.quarantine.adopt(model, digests)
        beats = {peer["node"]: peer["time_ms"] for peer in self.live}
        self._doubted = {node: beat for node, beat in self._doubted.items()
                         if beats.get(node) == beat}  # a newer beat is believed again
        link.metrics.peers.set(len(self.live))

    async def leave(self) -> None:
        """Say goodbye: peers stop counting on us at once, not a TTL later."""
        try:
            await self.link.cmd.delete(node_key(self.link.node))
            await self.link.cmd.zrem(NODES, self.link.node)
        except rexc.RedisError:
            pass


def _peer(state: dict[bytes, bytes] | Exception) -> dict[str, Any] | None:
    """A heartbeat as /v1/status shows it; None if it expired or does not parse.

    Every request's admission sums ``spare`` (``lent``): a value that is not a finite,
    non-negative number (a string raises there, a negative one can zero a share that is
    divided by) is dropped here, as are models and identities of the wrong type."""
    if not isinstance(state, dict) or sum(len(value) for value in state.values()) > \
            MAX_BEAT_BYTES:
        return None  # parsed at every beat and shown in /v1/status: a peer's is a few KB
    try:
        beat_ms = int(state[b"time_ms"])
        models = orjson.loads(state[b"models"])
        spare = orjson.loads(state.get(b"spare", b"{}"))
        identity = orjson.loads(state.get(b"identity", b"{}"))
        quarantined = orjson.loads(state.get(b"quarantined", b"{}"))
        return {"node": state[b"node"].decode(), "time_ms": beat_ms,
                "age_ms": wall_ms() - beat_ms,
                "models": [m for m in models if isinstance(m, str)]
                if isinstance(models, list) else [],
                "depth": orjson.loads(state[b"depth"]),
                "service_rate": orjson.loads(state[b"service_rate"]),
                "inflight": int(state[b"inflight"]), "stealing": state[b"stealing"] == b"1",
                "spare": {m: n for m, n in spare.items() if _threads(n)}
                if isinstance(spare, dict) else {},
                "identity": identity if isinstance(identity, dict) else {},
                "quarantined": quarantined if isinstance(quarantined, dict) else {}}
    except (KeyError, ValueError, orjson.JSONDecodeError):
        return None


MAX_BEAT_BYTES = 1 << 20
MAX_SPARE = 4096  # threads a peer may lend a model: past it, a beat is not believed


def _threads(value: Any) -> bool:
    """Whether a heartbeat's count of spare threads is one: a number from 0 to MAX_SPARE."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        0 <= value <= MAX_SPARE
