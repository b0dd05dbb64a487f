"""The job routes: submit, poll, cancel; and ``Prefer: respond-async`` on /v1/infer.

A job body is the /v1/infer body plus ``ttl_s``, parsed and checked by the same code
as /v1/infer (vega.v1's parser, and the model's own input check), so a bad body gets
the same 4xx and nothing is stored. Ids are checked by their form before any store is
asked.
"""

from __future__ import annotations

import math
import time
from typing import Any

import orjson
import redis.exceptions as rexc
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from vega.calls import Reply
from vega.errors import MIN_RETRY_MS, VegaError, invalid_input
from vega.httpio import (
    JSON,
    claimed_priority,
    decompress,
    error_response,
    json_response,
    named_priority,
    parse_json,
    read_body,
)
from vega.jobs.runner import STORE_ERRORS
from vega.jobs.store import CANCELLED, QUEUED, Job, new_id, valid_id, wall_ms
from vega.models import decode_all
from vega.pressure.idempotency import fingerprint, parse_key
from vega.records import NORMAL
from vega.runtime import Runtime
from vega.stack import DISCONNECTED, LOAD_REFUSALS, conclude, internal_error
from vega.v1 import parse_infer_body


def wants_async(request: Request) -> bool:
    """Whether the request carries ``Prefer: respond-async`` (RFC 7240)."""
    prefer = request.headers.get("prefer")
    if not prefer:
        return False
    return any(part.split(";")[0].split("=")[0].strip().lower() == "respond-async"
               for part in prefer.split(","))


def _store_away(error: BaseException | None = None) -> VegaError:
    """503 for a job store that did not answer: away for every process alike."""
    what = "did not answer in time" if isinstance(error, rexc.TimeoutError) else \
        "is unreachable"
    return VegaError("not_ready", f"the job store {what}", retry_after_ms=1000.0)


