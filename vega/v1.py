"""The ``/v1`` dialect: Vega's own JSON bodies and error shape (DESIGN.md).

``parse_infer_body`` reads a ``/v1/infer`` body and its headers; ``V1`` is the
``vega.calls.Dialect`` the request stack speaks on ``/v1``. The job routes
(vega/jobs/routes.py) parse their bodies with the same function, so a job body is
checked exactly as an inline one.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from vega.calls import Call, Reply
from vega.config import Settings
from vega.errors import VegaError
from vega.httpio import (
    claimed_priority,
    decompress,
    outputs_json,
    parse_deadline_ms,
    parse_json,
    parse_priority,
)
from vega.pressure.idempotency import fingerprint
from vega.runtime import Answer, Runtime

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
    # A field given as null is not given: the header, if any, stands (as on /v2).
    priority = parse_priority(_field(doc, "priority", request, "x-vega-priority"))
    deadline_ms = parse_deadline_ms(_field(doc, "deadline_ms", request, "x-vega-deadline-ms"),
                                    settings)
    return instances, single, priority, deadline_ms


def _field(doc: dict[str, Any], name: str, request: Request, header: str) -> Any:
    value = doc.get(name)
    return request.headers.get(header) if value is None else value


# What a retry may change and still ask for the same answer: its time left, its class.
NOT_FINGERPRINTED = frozenset({"deadline_ms", "priority"})


def _asked(doc: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in doc.items() if key not in NOT_FINGERPRINTED}


class V1:
    """The ``/v1`` dialect: Vega's own JSON bodies and error shape (DESIGN.md)."""

    refuses_unread = True

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings

    def model(self, request: Request) -> str:
        return str(request.path_params.get("name") or self.runtime.default_model)

    def claimed(self, request: Request, body: bytes) -> int | None:
        return claimed_priority(body, request.headers)

    def parse(self, request: Request, model: str, body: bytes, keyed: bool) -> Call:
        """The call a /v1 body makes, fingerprinted when ``keyed`` (idempotent).

        The parsed document ends here: the runtime empties ``call.instances`` once it
        has decoded them, and no frame that waits may still hold the rest of it.
        """
        encoding = request.headers.get("content-encoding")
        if encoding is not None:
            body = decompress(body, encoding, self.settings.max_body_bytes)
        doc = parse_json(body)
        instances, single, priority, deadline_ms = parse_infer_body(doc, request, self.settings)
        ident = doc.get("id")
        if ident is not None and not (isinstance(ident, str) and len(ident) <= 256):
            raise VegaError("invalid_input", "id must be a string of at most 256 characters")
        shape = "1" if single else "n"  # the answer echoes the id: it keys a cached one too
        return Call(request, self, model, instances, priority, deadline_ms,
                    variant=shape if ident is None else f"{shape}:{ident}",
                    # Named for its protocol: one key on /v1 and /v2 is a conflict, not a
                    # replay of the other's answer.
                    fingerprint=f"v1:{fingerprint(_asked(doc))}" if keyed else "",
                    context=(single, ident))

    def render(self, call: Call, answer: Answer) -> Reply:
        single, ident = call.context
        outputs = answer.outputs[0] if single else answer.outputs
        doc = {"model": answer.model or call.model, "outputs": outputs}
        if ident is not None:
            doc["id"] = ident
        body = outputs_json(doc)
        headers = {"Server-Timing": f"queue;dur={1000 * answer.queue_s:.2f}, "
                                    f"infer;dur={1000 * answer.infer_s:.2f}"}
        if answer.degraded:
            headers["X-Vega-Degraded"] = "1"
        return Reply(200, body, headers, "ok")

    def refusal(self, error: VegaError) -> Reply:
        return Reply.from_error(error)
