"""One request stack for every inference route: ``Guard(idempotent(cached(core)))``.

``create_app`` builds the layers once, as Starlette builds its middleware stack, and
gives the same handler to ``/v1`` and to the Open Inference Protocol; each route's
``Guard`` speaks its protocol (a ``vega.calls.Dialect``). The guard runs the runtime's
checks once, before the body is read, and is the one place that turns an exception
into an answer and counts every answer in ``vega_requests_total``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import orjson
from starlette.requests import ClientDisconnect, Request

from vega.admission import NeverFits
from vega.calls import Call, Dialect, Handler, Reply
from vega.errors import REFUSALS, VegaError
from vega.httpio import Sent, hung_up, named_priority, parse_deadline_ms, read_body
from vega.pressure.cache import ResponseCache
from vega.pressure.idempotency import Claim, Idempotency
from vega.pressure.looplag import LoopLate
from vega.records import CRITICAL, NORMAL, PRIORITY_NAMES
from vega.runtime import ClientGone, Runtime

log = logging.getLogger("vega.stack")

DISCONNECTED = Reply(499, b"", {}, "disconnected", None)
# The refusals that a caller who can wait would rather have as a job (DESIGN.md "Jobs").
LOAD_REFUSALS = frozenset({"shed", "queue_full", "deadline_unmeetable"})
# Scope keys: the Guard may turn this request's refusal into a job; the idempotent layer's
# key, held for the Guard to settle with that job (or forget).
TURNS, HELD = "vega.turns", "vega.held_key"


def internal_error(request: Request) -> VegaError:
    """A bug met while answering ``request``: logged with its id, answered without it."""
    log.exception("request %s: internal error", request.scope.get("vega.request_id"))
    return VegaError("internal_error", "internal error; the server's log has the details")


def core(runtime: Runtime) -> Handler:
    """The runtime's answer to a call, refusals included, in the call's protocol."""
    async def run(call: Call) -> Reply:
        gone = call.request.scope["vega.gone"] = hung_up(call.request.receive)
        try:
            answer = await runtime.infer(call.model, call.instances, call.priority,
                                         call.deadline_ms, gone, call.arrived)
        except NeverFits:
            raise  # the Guard's to answer: a caller that would take a job gets one
        except VegaError as error:
            return call.dialect.refusal(error)
        except ClientGone:
            return DISCONNECTED
        return call.dialect.render(call, answer)
    return run


def cached(cache: ResponseCache | None, inner: Handler) -> Handler:
    """Answers already given, for the models that opted in (docs/pressure.md)."""
    if cache is None:
        return inner

    async def lookup(call: Call) -> Reply:
        if not cache.covers(call.model):
            return await inner(call)
        control = {part.strip() for part in
                   call.request.headers.get("cache-control", "").lower().split(",")}
        if "no-store" in control:
            return await inner(call)
        key = cache.key(call.model, call.variant, call.instances)  # before they go
        if key is None:
            return await inner(call)
        if "no-cache" not in control:
            stored = await cache.get(call.model, key)
            if stored is not None:
                hit = Reply.decode(orjson.loads(stored))
                hit.headers["X-Vega-Cache"] = "hit"
                return hit
        reply = await inner(call)
        if reply.status != 200:
            return reply
        if "X-Vega-Degraded" not in reply.headers:  # the main model would answer otherwise
            cache.put(call.model, key, orjson.dumps(reply.without("Server-Timing").encode()))
        reply.headers["X-Vega-Cache"] = "miss" if "no-cache" not in control else "bypass"
        return reply
    return lookup


def idempotent(store: Idempotency, inner: Handler) -> Handler:
    """A repeat of an ``Idempotency-Key`` gets the first attempt's reply; the model runs once."""
    def once(call: Call) -> Awaitable[Reply]:
        key = store.key_of(call.request.headers.get("idempotency-key"))
        # Without a key the inner layer's own coroutine is the answer: no frame of this
        # layer stays on every request's stack while it waits.
        return inner(call) if key is None else first_or_replay(call, key)

    async def first_or_replay(call: Call, key: str) -> Reply:
        deadline = call.deadline(asyncio.get_running_loop().time())
        claim = await store.claim(call.model, key, call.fingerprint, deadline)
        if claim.replay is not None:
            first = claim.replay
            return Reply(first.status, first.body,
                         first.headers | {"Idempotent-Replayed": "true"}, first.outcome,
                         first.media_type)
        reply: Reply | None = None
        turnable = False  # a refusal the Guard may turn into a job (respond-async)
        try:
            reply = await inner(call)
            turnable = reply.outcome in LOAD_REFUSALS
        except NeverFits:
            turnable = True
            raise
        finally:
            scope = call.request.scope
            if turnable and TURNS in scope:
                # Held until the Guard has turned it: a repeat then gets that job, neither
                # running inline meanwhile nor making a second one.
                scope[HELD] = functools.partial(_settle_turned, store, claim)
            else:
                # What only its first sending carries: a replay is neither timed nor a hit.
                await store.finish(claim, None if reply is None
                                   else reply.without("Server-Timing", "X-Vega-Cache"))
        return reply
    return once


