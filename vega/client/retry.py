"""The retry rules of one logical call, free of I/O so the sync and async clients share them.

A call has a deadline on the monotonic clock. Each attempt sends what is left of it;
an answer or a transport error either ends the call or names how long to wait before
the next attempt. Waits use *decorrelated jitter* (AWS Architecture Blog, "Exponential
Backoff and Jitter"): ``wait = uniform(floor, 3 * previous wait)``, where the floor is
the server's ``Retry-After`` (or a small base when it named none). Unlike full jitter
(``uniform(0, x)``) it never comes back before the server said it could take the
request, which it computed from its backlog and service rate, and it still spreads
callers that were refused together and backs off further when one wait was not enough.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from vega.client.errors import (
    ConnectionFailedError,
    DeadlineExceededError,
    RefusedError,
    UnavailableError,
    VegaClientError,
    error_from,
)

DEADLINE_HEADER = "X-Vega-Deadline-Ms"
BACKOFF_BASE_S = 0.05  # first wait when the server named none (connection errors)
BACKOFF_CAP_S = 2.0  # ... and the longest such wait
GROWTH = 3.0  # decorrelated jitter's multiplier

# The request never left: retrying cannot run it twice. (A timeout ends the call:
# an attempt's timeout is what was left of the deadline.)
NEVER_SENT = (httpx.ConnectError,)
# The request may have reached the server: safe to resend only when it is idempotent.
MAYBE_SENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

# (status, error code) of each attempt; no answer is status 0, code "connection" or "timeout"
Observer = Callable[[int, str], None]


@dataclass(frozen=True)
class Policy:
    """How a client retries; the same for all its calls."""

    max_attempts: int = 8  # a backstop: the deadline is the real bound
    min_attempt_s: float = 0.01  # no attempt is started with less of the deadline left
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    observer: Observer | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.min_attempt_s >= 0:
            raise ValueError("min_attempt_s must be >= 0")


@dataclass(frozen=True)
class Call:
    """One logical call, encoded once: every attempt sends the same bytes."""

    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    resend_safe: bool  # a resend after the request may have arrived cannot double its effect
    send_deadline: bool = True


class Attempts:
    """The attempts of one call: what each sends, and what happens after each."""

    def __init__(self, call: Call, policy: Policy, deadline_s: float) -> None:
        if not (deadline_s > 0 and math.isfinite(deadline_s)):
            raise ValueError(f"deadline_s must be a positive number, not {deadline_s!r}")
        self.call = call
        self.policy = policy
        self.deadline = policy.clock() + deadline_s
        self.count = 0
        self.last: VegaClientError | None = None
        self.waited_s = 0.0  # the previous wait, for decorrelated jitter

    def remaining_s(self) -> float:
        return self.deadline - self.policy.clock()

    def start(self) -> tuple[dict[str, str], float]:
        """Headers and timeout (seconds) of the next attempt; raises when no time is left."""
        left = self.remaining_s()
        if left <= 0 or (self.count and left < self.policy.min_attempt_s):
            raise self.expired("deadline passed before another attempt")
        self.count += 1
        headers = dict(self.call.headers)
        if self.call.send_deadline:
            # Rounded down so the server's deadline is never later than the caller's.
            headers[DEADLINE_HEADER] = str(max(1, math.floor(1000 * left)))
        return headers, left

    def answered(self, response: httpx.Response) -> float | None:
        """None when ``response`` ends the call with success; else the wait before the next
        attempt. Raises the typed error when the answer is final."""
        status = response.status_code
        if 200 <= status < 300:
            self.observe(status, "")
            if self.remaining_s() < 0:  # an answer trickled past it (each read was in time)
                raise self.expired("the answer ended after the deadline")
            return None
        error = error_from(status, response.headers, response.content)
        self.observe(status, error.code)
        if isinstance(error, (RefusedError, UnavailableError)):
            return self.backoff(error)
        # The words of admission's NeverFits for a deadline; a bad deadline_ms names it too.
        if status == 422 and self.last is not None and "than its deadline" in error.message:
            # The same body took a refusal before: only the deadline left changed, and it
            # is now shorter than the request takes on an idle server. Any other 422 is a
            # wrong request that a refusal for load answered before its input was checked.
            raise self.expired(f"too little of the deadline left ({error.message})")
        error.attempts = self.count
        raise error

    def failed(self, exc: Exception) -> float:
        """The wait before the next attempt after a transport error, or raises."""
        if isinstance(exc, (httpx.TimeoutException, TimeoutError)):
            self.observe(0, "timeout")
            raise self.expired(f"no answer within the deadline ({type(exc).__name__})")
        self.observe(0, "connection")
        error = ConnectionFailedError(f"{type(exc).__name__}: {exc}", code="connection",
                                      attempts=self.count)
        if isinstance(exc, NEVER_SENT) or (isinstance(exc, MAYBE_SENT) and self.call.resend_safe):
            return self.backoff(error)
        raise error from exc

    def backoff(self, error: VegaClientError) -> float:
        """Seconds to wait before retrying after ``error``; raises when that is not allowed."""
        self.last = error
        error.attempts = self.count
        if self.count >= self.policy.max_attempts:
            raise error
        hint = error.retry_after_s
        floor = hint if hint is not None and hint > 0 else BACKOFF_BASE_S
        upper = max(floor, GROWTH * (self.waited_s or floor))
        if hint is None:
            upper = max(floor, min(upper, BACKOFF_CAP_S))
        room = self.remaining_s() - self.policy.min_attempt_s
        if floor > room:
            raise self.expired(f"the next attempt is due in {floor:.3f} s; only "
                               f"{max(0.0, self.remaining_s()):.3f} s of the deadline left")
        wait = self.policy.rng.uniform(floor, min(upper, room))
        self.waited_s = wait
        return wait

    def expired(self, why: str) -> DeadlineExceededError:
        last = f"; last: {self.last.status or 'no answer'} {self.last.code}" if self.last else ""
        return DeadlineExceededError(f"{why} after {self.count} attempt(s){last}",
                                     last=self.last, attempts=self.count)

    def observe(self, status: int, code: str) -> None:
        if self.policy.observer is not None:
            self.policy.observer(status, code)
