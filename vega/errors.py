"""The error vocabulary of DESIGN.md: one exception type, one code per situation."""

from __future__ import annotations

import math

STATUS_BY_CODE: dict[str, int] = {
    "invalid_json": 400,
    "unauthorized": 401,
    "not_found": 404,
    "model_not_found": 404,
    "job_not_found": 404,
    "method_not_allowed": 405,
    "conflict": 409,
    "payload_too_large": 413,
    "headers_too_large": 431,  # answered by vega.transport, before any request exists
    "invalid_input": 422,
    "rate_limited": 429,
    "queue_full": 429,
    "shed": 429,
    "deadline_unmeetable": 429,
    "model_error": 500,
    "internal_error": 500,
    "not_ready": 503,
    "draining": 503,
    "deadline_exceeded": 504,
}

# Codes meaning "this request was refused before any work on it began".
REFUSALS = frozenset({"rate_limited", "queue_full", "shed", "deadline_unmeetable",
                      "not_ready", "draining"})


# The shortest wait a refusal advertises in its body: a refused caller that retries sooner
# meets the same backlog. (Retry-After itself is whole seconds, at least 1.)
MIN_RETRY_MS = 50.0


class VegaError(Exception):
    """An answer other than 200: its code decides the status (DESIGN.md table)."""

    def __init__(self, code: str, message: str, retry_after_ms: float | None = None) -> None:
        if code not in STATUS_BY_CODE:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms

    @property
    def status(self) -> int:
        return STATUS_BY_CODE[self.code]

    def body(self) -> dict[str, object]:
        error: dict[str, object] = {"code": self.code, "message": self.message}
        if self.retry_after_ms is not None:
            error["retry_after_ms"] = round(self.retry_after_ms)
        return {"error": error}

    def headers(self) -> dict[str, str]:
        if self.retry_after_ms is None:
            return {}
        # Retry-After is whole seconds; never advertise 0, which invites a stampede.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000)))}

    def __repr__(self) -> str:
        return f"VegaError({self.code!r}, {self.message!r})"


def missed_deadline(deadline: float, now: float, retry_after_s: float,
                    expired: str = "deadline passed while queued") -> VegaError:
    """The answer for an item whose batch would end after its deadline (DESIGN.md rule 1,
    again at dispatch): 504 once the deadline has passed; with it still ahead, the refusal
    admission would have given (429 ``deadline_unmeetable``, which a caller that can wait
    turns into a job), its Retry-After the backlog's."""
    if deadline <= now:
        return VegaError("deadline_exceeded", expired)
    return VegaError("deadline_unmeetable", "the batch it would run in ends after its deadline",
                     retry_after_ms=max(MIN_RETRY_MS, 1000 * retry_after_s))


def invalid_input(message: str) -> VegaError:
    return VegaError("invalid_input", message)


def drain_ran_out() -> VegaError:
    """For an item still queued when the drain's time is up: it never began."""
    return VegaError("draining", "this process is shutting down: its drain ran out before "
                     "this request's batch began", retry_after_ms=1000.0)


def reraisable(error: BaseException | None) -> VegaError:
    """A new exception to raise for the one an item's future holds.

    Raising the held one would hang this request's frames on its traceback, and the
    frames hold the items, whose futures hold it: a cycle per refused request that only
    the collector frees, after it has reached the oldest generation.
    """
    if isinstance(error, VegaError):
        return VegaError(error.code, error.message, error.retry_after_ms)
    return VegaError("model_error", f"internal error: {type(error).__name__}")