class JobsApi:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings

    def routes(self) -> list[Route]:
        return [Route("/v1/jobs", self.submit, methods=["POST"]),
                Route("/v1/models/{name}/jobs", self.submit, methods=["POST"]),
                Route("/v1/jobs/{id}", self.job, methods=["GET", "DELETE"])]

    async def job(self, request: Request) -> Response:
        """One route for both, so that a 405 names every method the path takes."""
        try:
            return await (self.cancel if request.method == "DELETE" else self.get)(request)
        except Exception:
            return error_response(internal_error(request))

    async def submit(self, request: Request) -> Response:
        began = time.perf_counter()
        name = request.path_params.get("name") or self.runtime.default_model
        body = b""
        try:
            body = await read_body(request, self.settings.max_body_bytes,
                                   self.settings.jobs_max_ttl_s)  # no job runs after it
            reply = await self._submit(request, name, body, with_ttl=True)
        except VegaError as error:
            reply = Reply.from_error(error)
        except ClientDisconnect:
            reply = DISCONNECTED
        except Exception:
            reply = Reply.from_error(internal_error(request))
        # Counted under the class the body named, else the header's, refusals too (the
        # VegaCriticalRefused alert reads them): parsed, else scanned as the Guard does.
        priority = request.scope.get("vega.priority")
        if priority is None:
            named = claimed_priority(body, request.headers) if body else None
            if named is None:  # compressed, or only the parse could tell: the header's
                named = named_priority(request.headers.get("x-vega-priority"))
            priority = NORMAL if named is None else named
        await conclude(self.runtime, name, priority, reply.outcome, began)
        return Response(reply.body, reply.status, headers=reply.headers, media_type=JSON)

    def wants(self, request: Request) -> bool:
        return wants_async(request)

    async def turn(self, request: Request, name: str, body: bytes | None,
                   refused: Reply) -> Reply:
        """A /v1/infer refusal for load (or too many instances to queue inline), as a job:
        202, or the refusal when the job is refused too. The Guard picks which."""
        try:
            if body is None:  # refused before its body was read
                body = await read_body(request, self.settings.max_body_bytes,
                                       self.settings.jobs_max_ttl_s)
            reply = await self._submit(request, name, body, with_ttl=False)
        except VegaError as error:
            # not_ready here is the job store away, for every process alike: the inline
            # refusal stands, not a 503 that Nginx would count against this process.
            return refused if error.code in LOAD_REFUSALS or error.code == "not_ready" \
                else Reply.from_error(error)
        reply.headers["Preference-Applied"] = "respond-async"
        return reply

    async def _submit(self, request: Request, name: str, body: bytes,
                      with_ttl: bool) -> Reply:
        runtime = self.runtime
        if runtime.draining or not runtime.jobs.runners:  # warming up, or shutting down; a
            runtime.check_open()  # model process restarting is no bar: a job is stored
        served = runtime.served(name)  # not_ready while warming up: its models are not known
        # Whatever VEGA_IDEMPOTENCY_TTL_S (the inline answers'): the store keeps it with the job.
        key = parse_key(request.headers.get("idempotency-key"))
        limit = self.settings.max_body_bytes
        body = decompress(body, request.headers.get("content-encoding"), limit)
        doc = parse_json(body)
        print_ = fingerprint(doc) if key is not None else ""
        ttl_s = self._ttl_s(doc.pop("ttl_s", None) if with_ttl and isinstance(doc, dict)
                            else None)
        instances, single, priority, _deadline = parse_infer_body(doc, request, self.settings)
        request.scope["vega.priority"] = priority
        decode_all(served.adapter, instances)  # the model's own check, as /v1/infer makes it
        now_ms = wall_ms()
        job = Job(id=new_id(), model=served.adapter.name, instances=orjson.dumps(instances),
                  single=single, priority=priority, created_ms=now_ms,
                  expires_ms=now_ms + int(1000 * ttl_s))
        lane = runtime.jobs
        try:
            submitted = await lane.submit(job, key, print_)
        except VegaError as error:
            if error.code == "queue_full":
                # Never 0: a fast model's predicted wait rounds to it, and a client that
                # follows the body's figure would resend at once into the full backlog.
                raise VegaError("queue_full", error.message, retry_after_ms=max(
                    MIN_RETRY_MS, 1000 * lane.wait_s(job.model))) from None
            raise
        except STORE_ERRORS as error:
            raise _store_away(error) from None
        wait_s = lane.wait_s(job.model)
        headers = {"Location": f"/v1/jobs/{submitted.id}",
                   "Retry-After": str(max(1, math.ceil(wait_s)))}
        if not submitted.created:
            headers["Idempotent-Replayed"] = "true"
        # The header holds whole seconds, 1 at least: the body says when to look, precisely.
        doc_out = {"id": submitted.id, "status": submitted.status,
                   "retry_after_ms": round(1000 * wait_s)}
        return Reply(202, orjson.dumps(doc_out), headers, "job")

    def _ttl_s(self, value: Any) -> float:
        s = self.settings
        if value is None:
            return s.jobs_default_ttl_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or value <= 0:
            raise invalid_input("ttl_s must be a positive number of seconds")
        return float(min(value, s.jobs_max_ttl_s))

    async def get(self, request: Request) -> Response:
        try:
            job = await self._job(request.path_params["id"])
        except VegaError as error:
            return error_response(error)
        return json_response(job.view(wall_ms()))

    async def cancel(self, request: Request) -> Response:
        try:
            job = await self._job(request.path_params["id"])
            if job.state(wall_ms()) == QUEUED:
                job = await self.runtime.jobs.cancel(job) or job
            if job.state(wall_ms()) != CANCELLED:
                raise VegaError("conflict", f"job is {job.state(wall_ms())}: only a queued "
                                            "job can be cancelled")
        except VegaError as error:
            return error_response(error)
        except STORE_ERRORS:
            return error_response(_store_away())
        return json_response(job.view(wall_ms()))

    async def _job(self, job_id: str) -> Job:
        if not valid_id(job_id):
            raise VegaError("job_not_found", "no such job")
        if not self.runtime.jobs.runners:  # warming up: its models' jobs are not known yet
            raise VegaError("not_ready", "this process is still warming up",
                            retry_after_ms=1000.0)
        try:
            job = await self.runtime.jobs.find(job_id)
        except STORE_ERRORS:
            raise _store_away() from None
        if job is None:
            raise VegaError("job_not_found", "no such job (or its result has expired)")
        return job


