"""The thief's side of overflow: steal batches when idle, run them, reply; reclaim.

A process reads its model's overflow group only while it has nothing of its own to
do, runs a stolen batch only if the entry's deadline leaves time for it, and answers
on the origin's reply stream in one transaction with the acknowledgement. Entries a
dead thief left pending are put back (``attempt + 1``) or, past
``VEGA_MAX_ATTEMPTS``, dead-lettered. A malformed entry is dead-lettered, never run; a
well-formed one this process cannot take (another version of its model, more items
than its ``VEGA_MAX_BATCH_SIZE``, a sample its model refuses) is declined, so that its
origin runs it at once instead of waiting for an answer to its last call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from typing import Any

from redis import exceptions as rexc

from vega.channel.client import CONNECTION_ERRORS
from vega.channel.keys import (
    BLOCK_MS,
    GROUP,
    REPLY_TTL_MS,
    blocking_timeout_s,
    dlq_key,
    done_key,
    overflow_key,
    reply_key,
)
from vega.channel.link import Link
from vega.channel.wire import (
    Overflow,
    Reply,
    WireError,
    decode_overflow,
    encode_overflow,
    encode_reply,
    wall_ms,
)
from vega.errors import VegaError
from vega.records import NORMAL, Batch, Item

log = logging.getLogger("vega.streams")

UNRUN = ("not_ready", "draining")  # refusals of a batch that never began: not model errors


class Thief:
    """Steal and reclaim loops of one process, over its end of the side channel."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self._running: set[Any] = set()  # ids of stolen entries running here

    async def steal_loop(self, model: str) -> None:
        """Read the group only while this process has nothing of its own to do."""
        client = self.link.client(blocking_timeout_s(self.link.timeout_s))
        key = overflow_key(model)
        try:
            while True:
                await self.link.up_event.wait()
                await self._idle()
                try:
                    got: Any = await client.xreadgroup(GROUP, self.link.node, {key: ">"}, count=1,
                                                       block=BLOCK_MS)
                except rexc.ResponseError as error:
                    await self._group_lost(model, error)
                    continue
                except rexc.RedisError as error:
                    self.link.redis_error(error)
                    continue
                for _stream, entries in got or []:
                    for entry_id, fields in entries:
                        # The read blocked while idle; work of our own may have arrived since
                        # (even the batch we just handed off): not ours to run now.
                        work = (self._steal(model, entry_id, fields) if self._idle_now()
                                else self._decline_busy(model, entry_id, fields))
                        await self._guarded(work, model, entry_id, fields)
        finally:
            await client.aclose()

    async def _group_lost(self, model: str, error: rexc.ResponseError) -> None:
        """Redis restarted empty (NOGROUP) or refused the read: recreate, slow down."""
        log.warning("overflow read for %s refused: %s", model, error)
        try:
            await self.link.ensure_group(model)
        except rexc.RedisError as again:
            self.link.redis_error(again)
        await asyncio.sleep(BLOCK_MS / 1000)

    def _idle_now(self) -> bool:
        return self.link.lending() and not any(b.depth() or b.inflight
                                               for _, b in self.link.models.values())

    async def _idle(self) -> None:
        if not self.link.stealing:
            await asyncio.Event().wait()  # a draining process never steals again
        while not self.link.runnable():  # its model process is restarting
            await asyncio.sleep(BLOCK_MS / 1000)
        while any(b.depth() or b.inflight for _, b in self.link.models.values()):
            for _, batcher in self.link.models.values():
                await batcher.wait_idle()

    async def _guarded(self, work: Awaitable[None], model: str, entry_id: Any,
                       fields: Any) -> None:
        """A hostile entry must never take a loop down: dead-letter it and go on."""
        try:
            await work
        except CONNECTION_ERRORS as error:
            self.link.redis_error(error)
        except WireError as error:
            self.link.metrics.overflow_events.labels("malformed").inc()
            log.warning("malformed overflow entry %r: %s", entry_id, error)
            await self._dead_letter(model, entry_id, fields, f"malformed: {error}")
        except Exception as error:
            log.exception("overflow entry %r failed", entry_id)
            await self._dead_letter(model, entry_id, fields, f"error: {error!r}")

    async def _steal(self, model: str, entry_id: Any, fields: Any) -> None:
        entry = decode_overflow(fields)  # the schema: an entry that fails it is dead-lettered
        if entry.model != model:
            raise WireError(f"entry for model {entry.model!r} on the stream of {model!r}")
        if await self.link.cmd.exists(done_key(model, entry.batch)):
            await self._ack(model, entry_id)  # the origin answered it already
            return
        refused = self._refusal(model, entry)
        if refused:  # a well-formed batch this process cannot take: its origin runs it
            await self._reply(entry, entry_id, Reply(entry.batch, self.link.node, 0.0, (),
                                                     "declined", refused))
            return
        remaining_ms = entry.deadline_ms - wall_ms() - self.link.settings.clock_skew_ms
        batcher = self.link.models[model][1]
        bucket = batcher.bucket_of(entry.pad_to)
        run_ms = 1000 * batcher.times.predict(bucket, len(entry.lengths))
        if remaining_ms < run_ms + self.link.settings.deadline_margin_ms:
            await self._reply(entry, entry_id, Reply(entry.batch, self.link.node, 0.0, (),
                                                     "declined", "cannot finish in time"))
            return
        if entry.origin == self.link.node:  # our own batch, and we are idle: no round trip
            await self._ack(model, entry_id)
            self.link.take_back(entry.batch, "idle again")
            return
        self.link.metrics.overflow.labels("in").inc()
        self.link.counts["taken"] += 1
        self._running.add(entry_id)
        try:
            await self._run_stolen(entry, entry_id, bucket, remaining_ms)
        finally:
            self._running.discard(entry_id)

    async def _run_stolen(self, entry: Overflow, entry_id: Any, bucket: int,
                          remaining_ms: float) -> None:
        model = entry.model
        loop = asyncio.get_running_loop()
        now = loop.time()
        items = [Item(sample=sample, length=length, priority=NORMAL,
                      deadline=now + remaining_ms / 1000, future=loop.create_future(),
                      enqueued_at=now, bucket=bucket)
                 for sample, length in zip(entry.samples, entry.lengths)]
        pad = self.link.models[model][1].config.pad  # a compiled model's rounding, as its origin's
        batch = Batch(model=model, bucket=bucket, items=items,
                      pad_to=entry.pad_to if pad is None else pad(entry.pad_to))
        await self.link.run_local(batch)
        # Each failed item's exception read, not only the first: asyncio logs every one
        # left unread, a line per item of every batch the model raised on.
        failed = [item.future.exception() for item in items
                  if item.future.done() and not item.future.cancelled()]
        error = next((e for e in failed if e is not None), None)
        if isinstance(error, VegaError) and error.code in UNRUN:  # the origin runs it
            reply = Reply(entry.batch, self.link.node, 0.0, (), "declined", error.message)
        elif error is not None or not all(item.future.done() for item in items):
            reply = Reply(entry.batch, self.link.node, 1000 * batch.infer_s, (), "model_error",
                          str(error or "no answer"))
        else:
            reply = Reply(entry.batch, self.link.node, 1000 * batch.infer_s,
                          tuple(item.future.result() for item in items))
        await self._reply(entry, entry_id, reply)

    def _refusal(self, model: str, entry: Overflow) -> str:
        """Why this process cannot run ``entry``, or "": another version of its model, or
        limits of its own (a smaller VEGA_MAX_BATCH_SIZE, a sample its model refuses)."""
        if entry.identity != self.link.identities[model]:  # another deploy's model
            return "another version or weights"
        adapter, batcher = self.link.models[model]
        if len(entry.lengths) > batcher.config.max_batch_size:
            return (f"{len(entry.lengths)} items, more than VEGA_MAX_BATCH_SIZE here "
                    f"({batcher.config.max_batch_size})")
        for sample, length in zip(entry.samples, entry.lengths):
            try:
                _, checked = adapter.decode(sample)
            except VegaError as error:
                return f"a sample the model refuses here: {error.message}"
            if checked != length:
                return "a sample's length is not the one given"
        return ""

    async def _reply(self, entry: Overflow, entry_id: Any, reply: Reply) -> None:
        """Answer, mark done and acknowledge in one transaction.

        In a Redis Cluster the origin's reply stream is in another slot than the model's
        keys: the answer goes first, then the rest; a thief dying between the two leaves
        the entry pending, and a second run's reply is dropped by the origin as late.
        """
        ttl_ms = self.link.done_ttl_ms((entry.deadline_ms - wall_ms()) / 1000)
        async with self.link.cmd.pipeline(transaction=True) as pipe:
            pipe.xadd(reply_key(entry.origin), encode_reply(reply),  # type: ignore[arg-type]
                      maxlen=self.link.settings.stream_maxlen, approximate=True)
            pipe.pexpire(reply_key(entry.origin), REPLY_TTL_MS)
            if self.link.sharded:
                await pipe.execute()
            pipe.set(done_key(entry.model, entry.batch), self.link.node, nx=True, px=ttl_ms)
            pipe.xack(overflow_key(entry.model), GROUP, entry_id)
            pipe.xdel(overflow_key(entry.model), entry_id)
            await pipe.execute()

    async def _ack(self, model: str, entry_id: Any) -> None:
        async with self.link.cmd.pipeline(transaction=True) as pipe:
            pipe.xack(overflow_key(model), GROUP, entry_id)
            pipe.xdel(overflow_key(model), entry_id)
            await pipe.execute()

    async def _dead_letter(self, model: str, entry_id: Any, fields: Any, reason: str) -> None:
        """Keep the entry for a person to look at, out of every reader's way."""
        self.link.metrics.overflow_events.labels("dead_lettered").inc()
        kept: dict[Any, Any] = {b"kind": b"overflow", b"reason": reason[:500], b"entry": entry_id,
                                b"by": self.link.node}
        if isinstance(fields, dict) and sum(len(k) + len(v) for k, v in fields.items()) < 1 << 20:
            kept.update({b"field:" + bytes(k)[:64]: v for k, v in fields.items()})
        try:
            async with self.link.cmd.pipeline(transaction=True) as pipe:
                pipe.xadd(dlq_key(model), kept, maxlen=self.link.settings.stream_maxlen,
                          approximate=True)
                pipe.xack(overflow_key(model), GROUP, entry_id)
                pipe.xdel(overflow_key(model), entry_id)
                await pipe.execute()
        except rexc.RedisError as error:
            self.link.redis_error(error)

    # -- crash recovery: entries a dead thief left pending -----------------------------

    async def reclaim_loop(self) -> None:
        while True:
            await asyncio.sleep(self.link.settings.claim_idle_ms / 2000)
            await self.link.up_event.wait()
            for model in self.link.models:
                try:
                    await self._reclaim(model)
                except rexc.RedisError as error:
                    self.link.redis_error(error)
                except Exception:
                    log.exception("reclaim of %s failed", model)

    async def _reclaim(self, model: str) -> None:
        _next, entries, *_deleted = await self.link.cmd.xautoclaim(
            overflow_key(model), GROUP, self.link.node, self.link.settings.claim_idle_ms, "0-0",
            count=16)
        for entry_id, fields in entries:
            # Our own entry, still running (a slow batch): claiming it again only reset its
            # idle time. A hung one is the origin's to time out.
            if fields is not None and entry_id not in self._running:
                await self._guarded(self._requeue(model, entry_id, fields), model, entry_id,
                                    fields)

    async def _requeue(self, model: str, entry_id: Any, fields: Any) -> None:
        """Put a dead thief's batch back in the stream, once per attempt, then dead-letter it."""
        entry = decode_overflow(fields)
        if await self.link.cmd.exists(done_key(model, entry.batch)) or \
                entry.deadline_ms - wall_ms() + self.link.settings.clock_skew_ms <= 0:
            await self._ack(model, entry_id)  # answered, or its origin has answered 504
            self.link.metrics.overflow_events.labels("expired").inc()
            return
        if entry.attempt >= self.link.settings.max_attempts:
            await self._dead_letter(model, entry_id, fields,
                                    f"no answer after {entry.attempt} attempts")
            await self._reply(entry, entry_id, Reply(
                entry.batch, self.link.node, 0.0, (), "dead_letter",
                f"batch lost on peers {entry.attempt} times; dead-lettered"))
            return
        self.link.metrics.overflow_events.labels("reclaimed").inc()
        await self._reinsert(model, entry_id,
                             encode_overflow(dataclasses.replace(entry, attempt=entry.attempt + 1)))

    async def _decline_busy(self, model: str, entry_id: Any, fields: Any) -> None:
        """A batch read by a process that is busy now. A peer's is declined: its origin
        takes it back at once, with its deadline nearly whole (put back in the stream, it
        waited for another reader, and its origin for an answer, until the deadline all but
        ran out). Our own goes back in the stream for an idle peer, and our hand-off is
        told its new id, so that the take-back check looks at the copy peers can read."""
        # The schema check only (a hostile entry is dead-lettered): the samples are not
        # run here, so the model's check of each would be loop time for nothing.
        entry = decode_overflow(fields)
        if entry.origin == self.link.node:
            self.link.reposted(entry.batch, await self._reinsert(model, entry_id, fields))
            return
        await self._reply(entry, entry_id, Reply(entry.batch, self.link.node, 0.0, (), "declined",
                                                 "busy"))

    async def _reinsert(self, model: str, entry_id: Any, again: Any) -> Any:
        """Put an entry back under a new id (returned), and the old one away."""
        async with self.link.cmd.pipeline(transaction=True) as pipe:
            pipe.xadd(overflow_key(model), again,
                      maxlen=self.link.settings.stream_maxlen, approximate=True)
            pipe.xack(overflow_key(model), GROUP, entry_id)
            pipe.xdel(overflow_key(model), entry_id)
            new_id, *_ = await pipe.execute()
        return new_id
