"""What each client method sends and how its answer is read, shared by both clients.

The infer deadline travels in ``X-Vega-Deadline-Ms``, never in the body: the body is
encoded once per call so that every retry sends the same bytes, which an
``Idempotency-Key`` requires (the server fingerprints the body and refuses a key
reused with another one), and the header lets each attempt carry what is left.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
import orjson

from vega import __version__
from vega.client.errors import (
    DeadlineExceededError,
    JobFailedError,
    ServerError,
    asked_wait_s,
    retry_after_header,
)
from vega.client.retry import Call

PRIORITIES = ("critical", "normal", "sheddable")
PENDING = frozenset({"queued", "running"})
POLL_FIRST_S, POLL_MAX_S = 0.05, 1.0  # wait_job's polling when the server names no wait


def base_headers(token: str | None) -> dict[str, str]:
    headers = {"Accept": "application/json", "User-Agent": f"vega-client/{__version__}"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def new_key() -> str:
    return uuid.uuid4().hex


def _model_path(model: str | None, leaf: str) -> str:
    return f"/v1/{leaf}" if model is None else f"/v1/models/{quote(model, safe='')}/{leaf}"


def _body(inputs: Any, instances: Any, extra: dict[str, Any]) -> bytes:
    if (inputs is None) == (instances is None):
        raise ValueError("give exactly one of inputs or instances")
    doc = {"inputs": inputs} if inputs is not None else {"instances": instances}
    body = orjson.dumps(doc | extra, option=orjson.OPT_SERIALIZE_NUMPY)
    # orjson writes NaN and infinity as null, which the server would refuse as a value
    # that is not a number: say what it is, here. Walked only when the body holds null.
    if b"null" in body and not _finite(doc):
        raise ValueError("the inputs hold NaN or infinity, which JSON cannot carry")
    return body


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    tolist = getattr(value, "tolist", None)  # a numpy array or scalar, numpy not imported
    return _finite(tolist()) if callable(tolist) else True


def _priority_header(priority: str | None) -> dict[str, str]:
    if priority is None:
        return {}
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    # A header, not a body field: the server can refuse on it before reading the body.
    return {"X-Vega-Priority": priority}


def infer_call(inputs: Any, instances: Any, model: str | None, priority: str | None,
               idempotency_key: str | None) -> Call:
    headers = {"Content-Type": "application/json", **_priority_header(priority)}
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    return Call("POST", _model_path(model, "infer"), _body(inputs, instances, {}), headers,
                resend_safe=idempotency_key is not None)


def submit_call(inputs: Any, instances: Any, model: str | None, priority: str | None,
                ttl_s: float | None, idempotency_key: str | None) -> Call:
    # Always keyed, so that a resend of a submit whose answer was lost cannot add a job.
    headers = {"Content-Type": "application/json", **_priority_header(priority),
               "Idempotency-Key": idempotency_key or new_key()}
    extra = {} if ttl_s is None else {"ttl_s": ttl_s}
    # No deadline header: the job's life is its ttl_s; this call's deadline only bounds
    # how long the client tries to get the submit accepted.
    return Call("POST", _model_path(model, "jobs"), _body(inputs, instances, extra), headers,
                resend_safe=True, send_deadline=False)


def job_call(method: str, job_id: str) -> Call:
    if not job_id:
        raise ValueError("job id is empty")
    # GET and DELETE are idempotent: resending after a lost answer changes nothing more.
    return Call(method, f"/v1/jobs/{quote(job_id, safe='')}", None, {}, resend_safe=True,
                send_deadline=False)


def _json(response: httpx.Response) -> Any:
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        raise ServerError(f"answer {response.status_code} is not JSON",
                          status=response.status_code, code="bad_answer") from None


def outputs_of(response: httpx.Response) -> Any:
    doc = _json(response)
    if not isinstance(doc, dict) or "outputs" not in doc:
        raise ServerError("answer has no outputs", status=response.status_code, code="bad_answer")
    return doc["outputs"]


class JobId(str):
    """A job's id as ``submit_job`` returns it: a ``str`` that also carries when the wait
    its 202 asked for ends (``due``, on the client's clock), before which ``wait_job``
    does not look at the job."""

    due: float | None

    def __new__(cls, value: str, due: float | None = None) -> JobId:
        job_id = super().__new__(cls, value)
        job_id.due = due
        return job_id


def job_id_of(response: httpx.Response, clock: Callable[[], float]) -> JobId:
    doc = _json(response)
    job_id = doc.get("id") if isinstance(doc, dict) else None
    if not isinstance(job_id, str) or not job_id:
        raise ServerError("job answer has no id", status=response.status_code, code="bad_answer")
    wait_s = asked_wait_s(doc, response.headers)
    return JobId(job_id, None if wait_s is None else clock() + wait_s)


def _wait_asked(response: httpx.Response) -> float | None:
    """The answer's ``Retry-After`` in seconds; None where it names none, or 0 (a proxy's:
    no reason to poll at once, nor to give up)."""
    wait_s = retry_after_header(response.headers.get("retry-after"))
    return wait_s if wait_s is not None and wait_s > 0 else None


def job_of(response: httpx.Response) -> dict[str, Any]:
    doc = _json(response)
    if not isinstance(doc, dict) or not isinstance(doc.get("status"), str):
        raise ServerError("job answer has no status", status=response.status_code,
                          code="bad_answer")
    return doc


class JobPoll:
    """``wait_job``'s loop without its I/O: when to look again, and what a status means."""

    def __init__(self, timeout_s: float, clock: Callable[[], float], rng: random.Random,
                 min_attempt_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number, not {timeout_s!r}")
        self.deadline = clock() + timeout_s
        self.clock = clock
        self.rng = rng
        self.min_attempt_s = min_attempt_s
        self.interval_s = POLL_FIRST_S
        self.outputs: Any = None
        self.polls = 0

    def first_wait_s(self, job_id: str) -> float:
        """Seconds before the first look: until the submit's ``Retry-After`` ends (the
        job is not expected done before), within the timeout; 0 for a bare id."""
        due = job_id.due if isinstance(job_id, JobId) else None
        if due is None:
            return 0.0
        return max(0.0, min(due - self.clock(), self.remaining_s() - self.min_attempt_s))

    def remaining_s(self) -> float:
        left = self.deadline - self.clock()
        if left <= 0:
            raise DeadlineExceededError(f"job not finished within the timeout "
                                        f"({self.polls} polls)", attempts=self.polls)
        return left

    def seen(self, response: httpx.Response) -> float | None:
        """None once the job is done (``outputs`` set); else seconds until the next look.
        Raises JobFailedError for a job that ended without outputs."""
        self.polls += 1
        job = job_of(response)
        status = job["status"]
        if status == "done":
            self.outputs = job.get("outputs")
            return None
        if status not in PENDING:
            error = job.get("error")
            code = error.get("code") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else None
            raise JobFailedError(str(message or f"job {status}"), status=response.status_code,
                                 code=str(code or status), attempts=self.polls)
        asked = _wait_asked(response)
        wait = self.rng.uniform(self.interval_s / 2, self.interval_s) if asked is None else asked
        self.interval_s = min(POLL_MAX_S, 1.5 * self.interval_s)
        left = self.remaining_s() - self.min_attempt_s
        if left <= 0:
            raise DeadlineExceededError(f"job still {status} at the timeout "
                                        f"({self.polls} polls)", attempts=self.polls)
        return min(wait, left)
