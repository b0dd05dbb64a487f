"""Open Inference Protocol (KServe v2) REST routes, next to ``/v1``, over the same runtime.

An infer request's tensors are ``[batch, ...]``; each row becomes one item of the
runtime, so rows share forward passes with every other caller and pass the same
admission, batching and shedding as ``/v1``; the answers are stacked back in row
order. Models stay protocol-free: what metadata needs comes from their
``TensorSpec``s, and a row reaches ``decode`` as a numpy array (a dict of arrays
by input name for a model with several inputs). Errors answer in the protocol's
shape, ``{"error": "<code>: <message>"}``, with DESIGN.md's statuses and headers.

Class and deadline: Triton's ``parameters.priority`` levels map onto Vega's
classes (1 critical, 2 normal, 3 and above sheddable, 0 or absent: not given), a
string names a Vega class; ``parameters.timeout`` is microseconds and
``parameters.deadline_ms`` milliseconds (the tighter wins); the
``X-Vega-Priority`` and ``X-Vega-Deadline-Ms`` headers apply when the body gives none.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

import vega
from vega.calls import Call, Reply
from vega.config import Settings
from vega.errors import VegaError, invalid_input
from vega.httpio import (
    JSON,
    decompress,
    json_response,
    outputs_json,
    parse_deadline_ms,
    parse_json,
    parse_priority,
)
from vega.models import ModelAdapter, TensorSpec
from vega.oip.binary import (
    as_datatype,
    check_datatype,
    from_binary,
    from_json,
    split_body,
    to_binary,
    to_json,
)
from vega.oip.stats import model_stats
from vega.records import CRITICAL, NORMAL, PRIORITY_NAMES, SHEDDABLE
from vega.runtime import Answer, Runtime

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ("binary_tensor_data", "model_configuration", "schedule_policy", "statistics")
REQUEST_FIELDS = frozenset({"id", "parameters", "inputs", "outputs"})
UNSUPPORTED_PARAMETERS = ("sequence_id", "shared_memory_region", "classification")
CONFIG_TYPES = {"BYTES": "TYPE_STRING"}  # the model config's names: TYPE_ + datatype else


MODEL_PATHS = ("/v2/models/{name}", "/v2/models/{name}/versions/{version}")


def error_body(error: VegaError) -> bytes:
    return orjson.dumps({"error": f"{error.code}: {error.message}"})


def error_response(error: VegaError) -> Response:
    return Response(error_body(error), error.status, error.headers(), media_type=JSON)


@dataclass
class InferRequest:
    id: str | None
    instances: list[Any]  # one per row
    outputs: list[tuple[TensorSpec, bool]]  # requested outputs, and whether binary
    priority: int
    deadline_ms: float


class OipApi:
    """The v2 routes over a runtime, and the protocol's dialect for the request stack."""

    refuses_unread = False

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings: Settings = runtime.settings

    def routes(self) -> list[Route]:
        """Every v2 route but inference (``infer_routes``)."""
        routes = [
            Route("/v2", self.server_metadata, methods=["GET"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2/models/stats", self.stats, methods=["GET"]),  # before /v2/models/{name}
        ]
        for model in MODEL_PATHS:
            routes += [
                Route(model, self.model_metadata, methods=["GET"]),
                Route(model + "/ready", self.model_ready, methods=["GET"]),
                Route(model + "/config", self.model_config, methods=["GET"]),
                Route(model + "/stats", self.stats, methods=["GET"]),
            ]
        return routes

    @staticmethod
    def infer_routes(endpoint: Callable[[Request], Awaitable[ASGIApp]]) -> list[Route]:
        return [Route(model + "/infer", endpoint, methods=["POST"]) for model in MODEL_PATHS]

    # -- the dialect (vega.calls.Dialect) --------------------------------------------

    def model(self, request: Request) -> str:
        return self._adapter(request).name

    def claimed(self, request: Request, body: bytes) -> int | None:
        return None  # parameters.priority is in a nested object: the parse reads it

    def parse(self, request: Request, model: str, body: bytes, keyed: bool) -> Call:
        limit = self.settings.max_body_bytes
        body = decompress(body, request.headers.get("content-encoding"), limit)
        adapter = self.runtime.models[model].adapter
        parsed = parse_request(body, request.headers, adapter, self.settings)
        outputs = [(spec.name, binary) for spec, binary in parsed.outputs]
        variant = orjson.dumps([parsed.id, outputs])
        return Call(request, self, model, parsed.instances, parsed.priority, parsed.deadline_ms,
                    variant=variant.decode(),
                    fingerprint="v2:" + hashlib.blake2b(body, digest_size=16).hexdigest()
                    if keyed else "",
                    context=parsed)

    def render(self, call: Call, answer: Answer) -> Reply:
        return infer_reply(answer, call.context, self.runtime.models[call.model].adapter)

    def refusal(self, error: VegaError) -> Reply:
        return Reply(error.status, error_body(error), error.headers(), error.code)

    # -- the other routes --------------------------------------------------------------

    async def server_metadata(self, request: Request) -> Response:
        return json_response({"name": "vega", "version": vega.__version__,
                              "extensions": list(EXTENSIONS)})

    async def live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        try:
            self.runtime.check_open()
        except VegaError as error:
            return error_response(error)
        return Response(status_code=200)

    async def model_ready(self, request: Request) -> Response:
        try:
            self._adapter(request)
            self.runtime.check_open()
        except VegaError as error:
            return error_response(error)
        return Response(status_code=200)

    async def model_metadata(self, request: Request) -> Response:
        try:
            adapter = self._adapter(request)
        except VegaError as error:
            return error_response(error)
        return json_response({
            "name": adapter.name, "versions": [adapter.version], "platform": "vega",
            "inputs": [_tensor_metadata(spec) for spec in adapter.inputs],
            "outputs": [_tensor_metadata(spec) for spec in adapter.outputs],
        })

    async def model_config(self, request: Request) -> Response:
        """Triton's model configuration, so its clients and perf tools size requests."""
        try:
            adapter = self._adapter(request)
        except VegaError as error:
            return error_response(error)
        s = self.settings
        return json_response({
            "name": adapter.name, "platform": "vega", "backend": "vega",
            "max_batch_size": s.max_batch_size,
            "input": [_tensor_config(spec) for spec in adapter.inputs],
            "output": [_tensor_config(spec) for spec in adapter.outputs],
            "dynamic_batching": {
                "preferred_batch_size": [s.max_batch_size],
                "max_queue_delay_microseconds": round(s.max_wait_ms * 1000),
                "priority_levels": len(PRIORITY_NAMES),
                "default_priority_level": NORMAL + 1,
                "default_queue_policy": {
                    "timeout_action": "REJECT",
                    "default_timeout_microseconds": round(s.default_deadline_ms * 1000),
                    "allow_timeout_override": True,
                    "max_queue_size": s.queue_capacity,
                },
            },
        })

    async def stats(self, request: Request) -> Response:
        try:
            adapters = ([self._adapter(request)] if "name" in request.path_params else
                        [served.adapter for served in self.runtime.models.values()])
        except VegaError as error:
            return error_response(error)
        return json_response({"model_stats": [model_stats(self.runtime.metrics, adapter)
                                              for adapter in adapters]})

    def _adapter(self, request: Request) -> ModelAdapter:
        name = request.path_params["name"]
        adapter = self.runtime.served(name).adapter
        version = request.path_params.get("version")
        if version is not None and version != adapter.version:
            raise VegaError("model_not_found", f"model {name!r} has no version {version!r}")
        return adapter


def _tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": [-1, *spec.shape]}


def _tensor_config(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "data_type": CONFIG_TYPES.get(spec.datatype,
                                                             "TYPE_" + spec.datatype),
            "dims": list(spec.shape)}


# -- the request ---------------------------------------------------------------------


def parse_request(body: bytes, headers: Headers, adapter: ModelAdapter,
                  settings: Settings) -> InferRequest:
    """Validate an infer body (JSON header + binary tensors) against the model's contract."""
    header, binary = split_body(body, headers.get(HEADER_LENGTH))
    doc = parse_json(header)
    if not isinstance(doc, dict):
        raise invalid_input("body must be a JSON object")
    unknown = set(doc) - REQUEST_FIELDS
    if unknown:
        raise invalid_input(f"unknown field(s): {', '.join(sorted(unknown))[:200]}")
    request_id = doc.get("id")
    if request_id is not None and not (isinstance(request_id, str) and len(request_id) <= 256):
        # Echoed in the answer, and kept with it for Idempotency-Key replays: as /v1's.
        raise invalid_input("'id' must be a string of at most 256 characters")
    params = _parameters(doc.get("parameters"), "parameters")
    for key in UNSUPPORTED_PARAMETERS:
        if params.get(key):
            raise invalid_input(f"parameter {key!r} is not supported by Vega")
    arrays = _read_inputs(doc.get("inputs"), binary, adapter, settings)
    return InferRequest(
        id=request_id, instances=_rows(arrays, adapter),
        outputs=_requested_outputs(doc.get("outputs"), params, adapter),
        priority=request_priority(params.get("priority"), headers.get("x-vega-priority")),
        deadline_ms=request_deadline_ms(params, headers.get("x-vega-deadline-ms"), settings))


def request_priority(level: Any, header: str | None) -> int:
    """Triton's levels (1 highest) onto Vega's classes; a string is a Vega class name."""
    if level is None or level == 0:
        return parse_priority(header)
    if isinstance(level, str):
        return parse_priority(level)
    if isinstance(level, bool) or not isinstance(level, int) or level < 0:
        raise invalid_input("parameters.priority must be a level >= 0 (1 highest) or one of "
                            + ", ".join(PRIORITY_NAMES))
    return CRITICAL if level == 1 else NORMAL if level == 2 else SHEDDABLE


def request_deadline_ms(params: Mapping[str, Any], header: str | None,
                        settings: Settings) -> float:
    """The tighter of ``timeout`` (µs) and ``deadline_ms``; else the header; capped."""
    given: list[Any] = []
    timeout_us = params.get("timeout")
    if timeout_us is not None and timeout_us != 0:  # Triton: 0 means "no timeout given"
        if isinstance(timeout_us, bool) or not isinstance(timeout_us, (int, float)) \
                or timeout_us < 0:
            raise invalid_input("parameters.timeout must be a number of microseconds >= 0")
        given.append(timeout_us / 1000)
    if params.get("deadline_ms") is not None:
        given.append(params["deadline_ms"])
    return min(parse_deadline_ms(value, settings) for value in given or [header])


def _parameters(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_input(f"{what} must be an object")
    return value


def _read_inputs(inputs: Any, binary: memoryview, adapter: ModelAdapter,
                 settings: Settings) -> dict[str, Any]:
    """Each named input as an array ``[batch, ...]``; binary parts consumed in order."""
    if not isinstance(inputs, list) or not inputs:
        raise invalid_input("'inputs' must be a non-empty list of tensors")
    specs = {spec.name: spec for spec in adapter.inputs}
    arrays: dict[str, Any] = {}
    offset = 0
    for number, tensor in enumerate(inputs):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise invalid_input(f"inputs[{number}] must be an object with a 'name' (one of "
                                f"{', '.join(specs)}), 'datatype', 'shape' and 'data'")
        name = tensor["name"]
        if name not in specs or name in arrays:
            raise invalid_input(f"input {name!r}: not an input of model {adapter.name!r}, or "
                                f"given twice; it takes {', '.join(specs)}")
        spec, what = specs[name], f"input {name}"
        datatype = check_datatype(tensor.get("datatype"), what)
        if not spec.takes(datatype):
            raise invalid_input(f"{what}: datatype {datatype} does not match the model's "
                                f"{'/'.join((spec.datatype, *spec.accepts))}")
        shape = _check_shape(tensor.get("shape"), spec, what, settings)
        params = _parameters(tensor.get("parameters"), f"{what} parameters")
        for key in UNSUPPORTED_PARAMETERS:
            if params.get(key):
                raise invalid_input(f"{what}: {key!r} is not supported by Vega")
        size = params.get("binary_data_size")
        if size is not None and "data" in tensor:  # which one the caller meant is unknown
            raise invalid_input(f"{what}: give 'data' or parameters.binary_data_size, not both")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0 \
                    or offset + size > len(binary):
                raise invalid_input(f"{what}: binary_data_size {size!r} is not within the "
                                    f"{len(binary) - offset} bytes left after the JSON header")
            arrays[name] = from_binary(datatype, shape, binary[offset:offset + size], what)
            offset += size
        elif "data" in tensor:
            arrays[name] = from_json(datatype, shape, tensor["data"], what)
        else:
            raise invalid_input(f"{what}: give 'data' or parameters.binary_data_size")
    missing = [name for name in specs if name not in arrays]
    if missing:
        raise invalid_input(f"missing input(s): {', '.join(missing)}")
    if offset != len(binary):
        raise invalid_input(f"{len(binary) - offset} bytes after the last binary input")
    if len({array.shape[0] for array in arrays.values()}) > 1:
        raise invalid_input("inputs disagree on the batch size (first dimension)")
    return arrays


def _check_shape(shape: Any, spec: TensorSpec, what: str, settings: Settings) -> list[int]:
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise invalid_input(f"{what}: shape must be a list of integers >= 0")
    expected = [-1, *spec.shape]
    if len(shape) != len(expected) or any(e not in (-1, d) for e, d in zip(expected, shape)):
        raise invalid_input(f"{what}: shape {shape} does not match {expected} "
                            "(the first dimension is the batch)")
    if not 1 <= shape[0] <= settings.max_instances:
        raise invalid_input(f"{what}: batch of {shape[0]} rows outside "
                            f"1..{settings.max_instances}")
    return shape


def _rows(arrays: dict[str, Any], adapter: ModelAdapter) -> list[Any]:
    """One instance per row: the row itself, or a dict of rows for several inputs."""
    if len(arrays) == 1:
        return list(next(iter(arrays.values())))
    batch = next(iter(arrays.values())).shape[0]
    return [{name: array[row] for name, array in arrays.items()} for row in range(batch)]


def _requested_outputs(requested: Any, params: Mapping[str, Any],
                       adapter: ModelAdapter) -> list[tuple[TensorSpec, bool]]:
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise invalid_input("parameters.binary_data_output must be true or false")
    if requested is not None and not isinstance(requested, list):
        raise invalid_input("'outputs' must be a list")
    if not requested:  # left out or empty: every output, as Triton answers
        return [(spec, binary_default) for spec in adapter.outputs]
    specs = {spec.name: spec for spec in adapter.outputs}
    chosen: list[tuple[TensorSpec, bool]] = []
    for tensor in requested:
        name = tensor.get("name") if isinstance(tensor, dict) else None
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise invalid_input(f"output {name!r}: not an output of model {adapter.name!r}; "
                                f"it gives {', '.join(specs)}")
        if any(spec is other for other, _ in chosen):
            raise invalid_input(f"output {name!r}: asked for twice")
        params = _parameters(tensor.get("parameters"), f"output {name} parameters")
        for key in UNSUPPORTED_PARAMETERS:
            if params.get(key):
                raise invalid_input(f"output {name}: {key!r} is not supported by Vega")
        binary = params.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise invalid_input(f"output {name}: binary_data must be true or false")
        chosen.append((spec, binary))
    return chosen


# -- the response --------------------------------------------------------------------


def infer_reply(answer: Answer, request: InferRequest, adapter: ModelAdapter) -> Reply:
    """Rows stacked back in order; binary outputs after the JSON header."""
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for spec, binary in request.outputs:
        array = _stack(answer.outputs, spec, adapter)
        entry: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype,
                                 "shape": list(array.shape)}
        if binary:
            blobs.append(to_binary(array, spec.datatype))
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            entry["data"] = to_json(array, spec.datatype)
        tensors.append(entry)
    doc: dict[str, Any] = {"model_name": adapter.name, "model_version": adapter.version,
                           "outputs": tensors}
    if request.id is not None:
        doc["id"] = request.id
    header = outputs_json(doc)
    headers = {"Server-Timing": f"queue;dur={1000 * answer.queue_s:.2f}, "
                                f"infer;dur={1000 * answer.infer_s:.2f}"}
    if answer.degraded:  # as /v1 marks it: the cache keeps no fallback's answer
        headers["X-Vega-Degraded"] = "1"
    if not blobs:
        return Reply(200, header, headers, "ok")
    headers[HEADER_LENGTH] = str(len(header))
    return Reply(200, b"".join([header, *blobs]), headers, "ok", "application/octet-stream")


def _stack(rows: list[Any], spec: TensorSpec, adapter: ModelAdapter) -> Any:
    """One output over all rows; a model with several outputs gives a dict or a sequence."""
    index = adapter.outputs.index(spec)
    try:
        values = [row if len(adapter.outputs) == 1 else
                  row[spec.name] if isinstance(row, Mapping) else row[index] for row in rows]
        return as_datatype(values, spec.datatype)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise VegaError("model_error", f"output {spec.name}: cannot be assembled as "
                        f"{spec.datatype}: {exc}") from None
