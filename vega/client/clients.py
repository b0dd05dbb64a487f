"""``Client`` and ``AsyncClient``: the same methods, blocking or awaitable, on httpx."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import ssl
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import httpx

from vega.client import calls
from vega.client.errors import InvalidRequestError, VegaClientError
from vega.client.retry import Attempts, Call, Observer, Policy

DEFAULT_URL = "http://127.0.0.1:8000"


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default verifying context, built once: building one costs tens of ms, and
    httpx builds one per client, so a process with many clients would pay that many."""
    return httpx.create_ssl_context()


JOB_CALL_S = 10.0  # a job call's default bound, past a Retry-After or two


@contextlib.contextmanager
def keyed(call: Call) -> Iterator[None]:
    """Errors of ``call`` carry the Idempotency-Key it sent (generated for a submit)."""
    try:
        yield
    except VegaClientError as error:
        error.idempotency_key = call.headers.get("Idempotency-Key")
        raise


class _Base:
    def __init__(self, *, token: str | None, deadline_s: float, max_attempts: int,
                 min_attempt_s: float, observer: Observer | None,
                 rng: random.Random | None) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be a positive number, not {deadline_s!r}")
        self.deadline_s = deadline_s
        self.policy = Policy(max_attempts=max_attempts, min_attempt_s=min_attempt_s,
                             rng=rng or random.Random(), observer=observer)
        self.headers = calls.base_headers(token)

    def _attempts(self, call: Call, deadline_s: float | None) -> Attempts:
        if deadline_s is None:  # a job call waits out a Retry-After (1 s or more) at least once
            deadline_s = self.deadline_s if call.send_deadline else max(self.deadline_s,
                                                                          JOB_CALL_S)
        return Attempts(call, self.policy, deadline_s)

    def _poll(self, timeout_s: float) -> calls.JobPoll:
        return calls.JobPoll(timeout_s, self.policy.clock, self.policy.rng,
                             self.policy.min_attempt_s)