async def _settle_turned(store: Idempotency, claim: Claim, reply: Reply | None) -> None:
    """A held key's outcome: the job its refusal became (202), else forgotten as refusals are."""
    await store.finish(claim, reply if reply is not None and reply.status == 202 else None)


class Later(Protocol):
    """What a request refused for load may become instead: a job (vega.jobs)."""

    def wants(self, request: Request) -> bool:
        """Whether the caller would take that (``Prefer: respond-async``)."""

    async def turn(self, request: Request, model: str, body: bytes | None,
                   refused: Reply) -> Reply:
        """The reply instead of ``refused``; ``body`` is None when it was not read."""


class Guard:
    """One protocol's inference endpoint over the shared stack."""

    def __init__(self, runtime: Runtime, dialect: Dialect, handler: Handler,
                 checks: Sequence[Callable[[Request], object]] = (),
                 later: Later | None = None,
                 refuse_early: Callable[[Request, str], bool] = lambda _r, _m: True) -> None:
        self.runtime = runtime
        self.dialect = dialect
        self.handler = handler
        self.checks = checks  # of the headers, before the body is read (raise VegaError)
        self.later = later
        self.refuse_early = refuse_early  # (request, model): may load refuse it unparsed?
        self.max_body_bytes = runtime.settings.max_body_bytes
        self.body_wait_s = runtime.settings.max_deadline_ms / 1000

    async def __call__(self, request: Request) -> Sent:
        began = time.perf_counter()
        started = asyncio.get_running_loop().time()
        reply, model, priority = await self.reply(request, started)  # the body goes with its frame
        outcome = reply.outcome
        if outcome == "ok" and (gone := request.scope.get("vega.gone")) is not None and gone():
            outcome = "disconnected"  # its batch ran, then nobody took the answer
        hold = counted(self.runtime, model, priority, outcome, began)
        if hold > 0:
            await asyncio.sleep(min(hold, self._left_s(request, started)))
        return Sent(reply)

    def _left_s(self, request: Request, started: float) -> float:
        """What is left of the deadline the request named (its caller's timeout: past it,
        the caller has given up and reconnects, dearer than a resend); unbounded when it
        named none, as a caller that waits for its answer is what the pacer slows."""
        deadline_ms = request.scope.get("vega.deadline_ms")  # set once the body is parsed
        if deadline_ms is None:
            named = request.headers.get("x-vega-deadline-ms")
            try:
                deadline_ms = parse_deadline_ms(named, self.runtime.settings) if named else None
            except VegaError:
                deadline_ms = None
        if deadline_ms is None:
            return math.inf
        return max(0.0, started + deadline_ms / 1000 - asyncio.get_running_loop().time())

    async def reply(self, request: Request, arrived: float) -> tuple[Reply, str, int]:
        """The reply to one request, the model it asked for and the class it was taken at."""
        model, priority = "", NORMAL
        later = self.later if self.later is not None and self.later.wants(request) else None
        if later is not None:
            request.scope[TURNS] = True
        kept: bytes | None = None  # the body, only for a refusal that may become a job
        never_fits = False  # no retry could fit it inline: a job may take it
        lag = self.runtime.lag
        lag.touch()
        try:
            model = self.dialect.model(request)
            early = self.refuse_early(request, model)
            named = named_priority(request.headers.get("x-vega-priority"))
            priority = NORMAL if named is None else named  # counted under it if refused here
            # Refuse before reading the body when not even a critical request would get in
            # and no fallback could take it: the body may name any class, and it wins over
            # the header.
            try:
                self.runtime.gate(model, CRITICAL if early and self.dialect.refuses_unread
                                  else None, unread=True)
            except VegaError:
                if named is None and later is None:  # counted under the class it asked for
                    priority = await self._named_in_body(request, priority)
                raise
            for check in self.checks:
                check(request)
            body = await read_body(request, self.max_body_bytes, self.body_wait_s)
            kept = body if later is not None else None
            # Then before parsing it, for the class its text names (the header's if it
            # names none): the parse was a third of what a refusal cost the loop. A loop
            # running late refuses even what a cached answer or a replay could answer.
            late = lag.share > 0
            scanned = self.dialect.claimed(request, body) if early or late else None
            if scanned is not None:
                priority = scanned
                if late:
                    lag.check(scanned)
                if early:
                    self.runtime.gate(model, scanned)
            call = self.dialect.parse(request, model, body,
                                      keyed="idempotency-key" in request.headers)
            del body
            call.arrived = arrived
            priority = call.priority
            if call.deadline_ms != self.runtime.settings.default_deadline_ms:  # named
                request.scope["vega.deadline_ms"] = call.deadline_ms
            if late and scanned is None:  # the class only the parse could tell
                lag.check(priority)
            reply = await self.handler(call)
        except LoopLate as error:  # a job would be more work for the loop, not less
            return self.refusal(request, error), model, priority
        except VegaError as error:
            reply, never_fits = self.refusal(request, error), isinstance(error, NeverFits)
        except (ClientGone, ClientDisconnect):
            return DISCONNECTED, model, priority
        except Exception:
            return self.dialect.refusal(internal_error(request)), model, priority
        if later is not None and (reply.outcome in LOAD_REFUSALS or never_fits):
            try:
                reply = await later.turn(request, model, kept, reply)
            except Exception:  # the refusal stands; the bug is logged
                log.exception("request %s: turning a refusal into a job failed",
                              request.scope.get("vega.request_id"))
            finally:
                held = request.scope.pop(HELD, None)  # its Idempotency-Key, if it named one
                if held is not None:
                    await held(reply)
        return reply, model, priority

    async def _named_in_body(self, request: Request, default: int) -> int:
        """The class a request refused unread names in its body (a scan, not a parse):
        under a flood of critical work its refusals count as critical, which the
        VegaCriticalRefused alert reads."""
        try:
            scanned = self.dialect.claimed(request, await read_body(
                request, self.max_body_bytes, self.body_wait_s))
        except (VegaError, ClientDisconnect):
            return default
        return default if scanned is None else scanned

    def refusal(self, request: Request, error: VegaError) -> Reply:
        if error.status == 500:  # 503s and 504s are load, counted in the metrics: no log line
            log.warning("request %s: %s %s", request.scope.get("vega.request_id"),
                        error.code, error.message)
        return self.dialect.refusal(error)


