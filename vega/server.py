"""HTTP: Starlette routes for ``/v1``, health, status and metrics; errors as DESIGN.md says.

A request is read (size-limited while reading), parsed with orjson, and handed to
the runtime, which admits, queues and awaits it. Every VegaError becomes its error
body and status here, in one place.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive

from vega.config import Settings
from vega.errors import REFUSALS, VegaError
from vega.models import ModelAdapter
from vega.records import NORMAL, PRIORITY_BY_NAME, PRIORITY_NAMES
from vega.runtime import ClientGone, Runtime

log = logging.getLogger("vega.server")

JSON = "application/json"
BODY_FIELDS = frozenset({"inputs", "instances", "priority", "deadline_ms", "id"})


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY), status,
                    headers=headers, media_type=JSON)


def error_response(error: VegaError) -> Response:
    return json_response(error.body(), error.status, error.headers())


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it is known to be over ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise VegaError("invalid_json", "Content-Length is not a number")
        if int(declared) > limit:
            raise VegaError("payload_too_large", f"body over {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise VegaError("payload_too_large", f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise VegaError("invalid_json", f"body is not JSON: {exc}") from None


def parse_priority(value: Any, default: int = NORMAL) -> int:
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lower() in PRIORITY_BY_NAME:
        return PRIORITY_BY_NAME[value.strip().lower()]
    raise VegaError("invalid_input", f"priority must be one of {', '.join(PRIORITY_NAMES)}")


def parse_deadline_ms(value: Any, settings: Settings) -> float:
    """A positive number of milliseconds, capped at VEGA_MAX_DEADLINE_MS."""
    if value is None:
        return settings.default_deadline_ms
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise VegaError("invalid_input", "deadline_ms must be a positive number of milliseconds")
    return float(min(value, settings.max_deadline_ms))


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


def disconnect_watch(receive: Receive) -> Callable[[], Awaitable[None]]:
    """After the body is read, the next ASGI message can only be the disconnect."""
    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
    return watch


class Api:
    """The /v1 routes over one runtime; counts every answer by outcome."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings

    async def infer(self, request: Request) -> Response:
        runtime = self.runtime
        started = asyncio.get_running_loop().time()
        name = request.path_params.get("name") or runtime.default_model
        priority = NORMAL
        try:
            runtime.check_open()
            runtime.served(name)
            body = await read_body(request, self.settings.max_body_bytes)
            instances, single, priority, deadline_ms = parse_infer_body(
                parse_json(body), request, self.settings)
            answer = await runtime.infer(name, instances, priority, deadline_ms,
                                         disconnect_watch(request.receive))
        except VegaError as error:
            self.count(name, priority, error.code)
            return error_response(error)
        except ClientGone:
            self.count(name, priority, "disconnected")
            return Response(status_code=499)
        self.count(name, priority, "ok", asyncio.get_running_loop().time() - started)
        outputs = answer.outputs[0] if single else answer.outputs
        timing = f"queue;dur={1000 * answer.queue_s:.2f}, infer;dur={1000 * answer.infer_s:.2f}"
        return json_response({"model": name, "outputs": outputs},
                             headers={"Server-Timing": timing})

    def count(self, model: str, priority: int, outcome: str, seconds: float | None = None) -> None:
        metrics = self.runtime.metrics
        model = model if model in self.runtime.models else "_unknown"
        label = PRIORITY_NAMES[priority]
        metrics.requests.labels(model, label, outcome).inc()
        if outcome in REFUSALS:
            metrics.rejections.labels(model, label, outcome).inc()
        if seconds is not None:
            metrics.request_seconds.labels(model).observe(seconds)

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
               runtime: Runtime | None = None) -> Starlette:
    """The ASGI app; its lifespan starts the runtime (warm-up) and stops it."""
    runtime = runtime or Runtime(settings, adapters)
    api = Api(runtime)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    routes = [
        Route("/v1/infer", api.infer, methods=["POST"]),
        Route("/v1/models/{name}/infer", api.infer, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/status", api.status, methods=["GET"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]
    from vega.oip import oip_routes  # here, not at the top: vega.oip builds on this module

    routes += oip_routes(api)
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.runtime = runtime
    return app
