"""The client's error vocabulary: one base class, one subclass per kind of answer.

Every error carries the HTTP status (None when no answer came), the server's
``error.code``, its message and the wait the server asked for, in seconds.
"""

from __future__ import annotations

import email.utils
import math
import time
from typing import Any

import orjson


class VegaClientError(Exception):
    """A call that did not produce outputs."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "",
                 retry_after_s: float | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.attempts = attempts  # attempts the call had made when this was raised
        # The Idempotency-Key the call sent, if any: a submit that failed may still have
        # been stored, and only a retry with this key cannot add a second job.
        self.idempotency_key: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r}, " \
               f"message={self.message!r})"


class RefusedError(VegaClientError):
    """429: the service refused the request to protect itself (rate, queue, shed, deadline)."""


class UnavailableError(VegaClientError):
    """503: the process could not take work now (starting, draining); nothing ran."""


class InvalidRequestError(VegaClientError):
    """Any other 4xx: the request is wrong (input, model, token, size); never retried."""


class ServerError(VegaClientError):
    """A 5xx other than 503 and 504: the model raised, or a proxy failed."""


class ConnectionFailedError(VegaClientError):
    """No answer: the connection failed and retrying was not safe or not allowed."""


class DeadlineExceededError(VegaClientError):
    """The caller's deadline passed: on the client (no time left for another attempt, or
    the attempt timed out) or on the server (504 ``deadline_exceeded``).

    ``last`` is the refusal or connection error that the last attempt got, if any.
    """

    def __init__(self, message: str, *, last: VegaClientError | None = None,
                 status: int | None = None, code: str = "deadline_exceeded",
                 attempts: int = 0) -> None:
        super().__init__(message, status=status, code=code,
                         retry_after_s=last.retry_after_s if last else None, attempts=attempts)
        self.last = last


class JobFailedError(VegaClientError):
    """A job ended without outputs: ``code`` is its error's code, or ``expired``."""


def error_from(status: int, headers: Any, body: bytes) -> VegaClientError:
    """The typed error for a non-2xx answer (a Vega error body, or anything a proxy sent)."""
    code, message = "", ""
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        code = _text(error.get("code"))
        message = _text(error.get("message"))
    if not message:
        message = body[:200].decode(errors="replace").strip() or f"HTTP {status}"
    retry_after_s = asked_wait_s(error, headers)
    kind: type[VegaClientError]
    if status == 429:
        kind = RefusedError
    elif status == 503:
        kind = UnavailableError
    elif status == 504:
        return DeadlineExceededError(f"server: {message}", status=504,
                                     code=code or "deadline_exceeded")
    elif 400 <= status < 500:
        kind = InvalidRequestError
    else:
        kind = ServerError
    return kind(message, status=status, code=code, retry_after_s=retry_after_s)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def asked_wait_s(doc: Any, headers: Any) -> float | None:
    """The wait an answer asks for, in seconds: ``doc``'s ``retry_after_ms`` (precise),
    else the ``Retry-After`` header (whole seconds, DESIGN.md); None if neither is usable."""
    given = doc.get("retry_after_ms") if isinstance(doc, dict) else None
    if isinstance(given, (int, float)) and not isinstance(given, bool) and \
            math.isfinite(given) and given >= 0:
        return given / 1000
    return retry_after_header(headers.get("retry-after"))


def retry_after_header(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP date; None if unusable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())  # a date is wall-clock by definition