class Client(_Base):
    """A blocking client for Vega's ``/v1`` routes.

    ``deadline_s`` is the default deadline of a call (each method takes its own); a
    call retries refusals (429), unavailability (503) and safe connection errors within
    it, waiting as the server asks, and raises a ``VegaClientError`` subclass otherwise.
    """

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None,
                 deadline_s: float = 1.0, max_attempts: int = 8, min_attempt_s: float = 0.01,
                 max_connections: int = 100, uds: str | None = None,
                 transport: httpx.BaseTransport | None = None, observer: Observer | None = None,
                 rng: random.Random | None = None) -> None:
        super().__init__(token=token, deadline_s=deadline_s, max_attempts=max_attempts,
                         min_attempt_s=min_attempt_s, observer=observer, rng=rng)
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._http = httpx.Client(base_url=base_url, headers=self.headers,
                                  transport=transport or httpx.HTTPTransport(
                                      uds=uds, limits=limits, verify=tls_context()))

    def infer(self, inputs: Any = None, *, instances: Any = None, model: str | None = None,
              priority: str | None = None, deadline_s: float | None = None,
              idempotency_key: str | None = None) -> Any:
        """The model's outputs for one window (``inputs``) or a list of them (``instances``)."""
        call = calls.infer_call(inputs, instances, model, priority, idempotency_key)
        return calls.outputs_of(self._send(call, deadline_s))

    def submit_job(self, inputs: Any = None, *, instances: Any = None, model: str | None = None,
                   priority: str | None = None, ttl_s: float | None = None,
                   idempotency_key: str | None = None, timeout_s: float | None = None) -> str:
        """Submit a job (``POST /v1/jobs``); its id (a ``str`` that carries the answer's
        Retry-After for ``wait_job``). Always sent with an Idempotency-Key."""
        call = calls.submit_call(inputs, instances, model, priority, ttl_s, idempotency_key)
        return calls.job_id_of(self._send(call, timeout_s), self.policy.clock)

    def job(self, job_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """The job's status document (``GET /v1/jobs/{id}``)."""
        return calls.job_of(self._send(calls.job_call("GET", job_id), timeout_s))

    def wait_job(self, job_id: str, timeout_s: float) -> Any:
        """Poll the job until it is done and return its outputs; JobFailedError if it failed
        or expired, DeadlineExceededError if it is still pending after ``timeout_s``.
        Looks first once the Retry-After of the submit that returned ``job_id`` ends,
        then as each answer's Retry-After says, or backing off; never past the timeout."""
        poll = self._poll(timeout_s)
        wait: float | None = poll.first_wait_s(job_id)
        while wait is not None:
            time.sleep(wait)
            wait = poll.seen(self._send(calls.job_call("GET", job_id), poll.remaining_s()))
        return poll.outputs

    def cancel_job(self, job_id: str, *, timeout_s: float | None = None) -> bool:
        """Cancel a job not yet run: True if cancelled, False if it had already started."""
        try:
            self._send(calls.job_call("DELETE", job_id), timeout_s)
        except InvalidRequestError as error:
            if error.status == 409:
                return False
            raise
        return True

    def _send(self, call: Call, deadline_s: float | None) -> httpx.Response:
        attempts = self._attempts(call, deadline_s)
        with keyed(call):
            while True:
                headers, timeout_s = attempts.start()
                try:
                    response = self._http.request(call.method, call.path, content=call.body,
                                                  headers=headers, timeout=timeout_s)
                except httpx.TransportError as exc:
                    wait = attempts.failed(exc)
                else:
                    answered = attempts.answered(response)
                    if answered is None:
                        return response
                    wait = answered
                time.sleep(wait)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


class AsyncClient(_Base):
    """``Client``'s methods as coroutines; each attempt is also bounded by what is left of
    the deadline as a whole (``asyncio.timeout``), not only per network operation."""

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None,
                 deadline_s: float = 1.0, max_attempts: int = 8, min_attempt_s: float = 0.01,
                 max_connections: int = 100, uds: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 observer: Observer | None = None, rng: random.Random | None = None) -> None:
        super().__init__(token=token, deadline_s=deadline_s, max_attempts=max_attempts,
                         min_attempt_s=min_attempt_s, observer=observer, rng=rng)
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=self.headers,
            transport=transport or httpx.AsyncHTTPTransport(uds=uds, limits=limits,
                                                           verify=tls_context()))

    async def infer(self, inputs: Any = None, *, instances: Any = None,
                    model: str | None = None, priority: str | None = None,
                    deadline_s: float | None = None, idempotency_key: str | None = None) -> Any:
        """As ``Client.infer``."""
        call = calls.infer_call(inputs, instances, model, priority, idempotency_key)
        return calls.outputs_of(await self._send(call, deadline_s))

    async def submit_job(self, inputs: Any = None, *, instances: Any = None,
                         model: str | None = None, priority: str | None = None,
                         ttl_s: float | None = None, idempotency_key: str | None = None,
                         timeout_s: float | None = None) -> str:
        """As ``Client.submit_job``."""
        call = calls.submit_call(inputs, instances, model, priority, ttl_s, idempotency_key)
        return calls.job_id_of(await self._send(call, timeout_s), self.policy.clock)

    async def job(self, job_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """As ``Client.job``."""
        return calls.job_of(await self._send(calls.job_call("GET", job_id), timeout_s))

    async def wait_job(self, job_id: str, timeout_s: float) -> Any:
        """As ``Client.wait_job``."""
        poll = self._poll(timeout_s)
        wait: float | None = poll.first_wait_s(job_id)
        while wait is not None:
            await asyncio.sleep(wait)
            wait = poll.seen(await self._send(calls.job_call("GET", job_id),
                                              poll.remaining_s()))
        return poll.outputs

    async def cancel_job(self, job_id: str, *, timeout_s: float | None = None) -> bool:
        """As ``Client.cancel_job``."""
        try:
            await self._send(calls.job_call("DELETE", job_id), timeout_s)
        except InvalidRequestError as error:
            if error.status == 409:
                return False
            raise
        return True

    async def _send(self, call: Call, deadline_s: float | None) -> httpx.Response:
        attempts = self._attempts(call, deadline_s)
        with keyed(call):
            while True:
                headers, timeout_s = attempts.start()
                try:
                    async with asyncio.timeout(timeout_s):
                        response = await self._http.request(call.method, call.path,
                                                            content=call.body, headers=headers,
                                                            timeout=timeout_s)
                except (httpx.TransportError, TimeoutError) as exc:
                    wait = attempts.failed(exc)
                else:
                    answered = attempts.answered(response)
                    if answered is None:
                        return response
                    wait = answered
                await asyncio.sleep(wait)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.aclose()
