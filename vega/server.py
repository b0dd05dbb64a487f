"""HTTP: Starlette routes for ``/v1``, health, status and metrics; errors as DESIGN.md says.

A request is read (size-limited while reading), parsed with orjson, and handed to
the runtime, which admits, queues and awaits it. Every VegaError becomes its error
body and status here, in one place.

Inference POSTs reach their handler past Starlette's router (``HotRoutes``): it
is the one hot path, and the router's layers were a fifth of its loop time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from vega.channel.client import SideRedis
from vega.config import Settings
from vega.errors import VegaError
from vega.httpio import (
    JSON,
    conclude,
    error_response,
    hung_up,
    json_response,
    parse_deadline_ms,
    parse_json,
    parse_priority,
    read_body,
)
from vega.jobs.routes import TURNED, JobsApi, wants_async
from vega.middleware import BearerAuthMiddleware, RequestIdMiddleware
from vega.models import ModelAdapter
from vega.oip.routes import oip_routes
from vega.pressure.cache import ResponseCache, cache_key, models_to_cache
from vega.pressure.idempotency import Idempotency, Reply, fingerprint
from vega.records import CRITICAL, NORMAL, PRIORITY_BY_NAME
from vega.runtime import ClientGone, Runtime

log = logging.getLogger("vega.server")

BODY_FIELDS = frozenset({"inputs", "instances", "priority", "deadline_ms", "id"})


def parse_infer_body(doc: Any, request: Request, settings: Settings
                     ) -> tuple[list[Any], bool, int, float]:
    """(instances, single, priority, deadline_ms) from a /v1 body and its headers."""
    if not isinstance(doc, dict):
        raise VegaError("invalid_input", "body must be a JSON object")
    unknown = set(doc) - BODY_FIELDS
    if unknown:
        raise VegaError("invalid_input", f"unknown field(s): {', '.join(sorted(unknown))[:200]}")
    if ("inputs" in doc) == ("instances" in doc):
        raise VegaError("invalid_input", "give exactly one of 'inputs' or 'instances'")
    single = "inputs" in doc
    instances = [doc["inputs"]] if single else doc["instances"]
    if not isinstance(instances, list) or not instances:
        raise VegaError("invalid_input", "'instances' must be a non-empty list")
    if len(instances) > settings.max_instances:
        raise VegaError("invalid_input", f"more than {settings.max_instances} instances")
    priority = parse_priority(doc.get("priority", request.headers.get("x-vega-priority")))
    deadline_ms = parse_deadline_ms(doc.get("deadline_ms",
                                            request.headers.get("x-vega-deadline-ms")), settings)
    return instances, single, priority, deadline_ms


@dataclass(frozen=True)
class Call:
    """One parsed /v1 inference request."""

    request: Request
    model: str
    instances: list[Any]
    single: bool
    priority: int
    deadline_ms: float


class Api:
    """The /v1 routes over one runtime; counts every answer by outcome."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = s = runtime.settings
        metrics = runtime.metrics
        # Pressure relief (docs/pressure.md): one Redis client for the shared tiers.
        shared = s.redis_url and (s.idempotency_ttl_s > 0 or s.cache_redis_ttl_s > 0)
        self.side = SideRedis(s.redis_url, s.redis_timeout_ms / 1000) if shared else None
        cached = models_to_cache(s, runtime.executor.models)
        self.cache = ResponseCache(s.cache_bytes, cached, metrics, self.side,
                                   s.cache_redis_ttl_s) if cached else None
        self.idempotency = Idempotency(s.idempotency_ttl_s, s.idempotency_max_keys, metrics,
                                       self.side)
        self.jobs = JobsApi(runtime, parse_infer_body)  # the async lane (vega/jobs/)

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()
        if self.side is not None:
            await self.side.close()

    async def infer(self, request: Request) -> Response:
        loop = asyncio.get_running_loop()
        started = loop.time()
        name = request.path_params.get("name") or self.runtime.default_model
        reply, priority = await self.reply(request, name)  # the body goes with its frame
        await conclude(self.runtime, name, priority, reply.outcome, started)
        return Response(reply.body, reply.status, headers=reply.headers,
                        media_type=JSON if reply.body else None)

    async def reply(self, request: Request, name: str) -> tuple[Reply, int]:
        """The reply to one /v1 inference request, and the priority it was taken at."""
        runtime = self.runtime
        priority = NORMAL
        body: bytes | None = None  # kept only for Prefer: respond-async
        try:
            runtime.check_open()
            # Refuse before reading the body when even the most favoured class this
            # request can claim would not get in: a flood of refusals stays cheap.
            hinted = request.headers.get("x-vega-priority")
            claimed = PRIORITY_BY_NAME.get(hinted.strip().lower(), CRITICAL) if hinted else CRITICAL
            served = runtime.served(name)
            if runtime.fallback_for(served, claimed) is None:  # else the fallback may take it
                served.admission.precheck(claimed)
            key = self.idempotency.key_of(request.headers.get("idempotency-key"))
            raw = await read_body(request, self.settings.max_body_bytes)
            body = raw if wants_async(request) else None
            call, body_print = self.parse(request, name, raw, keyed=key is not None)
            del raw
            priority = call.priority
            if key is None:
                reply = await self.answer(call)
            else:
                reply = await self.answer_once(call, key, body_print)
        except VegaError as error:
            reply = self.refusal(request, error)
        if reply.outcome in TURNED and wants_async(request):
            reply = await self.jobs.turn(request, name, body, reply)
        return reply, priority

    def parse(self, request: Request, name: str, body: bytes,
              keyed: bool) -> tuple[Call, str]:
        """The call a /v1 body makes, and the body's fingerprint if ``keyed`` (idempotent).

        The parsed document ends here: the runtime empties ``call.instances`` once it
        has decoded them, and no frame that waits may still hold the rest of it.
        """
        doc = parse_json(body)
        instances, single, priority, deadline_ms = parse_infer_body(doc, request, self.settings)
        return (Call(request, name, instances, single, priority, deadline_ms),
                fingerprint(doc) if keyed else "")

    async def answer(self, call: Call) -> Reply:
        """Run ``call`` through the cache and the runtime; every outcome as a Reply."""
        cache = self.cache if self.cache is not None and self.cache.covers(call.model) else None
        control = set() if cache is None else {
            part.strip() for part in call.request.headers.get("cache-control", "").lower().split(",")}
        key = None
        if cache is not None and "no-store" not in control:
            version = self.runtime.models[call.model].adapter.version
            key = cache_key(call.model, version, call.single, call.instances)
            if "no-cache" not in control:
                cached = await cache.get(call.model, key)
                if cached is not None:
                    return Reply(200, cached, {"X-Vega-Cache": "hit"}, "ok")
        try:
            answer = await self.runtime.infer(call.model, call.instances, call.priority,
                                              call.deadline_ms,
                                              hung_up(call.request.receive))
        except VegaError as error:
            return self.refusal(call.request, error)
        except ClientGone:
            return Reply(499, b"", {}, "disconnected")
        outputs = answer.outputs[0] if call.single else answer.outputs
        body = orjson.dumps({"model": answer.model or call.model, "outputs": outputs},
                            option=orjson.OPT_SERIALIZE_NUMPY)
        headers = {"Server-Timing": f"queue;dur={1000 * answer.queue_s:.2f}, "
                                    f"infer;dur={1000 * answer.infer_s:.2f}"}
        if answer.degraded:
            headers["X-Vega-Degraded"] = "1"  # not cached: the main model would answer otherwise
        elif cache is not None and key is not None:
            cache.put(call.model, key, body)
        if cache is not None:
            headers["X-Vega-Cache"] = "miss" if "no-cache" not in control else "bypass"
        return Reply(200, body, headers, "ok")

    async def answer_once(self, call: Call, key: str, body_print: str) -> Reply:
        """As ``answer``, but a repeat of ``key`` gets the first attempt's reply."""
        deadline = asyncio.get_running_loop().time() + call.deadline_ms / 1000
        claim = await self.idempotency.claim(call.model, key, body_print, deadline)
        if claim.replay is not None:
            first = claim.replay
            return Reply(first.status, first.body,
                         first.headers | {"Idempotent-Replayed": "true"}, first.outcome)
        reply: Reply | None = None
        try:
            reply = await self.answer(call)
        finally:
            kept = None if reply is None else Reply(
                reply.status, reply.body,
                {k: v for k, v in reply.headers.items() if k != "Server-Timing"}, reply.outcome)
            await self.idempotency.finish(claim, kept)
        return reply

    def refusal(self, request: Request, error: VegaError) -> Reply:
        if error.status >= 500:
            log.warning("request %s: %s %s", request.scope.get("vega.request_id"),
                        error.code, error.message)
        return Reply(error.status, orjson.dumps(error.body()), error.headers(), error.code)

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        try:
            self.runtime.check_open()
        except VegaError as error:
            return error_response(error)
        return json_response({"status": "ready"})

    async def models(self, request: Request) -> Response:
        return json_response({"models": [describe(s.adapter, self.settings)
                                         for s in self.runtime.models.values()]})

    async def status(self, request: Request) -> Response:
        return json_response(self.runtime.status())

    async def metrics(self, request: Request) -> Response:
        self.runtime.refresh_metrics()
        return Response(self.runtime.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def describe(adapter: ModelAdapter, settings: Settings) -> dict[str, Any]:
    return {
        "name": adapter.name, "version": adapter.version, "max_length": adapter.max_length,
        "max_batch_size": settings.max_batch_size,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                   for t in adapter.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                    for t in adapter.outputs],
    }


