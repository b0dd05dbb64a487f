"""A polite client for Vega's ``/v1`` routes: sync ``Client`` and async ``AsyncClient``.

Each call has a deadline; every attempt sends what is left of it. Refusals (429) and
unavailability (503) are retried after the server's ``Retry-After``, with jitter, and
never past the deadline; connection errors are retried when the request cannot have
run (or is idempotent). Job submissions always carry an ``Idempotency-Key``. Answers
other than success raise a ``VegaClientError`` subclass carrying the server's
``error.code``. See docs/client.md. Needs only httpx and orjson (``pip install
vega[client]``); nothing of the server is imported.
"""

from vega.client.clients import AsyncClient, Client
from vega.client.errors import (
    ConnectionFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    JobFailedError,
    RefusedError,
    ServerError,
    UnavailableError,
    VegaClientError,
)
from vega.client.retry import DEADLINE_HEADER, Policy

__all__ = [
    "DEADLINE_HEADER", "AsyncClient", "Client", "ConnectionFailedError", "DeadlineExceededError",
    "InvalidRequestError", "JobFailedError", "Policy", "RefusedError", "ServerError",
    "UnavailableError", "VegaClientError",
]
