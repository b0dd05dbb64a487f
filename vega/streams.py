"""Overflow between processes through Redis Streams: hand off, steal, reply, reclaim.

A side channel (DESIGN.md "Redis layout", rules 7-9). The runtime offers each formed
batch here; when the local wait is long, peers are alive and the deadline allows,
the batch goes to ``vega:{model}:overflow`` and its futures wait in ``_pending`` (put
there before the XADD). Idle peers read the stream through the ``workers`` group, run
the batch and answer on ``vega:reply:<origin>``, which one task here reads (the
thief's side is vega/channel/steal.py). The origin owns the timeout: a batch not answered in
time is taken back and run locally, or failed with 504. Redis away means everything
runs locally until it is back. This module holds the origin's side and the connection's
ups and downs; both sides share one ``vega.channel.link.Link``, the heartbeats are
vega/channel/peers.py, and what is kept of a batch out is vega/channel/handoff.py.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any

from redis import exceptions as rexc

from vega.channel.client import CONNECTION_ERRORS, Client, StallCheck, leave_group, probe, said
from vega.channel.handoff import DELETE_UNLESS_DELIVERED, Handoff
from vega.channel.keys import (
    BLOCK_MS,
    GROUP,
    blocking_timeout_s,
    done_key,
    overflow_key,
    reply_key,
)
from vega.channel.link import Link, Models, RunLocal, log_end, stop_tasks
from vega.channel.peers import PENDING_PER_SPARE, Peers
from vega.channel.steal import Thief
from vega.channel.wire import (
    Overflow,
    Reply,
    WireError,
    batch_of,
    decode_reply,
    encode_overflow,
    wall_ms,
)
from vega.config import Settings
from vega.errors import VegaError, missed_deadline
from vega.metrics import Metrics
from vega.pressure.looplag import LoopLag
from vega.quarantine import WENT_DOWN
from vega.records import Batch

log = logging.getLogger("vega.streams")

REPLY_CODES = frozenset({"model_error", "declined", "dead_letter"})


class Streams:
    """The origin's side of overflow, and the loops of both sides."""

    def __init__(self, settings: Settings, node: str, metrics: Metrics, models: Models,
                 run_local: RunLocal, lag: LoopLag | None = None,
                 runnable: Callable[[], bool] = lambda: True) -> None:
        self.link = link = Link(settings, node, metrics, models, run_local, runnable)
        link.on_error, link.take_back = self.redis_error, self._take_back
        link.reposted = self._reposted
        self._boot = os.urandom(4).hex()
        self._margin_s = settings.deadline_margin_ms / 1000
        self._pending: dict[str, Handoff] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._spawned: set[asyncio.Task[Any]] = set()
        self._connecting: asyncio.Task[None] | None = None
        self._timeouts = StallCheck(lambda: probe(self.link.cmd), self._lost,
                                    metrics.overflow_events.labels("stalled").inc, self._spawn)
        self._reply_from = "$"
        self.rtt_s = 0.005  # replaced by measurements
        self._check_s = 0.0  # an unclaimed check's round trip: the longest lately seen
        self._lag = lag  # this process's loop: how late it runs now
        self._answered_at = -math.inf  # loop clock: when a peer last answered a batch of ours
        self.heart = Peers(link, lambda: len(self._pending))
        self.thief = Thief(link)
        metrics.redis_up.set(0)

    @property
    def up(self) -> bool:
        return self.link.up

    # Views of the link's own, for /v1/status, tests and scripts/bench-steal-latency.
    @property
    def counts(self) -> dict[str, int]:
        return self.link.counts

    @property
    def cmd(self) -> Client:
        return self.link.cmd

    @property
    def metrics(self) -> Metrics:
        return self.link.metrics

    @property
    def stealing(self) -> bool:
        return self.link.stealing

    @stealing.setter
    def stealing(self, value: bool) -> None:
        self.link.stealing = value

    @property
    def peers(self) -> list[dict[str, Any]]:
        """The live peers, as their last heartbeats say (what /v1/status shows)."""
        return self.heart.live

    @peers.setter
    def peers(self, value: list[dict[str, Any]]) -> None:
        self.heart.live = value

    def lent(self, model: str) -> float:
        """Executor threads the live peers say they lend ``model`` (0 with Redis away)."""
        return self.heart.lent(model)

    def room(self, model: str) -> bool:
        """Whether a batch handed off now would be taken: fewer are waiting than peers lend."""
        return len(self._pending) < PENDING_PER_SPARE * self.lent(model)

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background (the process serves locally meanwhile), start the loops."""
        self._reconnect()
        loops: list[tuple[str, Awaitable[None]]] = [
            ("replies", self._reply_loop()), ("reclaim", self.thief.reclaim_loop()),
            ("heartbeat", self.heart.loop())]
        loops += [(f"steal-{m}", self.thief.steal_loop(m)) for m in self.link.models]
        for name, loop in loops:
            task = asyncio.ensure_future(loop)
            task.set_name(f"streams-{name}")
            task.add_done_callback(log_end)
            self._tasks.append(task)

    async def stop(self) -> None:
        """After drain: stop stealing and reading, hand back what is still out, close."""
        self.stealing = False
        for key in list(self._pending):
            self._take_back(key, "stopping")
        tasks = self._tasks + list(self._spawned)
        if self._connecting is not None:
            tasks.append(self._connecting)
        # Shutdown, not the hot path: dropping a blocked read is fine. Bounded: a stuck
        # close must not keep the process from exiting.
        stuck = await stop_tasks(tasks, timeout_s=blocking_timeout_s(self.link.timeout_s) + 1)
        if stuck:
            log.warning("%d overflow task(s) did not stop in time", len(stuck))
        elif self.up:
            for model in self.link.models:
                await leave_group(self.link.cmd, overflow_key(model), GROUP, self.link.node)
        await self.heart.leave()
        await self.link.cmd.aclose()

    def _spawn(self, work: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        task.add_done_callback(log_end)
        return task

    # -- Redis up and down ---------------------------------------------------------

    def _lost(self, error: BaseException) -> None:
        """Redis stopped answering: serve locally, take our batches back, reconnect."""
        if not self.up:
            return
        log.warning("redis unreachable (%s): serving locally, reconnecting", said(error))
        self.link.up_event.clear()
        self.link.metrics.redis_up.set(0)
        self.heart.forget()  # no beat can be read: none is believed alive
        for key in list(self._pending):
            self._take_back(key, "redis_down")
        self._reconnect()

    def _reconnect(self) -> None:
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(log_end)

    async def _connect(self) -> None:
        self.rtt_s, server_ms = await self.link.reach()
        if self._reply_from == "$":  # replies from now on, even before the reader reads
            self._reply_from = f"{server_ms}-0"
        log.info("redis up: overflow on for %s", ", ".join(self.link.models))
        self.link.metrics.redis_up.set(1)
        self.link.up_event.set()

    # -- the origin: hand off, replies, take back ----------------------------------

    async def offer(self, batch: Batch, local_wait_s: float) -> bool:
        """Hand ``batch`` to peers if that should answer it sooner; False = run it locally."""
        # Asked again though the runtime just asked: batches formed in one loop turn all
        # pass that check before any of them is pending here, and capacity counts those.
        if not self.worth_handing_off(batch, local_wait_s):
            return False
        link, loop = self.link, asyncio.get_running_loop()
        now = loop.time()
        batcher = link.models[batch.model][1]
        run_s = batcher.times.predict(batch.bucket, batch.size)
        key = f"{link.node}.{self._boot}.{batch.id}"
        lengths = tuple(item.length for item in batch.items)
        try:  # the longest length: a thief of the same model pads it as our batcher did
            fields = encode_overflow(Overflow(
                origin=link.node, batch=key, model=batch.model,
                identity=link.identities[batch.model],
                deadline_ms=wall_ms() + int(1000 * (batch.deadline - now)), sent_ms=wall_ms(),
                attempt=1, pad_to=max(lengths), lengths=lengths,
                samples=tuple(item.sample for item in batch.items)))
        except WireError:
            return False
        handoff = Handoff(batch, sent_at=now)
        # Rule 8: the future is registered before the XADD. Rule 7: the origin's own
        # timer takes the batch back while running it locally can still make it (the
        # timer fires as late as the loop runs); and once it would have started here,
        # if no peer has claimed it (a heartbeat said a peer was free, and it was not),
        # so a wrong guess costs a round trip at most.
        self._pending[key] = handoff
        handoff.last_call = batch.deadline - run_s - 2 * self._margin_s - self._late_s()
        handoff.check_at = min(self._ask_by(handoff), now + local_wait_s + self.round_trip_s())
        handoff.timer = loop.call_at(handoff.check_at, self._unclaimed, key)
        try:
            handoff.entry_id = await link.cmd.xadd(
                overflow_key(batch.model), fields,  # type: ignore[arg-type]
                maxlen=link.settings.stream_maxlen, approximate=True)
        except rexc.RedisError as error:
            handoff.timer.cancel()
            if self._pending.pop(key, None) is None:
                return True  # taken back meanwhile: Redis lost, or the _unclaimed timer
            if isinstance(error, rexc.TimeoutError):  # it may have landed: no peer may run it
                self._spawn(self._forget(batch.model, key, None, batch.deadline))
            self.redis_error(error)
            return False
        link.metrics.overflow.labels("out").inc()
        link.counts["offered"] += 1
        if key not in self._pending:  # taken back while the XADD was on its way
            self._spawn(self._forget(batch.model, key, handoff.entry_id, batch.deadline))
        return True

    def worth_handing_off(self, batch: Batch, local_wait_s: float) -> bool:
        """Whether peers should be offered ``batch`` (a cheap check, no Redis round trip)."""
        if not self.up or batch.model not in self.link.models:
            return False
        # A peer can take it sooner when the wait here is longer than the round trip
        # (an idle peer has no queue of its own); each lent thread gets one batch to run
        # and one waiting in the stream, so it never idles between them.
        round_trip_s = self.round_trip_s()
        if local_wait_s <= round_trip_s + self.link.settings.overflow_threshold_ms / 1000:
            return False
        if not self.room(batch.model):
            return False
        run_s = self.link.models[batch.model][1].times.predict(batch.bucket, batch.size)
        remaining_s = batch.deadline - asyncio.get_running_loop().time()
        # Room for a remote attempt and, if that fails, a local one.
        return remaining_s > round_trip_s + 2 * run_s + 2 * self._margin_s + self._late_s()

    def round_trip_s(self) -> float:
        """What a hand-off's round trip takes now: the measured one, or the two turns of
        this process's loop it needs (the XADD's reply, the answer's read) while the
        loop runs late, whichever is longer. A reply measures the late loop only once a
        peer answers, and at a burst's onset none may."""
        return max(self.rtt_s, 2 * self._late_s())

    def _late_s(self) -> float:
        return self._lag.lag_s if self._lag is not None else 0.0

    def _ask_by(self, handoff: Handoff) -> float:
        """When the unclaimed check must be asked for its answer to be back by the last call:
        a check's round trip before it, as long as the longest lately seen (a loaded host
        stretches one to tens of ms), a steal's round trip at least."""
        return handoff.last_call - max(self._check_s, self.round_trip_s())

    def _unclaimed(self, key: str) -> None:
        handoff = self._pending.get(key)
        if handoff is None:
            return
        if asyncio.get_running_loop().time() >= handoff.last_call or handoff.entry_id is None:
            self._take_back(key, "timeout")
        else:
            self._spawn(self._take_back_unless_claimed(key, handoff))

    async def _take_back_unless_claimed(self, key: str, handoff: Handoff) -> None:
        """Take the batch back if no peer has read it yet; else wait for its answer."""
        model = handoff.batch.model
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        try:  # one step on the server: no thief can read it between the check and the delete
            claimed = await self.link.cmd.eval(DELETE_UNLESS_DELIVERED, 1, overflow_key(model),
                                          GROUP, handoff.entry_id)
        except rexc.RedisError as error:
            claimed = None  # not known: taken back (a peer that runs it is answered late)
            self.redis_error(error)
        took_s = loop.time() - asked_at  # up at once, down slowly: a burst comes back
        self._check_s = max(took_s, 0.8 * self._check_s + 0.2 * took_s)
        if key not in self._pending:
            return  # answered meanwhile (or taken back: Redis away)
        if claimed is None or claimed == 1:  # deleted unread: no peer will run it
            if claimed == 1 and not self._peer_runs_ours():
                self.heart.doubt(None)  # none was free to read it
            self._take_back(key, "unclaimed")
            return
        handoff.read = True
        # Read by a peer (a busy one declines it at once): wait for its answer.
        handoff.timer = loop.call_at(handoff.last_call, self._take_back, key, "timeout")

    def _peer_runs_ours(self) -> bool:
        """Whether a peer is running batches of ours: one read and not yet answered, or one
        answered within a beat (its thief was between two of them, not busy)."""
        since_s = asyncio.get_running_loop().time() - self._answered_at
        return since_s < self.link.settings.heartbeat_ms / 1000 or \
            any(handoff.read for handoff in self._pending.values())

    def _reposted(self, key: str, entry_id: Any) -> None:
        """Our own thief read a batch of ours while busy and put it back under a new id:
        the unclaimed check looks at that copy, giving peers a round trip to read it."""
        handoff = self._pending.get(key)
        if handoff is None:
            return
        handoff.entry_id = entry_id
        if handoff.timer is not None:
            handoff.timer.cancel()
        loop = asyncio.get_running_loop()
        check_at = min(self._ask_by(handoff),
                       max(handoff.check_at, loop.time() + self.round_trip_s()))
        handoff.timer = loop.call_at(check_at, self._unclaimed, key)

    def _take_back(self, key: str, why: str) -> None:
        """The peers did not answer in time (or cannot): run it here if the deadline allows."""
        handoff = self._pending.pop(key, None)
        if handoff is None:
            return
        if handoff.timer is not None:
            handoff.timer.cancel()
        batch = handoff.batch
        self.link.metrics.overflow_events.labels("taken_back").inc()
        self.link.counts["taken_back"] += 1
        log.debug("batch %s taken back (%s)", key, why)
        if self.up:  # before its XADD returns too: a thief checks the done key first
            self._spawn(self._forget(batch.model, key, handoff.entry_id, batch.deadline))
        if not any(item.live for item in batch.items):
            return
        batcher = self.link.models[batch.model][1]
        # Dispatched again, as the batcher dispatches (rule 1): the items a run here can no
        # longer answer in time fail, the rest run (the timer left a margin for its lateness).
        now = asyncio.get_running_loop().time()
        finish, retry_s = now + batcher.times.predict(batch.bucket, batch.size), batcher.backlog_s()
        batch.fail_due_by(finish, lambda item: missed_deadline(
            item.deadline, now, retry_s, "handed to a peer that did not answer"))
        if batch.items:
            # Our work again: the batcher counts it, or our idle thief would read the next
            # batch we hand off straight back too, and peers would idle.
            batcher.hold(batch, self._spawn(self.link.run_local(batch)))

    async def _forget(self, model: str, key: str, entry_id: Any, deadline: float) -> None:
        """Tell peers the batch is answered: a thief or a reclaimer will not run it."""
        ttl_ms = self.link.done_ttl_ms(deadline - asyncio.get_running_loop().time())
        try:
            async with self.link.cmd.pipeline(transaction=True) as pipe:
                pipe.set(done_key(model, key), self.link.node, nx=True, px=ttl_ms)
                if entry_id is not None:
                    pipe.xdel(overflow_key(model), entry_id)
                await pipe.execute()
        except rexc.RedisError as error:
            self.redis_error(error)

    async def _reply_loop(self) -> None:
        """One task, one connection: XREAD BLOCK on our reply stream (rule 8)."""
        client = self.link.client(blocking_timeout_s(self.link.timeout_s))
        key = reply_key(self.link.node)
        try:
            while True:
                await self.link.up_event.wait()
                try:
                    got: Any = await client.xread({key: self._reply_from}, count=64,
                                                  block=BLOCK_MS)
                except rexc.RedisError as error:
                    self.redis_error(error)
                    if self.up and not isinstance(error, rexc.TimeoutError):
                        await asyncio.sleep(BLOCK_MS / 1000)  # refused (WRONGTYPE): no spin
                    continue
                for _stream, entries in got or []:
                    for entry_id, fields in entries:
                        self._reply_from = entry_id
                        try:
                            self._on_reply(fields)
                        except Exception:  # rule 6: no entry ends the only reply reader
                            self.link.metrics.overflow_events.labels("malformed").inc()
                            log.exception("reply %r dropped", entry_id)
        finally:
            await client.aclose()

    def _on_reply(self, fields: Any) -> None:
        try:
            key = batch_of(fields)
        except WireError as error:
            self.link.metrics.overflow_events.labels("malformed").inc()
            log.warning("malformed reply dropped: %s", error)
            return
        handoff = self._pending.get(key)
        if handoff is None:  # answered already (taken back, or a second run's reply)
            self.link.metrics.overflow_events.labels("late_reply").inc()
            return
        try:
            reply = decode_reply(fields, handoff.batch.size, REPLY_CODES)
        except WireError as error:
            self.link.metrics.overflow_events.labels("malformed").inc()
            log.warning("malformed reply for %s dropped: %s", key, error)
            return
        if reply.error_message == WENT_DOWN:  # its inputs may take this process down too
            self.link.quarantine.crashed(handoff.batch.model, handoff.batch.items)
        if reply.error_code == "declined" or (reply.error_code == "model_error"
                                               and handoff.batch.size > 1):
            # Raised on (or went down) there: run here, halved or its suspects alone (settle).
            if reply.error_code == "declined":
                self.link.metrics.overflow_events.labels("declined").inc()
                self.heart.doubt(reply.node)
            self._take_back(key, reply.error_code)
            return
        del self._pending[key]
        if handoff.timer is not None:
            handoff.timer.cancel()
        try:
            self._answer(handoff, reply)
        except Exception:  # out of _pending: no timer will answer its callers
            handoff.batch.fail(VegaError("model_error", f"bad answer from peer {reply.node}"))
            raise

    def _answer(self, handoff: Handoff, reply: Reply) -> None:
        batch = handoff.batch
        if reply.error_code == "dead_letter":
            batch.fail(VegaError("model_error", reply.error_message))
            return
        if reply.error_code:
            batch.fail(VegaError("model_error", f"on peer {reply.node}: {reply.error_message}"))
            return
        infer_s = reply.infer_ms / 1000
        for item, output in zip(batch.items, reply.outputs):
            if not item.future.done():
                item.infer_s = infer_s
                item.future.set_result(output)
        self._answered_at = asyncio.get_running_loop().time()
        round_trip_s = self._answered_at - handoff.sent_at - infer_s
        self.rtt_s = 0.8 * self.rtt_s + 0.2 * max(0.0, round_trip_s)
        self.link.metrics.steal_rtt.set(self.rtt_s)

    def redis_error(self, error: BaseException) -> None:
        if isinstance(error, rexc.TimeoutError):
            if self.up:  # a stall or Redis away: a probe write decides before batches come back
                self._timeouts.timed_out(error)
        elif isinstance(error, CONNECTION_ERRORS):
            self._lost(error)
        else:
            log.error("redis refused a command: %s", said(error))