async def conclude(runtime: Runtime, model: str, priority: int, outcome: str,
                   began: float) -> None:
    """Count one answer (a 200 with its time since ``began``), then hold it if it is a
    refusal past VEGA_REFUSAL_RATE, until its turn (vega/pressure/pacing.py).

    Called once the frame that read and parsed the request has returned, so a held
    refusal keeps nothing of its request alive (under a flood hundreds are held at
    once, and their parsed bodies would be rescanned by every garbage collection).
    """
    hold = counted(runtime, model, priority, outcome, began)
    if hold > 0:
        await asyncio.sleep(hold)


def counted(runtime: Runtime, model: str, priority: int, outcome: str,
            began: float) -> float:
    """``conclude`` without the wait: count the answer, return how long to hold it
    (0 for all but a refusal past VEGA_REFUSAL_RATE). The hot path awaits only then.
    ``began``: ``time.perf_counter()`` as the request came in (the loop's clock is whole
    milliseconds on uvloop, too coarse for the latency histogram's first buckets)."""
    metrics = runtime.metrics
    if model not in runtime.models and model not in runtime.executor.models:  # warming up
        model = "_unknown"  # a name no model has: one label for all, not one per name
    now = asyncio.get_running_loop().time()
    metrics.answered(model, PRIORITY_NAMES[priority], outcome, outcome in REFUSALS,
                     time.perf_counter() - began if outcome == "ok" else None)
    hold = runtime.pacer.hold(outcome, now)
    if hold > 0:
        metrics.paced.labels(model).inc()
    return hold
