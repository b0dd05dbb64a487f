"""Idempotency keys: a repeated request gets the first answer; the model runs once.

A client names an attempt with an ``Idempotency-Key`` header (IETF httpapi draft).
Within ``VEGA_IDEMPOTENCY_TTL_S`` a repeat with the same key and model gets the
answer the first attempt got; a repeat that arrives while the first is running
waits for it (single-flight) rather than running again, bounded by its own
deadline. The same key with a different body is refused (422 ``invalid_input``).
An attempt that was refused (429/503), expired (504) or failed (5xx), or whose
caller went away, is not remembered: a retry with that key is a fresh attempt. A
refusal turned into a job (``Prefer: respond-async``) is remembered as that job's 202.

In one process, waiters hold the first attempt's future. Across processes, through
Redis when ``VEGA_REDIS_URL`` is set: the first attempt takes
``vega:{model}:idem:<digest>`` with ``SET NX PX`` (expiring with its deadline, so a
dead owner frees it), replaces it with the stored answer when done (unless a peer holds
it by then), and deletes it (only if still its own) when not remembered. A ``SET NX``
that timed out may have landed: the attempt then runs here and publishes all the same.
A repeat on another process reads that key, polling with a short backoff while it says
"running". Values are orjson; when Redis is away each process keeps its own keys.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from vega.calls import Reply, stored_reply
from vega.channel.client import Client, SideRedis, Unavailable
from vega.channel.keys import idempotency_key
from vega.errors import VegaError, invalid_input
from vega.httpio import kept
from vega.metrics import Metrics

log = logging.getLogger("vega.pressure.idempotency")

KEY_PATTERN = re.compile(r'"?([\x21\x23-\x7e]{1,255})"?')  # sf-string content, quotes optional
# Answers that a retry of the same body would get again; 202: the job a refusal became
# (``Prefer: respond-async``), which a retry must not run again.
REMEMBERED = frozenset({200, 202, 404, 422})
POLL_FIRST_S, POLL_MAX_S = 0.005, 0.05  # a remote waiter's polling backoff
LOCK_MARGIN_S = 2.0  # a running attempt's Redis lock outlives its deadline by this much
# An answer Redis did not take (a stall, an outage) is offered again for this long.
REPUBLISH_FIRST_S, REPUBLISH_MAX_S, REPUBLISH_FOR_S = 0.25, 2.0, 30.0

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
# The answer replaces our lock, or a lock gone; never a peer's (it publishes its own).
_PUBLISH = """
local held = redis.call('get', KEYS[1])
if held == false or held == ARGV[1] then
  return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 0
