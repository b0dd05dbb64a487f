"""HTTP: Starlette routes for ``/v1``, health, status and metrics; errors as DESIGN.md says.

A request is read (size-limited while reading), parsed with orjson, and handed to
the request stack (vega.stack): idempotency, cache, then the runtime, which admits,
queues and awaits it. Each protocol's dialect lives beside its routes: ``/v1`` in
vega.v1, the Open Inference Protocol in vega.oip.

Inference POSTs reach their guard past Starlette's router (``HotRoutes``): it is the
one hot path, and the router's layers were a large share of its loop time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from vega.calls import Handler
from vega.channel.client import SideRedis
from vega.config import Settings
from vega.errors import VegaError
from vega.httpio import HotRequest, Sent, error_response, json_response
from vega.jobs.routes import JobsApi
from vega.middleware import BearerAuthMiddleware, RequestIdMiddleware
from vega.models import ModelAdapter, identity, min_length
from vega.oip.routes import OipApi
from vega.oip.routes import error_response as oip_error_response
from vega.pressure.cache import ResponseCache, models_to_cache
from vega.pressure.idempotency import Idempotency
from vega.runtime import Runtime
from vega.stack import Guard, cached, core, idempotent
from vega.v1 import V1

log = logging.getLogger("vega.server")


class Api:
    """The /v1 routes besides inference: health, readiness, models, status, metrics."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        try:
            self.runtime.check_open()
        except VegaError as error:
            return error_response(error)
        return json_response({"status": "ready"})

    async def models(self, request: Request) -> Response:
        try:  # warming up, the list would be empty: 503, as the model's own routes answer
            self.runtime.served(None)
        except VegaError as error:
            if error.code == "not_ready":
                return error_response(error)
        return json_response({"models": [describe(s.adapter, self.settings)
                                         for s in self.runtime.models.values()]})

    async def status(self, request: Request) -> Response:
        return json_response(self.runtime.status())

    async def metrics(self, request: Request) -> Response:
        self.runtime.refresh_metrics()
        return Response(self.runtime.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


class Relief:
    """The "do less work" tiers of the stack (docs/pressure.md), and their one Redis client."""

    def __init__(self, runtime: Runtime) -> None:
        s = runtime.settings
        shared = s.redis_url and (s.idempotency_ttl_s > 0 or s.cache_redis_ttl_s > 0)
        self.side = SideRedis(s.redis_url, s.redis_timeout_ms / 1000) if shared else None
        self.adapters = adapters = runtime.executor.models
        models = {name: _cached_as(adapters[name]) for name in models_to_cache(s, adapters)}
        self.cache = ResponseCache(s.cache_bytes, models, runtime.metrics, self.side,
                                   s.cache_redis_ttl_s) if models else None
        if self.cache is not None:
            runtime.on_start.append(self._identify_started)
        self.idempotency = Idempotency(s.idempotency_ttl_s, s.idempotency_max_keys,
                                       runtime.metrics, self.side)

    def _identify_started(self, error: BaseException | None) -> None:
        """Once the start succeeded, key cached answers by the models as started: a model
        process's copy may differ from the one built here."""
        if error is None and self.cache is not None:
            known = self.cache.models
            known.update({name: _cached_as(self.adapters[name]) for name in known})

    def around(self, runtime: Runtime) -> Handler:
        return idempotent(self.idempotency, cached(self.cache, core(runtime)))

    def refuse_early(self, request: Request, model: str) -> bool:
        """Whether load may refuse a request before its body is parsed: not where an
        idempotent replay or a cached answer could answer it without the model."""
        return "idempotency-key" not in request.headers and not (
            self.cache is not None and self.cache.covers(model))

    def check_headers(self, request: Request) -> None:
        """What is refused before the body is read: a malformed Idempotency-Key."""
        self.idempotency.key_of(request.headers.get("idempotency-key"))

    async def close(self) -> None:
        await self.idempotency.close()
        if self.cache is not None:
            await self.cache.close()
        if self.side is not None:
            await self.side.close()


def _cached_as(adapter: ModelAdapter) -> str:
    """What a model's cached answers are keyed by: its identity, and the windows it takes
    (a process that would refuse a window is not answered it from a peer's entry)."""
    return f"{identity(adapter)}:{min_length(adapter)}..{adapter.max_length}"


def describe(adapter: ModelAdapter, settings: Settings) -> dict[str, Any]:
    return {
        "name": adapter.name, "version": adapter.version, "min_length": min_length(adapter),
        "max_length": adapter.max_length,
        "max_batch_size": settings.max_batch_size,
        "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                   for t in adapter.inputs],
        "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                    for t in adapter.outputs],
    }


async def _not_routed(request: Request, exc: Exception) -> Response:
    """The router's 404 and 405, in the error shape of the path's protocol."""
    assert isinstance(exc, HTTPException)
    allowed = exc.status_code == 405
    error = VegaError("method_not_allowed" if allowed else "not_found",
                      f"{request.method} {request.url.path[:200]}: "
                      f"{'not a method this path takes' if allowed else 'no such route'}")
    path = request.url.path
    response = (oip_error_response(error) if path == "/v2" or path.startswith("/v2/")
                else error_response(error))
    response.headers.update(exc.headers or {})  # Allow
    return response


def create_app(settings: Settings, adapters: list[ModelAdapter] | None = None,
               runtime: Runtime | None = None) -> tuple[ASGIApp, Runtime]:
    """The ASGI app and the runtime it serves; the app's lifespan starts (warm-up) and stops it."""
    runtime = runtime or Runtime(settings, adapters)
    api = Api(runtime)
    relief = Relief(runtime)
    stack = relief.around(runtime)  # one stack, every protocol

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()
            await relief.close()

    jobs = JobsApi(runtime)  # the async lane (vega/jobs/)
    v1 = Guard(runtime, V1(runtime), stack, [relief.check_headers], later=jobs,
               refuse_early=relief.refuse_early)
    oip = OipApi(runtime)
    v2 = Guard(runtime, oip, stack, [relief.check_headers], refuse_early=relief.refuse_early)
    hot = [(Route("/v1/infer", v1, methods=["POST"]), v1),
           (Route("/v1/models/{name}/infer", v1, methods=["POST"]), v1),
           *((route, v2) for route in oip.infer_routes(v2))]
    routes = [
        *(route for route, _ in hot),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/status", api.status, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        *oip.routes(),
        *jobs.routes(),
    ]
    router = Starlette(routes=routes, lifespan=lifespan,
                       exception_handlers={HTTPException: _not_routed})
    router.router.redirect_slashes = False  # a 307 to an absolute URL, wrong behind a proxy
    app: ASGIApp = HotRoutes(router, hot)
    auth = BearerAuthMiddleware(app, tokens=settings.auth_tokens.split(","),
                                open_paths=[p.strip() for p in settings.auth_open_paths.split(",")])
    if auth.tokens:  # without any, the layer would only cost each request a coroutine
        app = auth
    return RequestIdMiddleware(app, runtime), runtime


class HotRoutes:
    """POSTs to the inference routes go straight to their guard.

    Starlette's router, request/response wrapping and two exception layers took a large
    share of an inference request's event-loop time. The guard answers every error
    itself (vega.stack), so skipping them loses nothing; the request it gets looks its
    headers up in a dict (``HotRequest``). The routes match as they do in
    the router (the same Route objects); anything else, including these paths with
    another method, and the lifespan, goes to the Starlette app.
    """

    def __init__(self, app: ASGIApp,
                 routes: Sequence[tuple[Route, Callable[[Request], Awaitable[Sent]]]]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route, handler in self.routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope)
                    sent = await handler(HotRequest(scope, receive, send))
                    await send(sent.start)
                    await send(sent.body)
                    return
        await self.app(scope, receive, send)