def create_app(settings: Settings, adapters: list[ModelAdapter] | None = None,
               runtime: Runtime | None = None) -> tuple[ASGIApp, Runtime]:
    """The ASGI app and the runtime it serves; the app's lifespan starts (warm-up) and stops it."""
    runtime = runtime or Runtime(settings, adapters)
    api = Api(runtime)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()
            await api.close()

    hot = [Route("/v1/infer", api.infer, methods=["POST"]),
           Route("/v1/models/{name}/infer", api.infer, methods=["POST"])]
    routes = [
        *hot,
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/status", api.status, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    routes += oip_routes(runtime)
    routes += api.jobs.routes()
    app: ASGIApp = HotRoutes(Starlette(routes=routes, lifespan=lifespan), hot, api.infer)
    app = BearerAuthMiddleware(app, tokens=settings.auth_tokens.split(","),
                               open_paths=[p.strip() for p in settings.auth_open_paths.split(",")])
    return RequestIdMiddleware(app), runtime


class HotRoutes:
    """POSTs to the /v1 inference routes go straight to their handler.

    Starlette's router, request/response wrapping and two exception layers took about
    a fifth of an inference request's event-loop time (loop CPU per request with wrk at
    64 connections: 312 us through them, 230-277 us past them). The handler answers
    every error itself, so skipping them loses nothing. The routes match as they do in
    the router (the same Route objects); anything else, including these paths with
    another method, and the lifespan, goes to the Starlette app.
    """

    def __init__(self, app: ASGIApp, routes: list[Route],
                 handler: Callable[[Request], Awaitable[Response]]) -> None:
        self.app = app
        self.routes = routes
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route in self.routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope)
                    response = await self.handler(Request(scope, receive, send))
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
