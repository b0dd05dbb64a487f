"""What passes through the request stack (vega.stack): one parsed inference call and its reply.

Each protocol is a ``Dialect`` (``/v1`` in vega.v1, the Open Inference Protocol in
vega.oip): it names the model a request is for, turns a body into a ``Call``, and writes
answers and errors as ``Reply``s in its own shape. The layers between (idempotency, cache,
the runtime) see only these, so they work the same for every protocol.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from starlette.requests import Request

from vega.errors import VegaError
from vega.records import deadline_at

if TYPE_CHECKING:
    from vega.runtime import Answer


@dataclass
class Call:
    """One inference request, parsed and validated by its protocol."""

    request: Request
    dialect: Dialect
    model: str
    instances: list[Any]  # emptied by the runtime once decoded
    priority: int
    deadline_ms: float
    # How the answer is rendered (part of the cache key): "1", "n", a v2 output request.
    variant: str
    fingerprint: str = ""  # of the body, when an Idempotency-Key names the call
    context: Any = None  # what the protocol needs to render the answer
    # The loop time the request came in (the stack sets it): its deadline counts from
    # then, not from when a slow upload had finished.
    arrived: float | None = None

    def deadline(self, now: float) -> float:
        """The loop time of its deadline (counted from ``now`` where arrival is unknown)."""
        return deadline_at(self.deadline_ms, now, self.arrived)


@dataclass
class Reply:
    """An answer as sent, kept to be sent again (idempotency replays, cache hits)."""

    status: int
    body: bytes
    headers: dict[str, str]
    outcome: str  # what vega_requests_total counted it as
    media_type: str | None = "application/json"

    def encode(self) -> dict[str, Any]:
        try:
            body = {"body": self.body.decode()}
        except UnicodeDecodeError:  # the binary tensor extension
            body = {"body_b64": base64.b64encode(self.body).decode()}
        return {"status": self.status, **body, "headers": self.headers,
                "outcome": self.outcome, "media_type": self.media_type}

    @classmethod
    def decode(cls, doc: Any) -> Reply:
        body = (base64.b64decode(str(doc["body_b64"]), validate=True) if "body_b64" in doc
                else str(doc["body"]).encode())
        media = doc.get("media_type", "application/json")
        return cls(int(doc["status"]), body,
                   {str(k): str(v) for k, v in doc["headers"].items()}, str(doc["outcome"]),
                   None if media is None else str(media))

    @classmethod
    def from_error(cls, error: VegaError) -> Reply:
        """``error`` in Vega's own error shape (``/v1`` and the job routes)."""
        return cls(error.status, orjson.dumps(error.body()), error.headers(), error.code)

    def without(self, *names: str) -> Reply:
        """This reply less the headers ``names`` (what only the first sending should carry)."""
        drop = {name.lower() for name in names}
        return Reply(self.status, self.body,
                     {k: v for k, v in self.headers.items() if k.lower() not in drop},
                     self.outcome, self.media_type)


# A header's name (an HTTP token) and value (no control character but tab): the HTTP
# server refuses to write any other, and the request gets a 500 in its place.
_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")


def stored_reply(doc: Any) -> Reply | None:
    """A reply read back from Redis (``Reply.encode``'s form), or None where it is none
    that Vega wrote or one no HTTP server would send: another program may have written it."""
    try:
        reply = Reply.decode(doc)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    sendable = 200 <= reply.status <= 599 and all(
        _NAME.fullmatch(name) is not None and _VALUE.fullmatch(text) is not None
        and text.isascii() for name, text in reply.headers.items())
    return reply if sendable else None


class Dialect(Protocol):
    """How one API reads inference requests and writes their answers."""

    # Refuse before the body is read when not even a critical request would get in (/v1);
    # v2 clients name their class in the body, so v2 reads it first and refuses by it.
    refuses_unread: bool

    def model(self, request: Request) -> str:
        """The model the request is for (404 for one, or a version, it does not have)."""

    def claimed(self, request: Request, body: bytes) -> int | None:
        """The class the body will be taken at, read without parsing it; None where only
        the parse can tell (a refusal for load then costs no parse)."""

    def parse(self, request: Request, model: str, body: bytes, keyed: bool) -> Call:
        """The validated call; ``keyed``: an Idempotency-Key came, so fingerprint the body."""

    def render(self, call: Call, answer: Answer) -> Reply: ...

    def refusal(self, error: VegaError) -> Reply: ...


Handler = Callable[[Call], Awaitable[Reply]]