"""


@dataclass(eq=False)
class _Entry:
    fingerprint: str
    answer: asyncio.Future[Reply | None]  # None: released, a waiter tries afresh
    expires_at: float = float("inf")  # set once answered


@dataclass(eq=False)
class Claim:
    """Either a stored answer to replay, or the right (and duty) to run the attempt."""

    replay: Reply | None = None
    slot: str = ""
    token: bytes = b""  # our value of the Redis lock, when we hold it
    redis_key: str = ""
    entry: _Entry | None = field(default=None, repr=False)


def fingerprint(doc: Any) -> str:
    """The body as parsed, canonically re-serialised and hashed."""
    try:
        canonical = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # past orjson's 254 levels, which its parser allows
        raise invalid_input("the body is nested too deeply") from None
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


def parse_key(header: str | None) -> str | None:
    """The key an ``Idempotency-Key`` header names, None without one; 422 when malformed."""
    if header is None:
        return None
    match = KEY_PATTERN.fullmatch(header.strip())
    if match is None:
        raise invalid_input("Idempotency-Key must be 1-255 printable ASCII characters")
    return match.group(1)


def conflict() -> VegaError:
    """422 for a key already used with another body (here, and by the job stores)."""
    return invalid_input("this Idempotency-Key was used with a different request body")


def redis_key(model: str, key: str) -> str:
    return idempotency_key(model, hashlib.blake2b(key.encode(), digest_size=16).hexdigest())


class Idempotency:
    def __init__(self, ttl_s: float, max_keys: int, metrics: Metrics,
                 redis: SideRedis | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self.metrics = metrics
        self.redis = redis
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._republishing: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def key_of(self, header: str | None) -> str | None:
        """The header's key, or None when absent or switched off; 422 when malformed."""
        return None if header is None or not self.enabled else parse_key(header)

    async def claim(self, model: str, key: str, print_: str, deadline: float) -> Claim:
        """Replay the first answer, wait for it, or become the attempt that runs."""
        loop = asyncio.get_running_loop()
        slot = f"{model}\x00{key}"
        waited = False  # a repeat is counted once: it waited for an attempt, or replayed
        while True:
            entry = self._live(slot, loop.time())
            if entry is None:
                break
            if entry.fingerprint != print_:
                raise conflict()
            if not entry.answer.done():
                if not waited:
                    self.metrics.idempotent.labels(model, "waited").inc()
                    waited = True
                await _wait(entry.answer, deadline)
                continue
            reply = entry.answer.result()
            if reply is not None:
                if not waited:
                    self.metrics.idempotent.labels(model, "replayed").inc()
                return Claim(replay=reply)
        entry = _Entry(print_, loop.create_future())
        self._entries[slot] = entry
        claim = Claim(slot=slot, entry=entry)
        if self.redis is not None and self.redis.up:
            try:
                claim.replay = await self._claim_shared(claim, model, key, print_, deadline)
            except BaseException:
                self._settle(claim, None)
                raise
            if claim.replay is not None:
                self._settle(claim, claim.replay)
                if not waited:
                    self.metrics.idempotent.labels(model, "replayed").inc()
        return claim

    async def finish(self, claim: Claim, reply: Reply | None) -> None:
        """Record the attempt's answer (or forget the key when ``reply`` is not kept)."""
        keep = dataclasses.replace(reply, body=kept(reply.body)) \
            if reply is not None and reply.status in REMEMBERED else None
        self._settle(claim, keep)
        if claim.token and self.redis is not None:
            # Shielded: a caller cancelled now must not cancel a Redis command.
            await asyncio.shield(asyncio.ensure_future(self._publish(claim, keep)))

    # -- in this process -------------------------------------------------------------

    def _live(self, slot: str, now: float) -> _Entry | None:
        entry = self._entries.get(slot)
        if entry is not None and entry.expires_at <= now:
            del self._entries[slot]
            return None
        return entry

    def _settle(self, claim: Claim, reply: Reply | None) -> None:
        entry = claim.entry
        if entry is None or entry.answer.done():
            return
        entry.answer.set_result(reply)
        if reply is None:
            if self._entries.get(claim.slot) is entry:
                del self._entries[claim.slot]
            return
        entry.expires_at = asyncio.get_running_loop().time() + self.ttl_s
        self._entries.move_to_end(claim.slot)
        while len(self._entries) > self.max_keys:
            slot, oldest = next(iter(self._entries.items()))
            if not oldest.answer.done():
                break  # running attempts are bounded by the requests in flight
            del self._entries[slot]

    # -- across processes ------------------------------------------------------------

    async def _claim_shared(self, claim: Claim, model: str, key: str, print_: str,
                            deadline: float) -> Reply | None:
        assert self.redis is not None
        loop = asyncio.get_running_loop()
        rkey = redis_key(model, key)
        token = orjson.dumps({"fp": print_, "state": "running", "owner": os.urandom(8).hex()})
        pause = POLL_FIRST_S
        while True:
            lock_ms = max(1, int(1000 * (deadline - loop.time() + LOCK_MARGIN_S)))
            try:
                taken = await self.redis.run(functools.partial(
                    _set_if_absent, key=rkey, value=token, px=lock_ms))
            except Unavailable as away:
                if away.maybe_ran:
                    # The lock may be ours: the answer is then published over it (or the
                    # lock released), not left "running" to hold peers' repeats till it expires.
                    claim.token, claim.redis_key = token, rkey
                return None  # run here; this process alone remembers the key
            if taken:
                claim.token, claim.redis_key = token, rkey
                return None
            try:
                raw = await self.redis.run(lambda r: r.get(rkey))
            except Unavailable:
                return None
            if raw is None:
                continue  # released or expired between SET and GET: try again
            doc = _record(raw, rkey)
            if doc.get("fp") != print_:
                raise conflict()
            if doc.get("state") == "done":
                return _replay(doc, rkey)
            if loop.time() + pause >= deadline:
                raise _still_running()
            await asyncio.sleep(pause)
            pause = min(POLL_MAX_S, 2 * pause)

    async def _publish(self, claim: Claim, reply: Reply | None) -> None:
        assert self.redis is not None
        rkey, token = claim.redis_key, claim.token
        if reply is None:
            args: tuple[Any, ...] = (_RELEASE, 1, rkey, token)
        else:
            value = orjson.dumps({"fp": claim.entry.fingerprint if claim.entry else "",
                                  "state": "done", "reply": reply.encode()})
            args = (_PUBLISH, 1, rkey, token, value, max(1, int(1000 * self.ttl_s)))
        try:
            await self.redis.run(lambda r: r.eval(*args))
        except Unavailable:
            # Else peers' repeats wait on "running" until the lock expires, then run the
            # model again. The scripts check the token: a late offer is never wrong.
            if len(self._republishing) < self.max_keys:
                task = asyncio.ensure_future(self._publish_later(args))
                self._republishing.add(task)
                task.add_done_callback(self._republishing.discard)

    async def _publish_later(self, args: tuple[Any, ...]) -> None:
        assert self.redis is not None
        loop = asyncio.get_running_loop()
        pause, end = REPUBLISH_FIRST_S, loop.time() + REPUBLISH_FOR_S
        while loop.time() + pause < end:
            await asyncio.sleep(pause)
            pause = min(REPUBLISH_MAX_S, 2 * pause)
            try:
                await self.redis.run(lambda r: r.eval(*args))
                return
            except Unavailable:
                continue

    async def close(self) -> None:
        """Stop offering answers Redis did not take (the process is stopping)."""
        for task in list(self._republishing):
            task.cancel()
        await asyncio.gather(*self._republishing, return_exceptions=True)


async def _set_if_absent(client: Client, key: str, value: bytes, px: int) -> bool:
    return bool(await client.set(key, value, nx=True, px=px))


async def _wait(answer: asyncio.Future[Reply | None], deadline: float) -> None:
    """Until the first attempt answers, or 504 at our own deadline."""
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining > 0:
        await asyncio.wait({answer}, timeout=remaining)
    if not answer.done():
        raise _still_running()


def _record(raw: Any, rkey: str) -> dict[str, Any]:
    """A key's shared record; 500 (logged) where it is none that Vega wrote."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise _unreadable(rkey)
    return doc


def _replay(doc: dict[str, Any], rkey: str) -> Reply:
    """A record's answer, if it is one this process could send (not run again: the first
    attempt's effects stand)."""
    reply = stored_reply(doc.get("reply"))
    if reply is None or reply.status not in REMEMBERED:
        raise _unreadable(rkey)
    return reply


def _unreadable(rkey: str) -> VegaError:
    log.warning("idempotency record %s in Redis is not one Vega wrote", rkey)
    return VegaError("internal_error", "this Idempotency-Key's shared record cannot be read")


def _still_running() -> VegaError:
    return VegaError("deadline_exceeded",
                     "the first request with this Idempotency-Key did not answer in time")
