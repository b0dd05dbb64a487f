"""vega.client: retry rules on scripted answers (httpx.MockTransport) and against real servers.

A real `vega serve` cannot be told to answer 429, 503 or drop a connection on cue, so the
exact retry, jitter and Idempotency-Key behaviour is checked on scripted answers; what
depends on the server (its 422, its Retry-After under a tiny rate limit, a dead port) is
checked against real processes.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.models import window
from tests.servers import ROOT, VegaProcess, free_port
from vega.client import (
    AsyncClient,
    Client,
    ConnectionFailedError,
    DeadlineExceededError,
    InvalidRequestError,
    JobFailedError,
    RefusedError,
    ServerError,
    UnavailableError,
    VegaClientError,
)
from vega.client.errors import error_from, retry_after_header
from vega.client.retry import GROWTH, Attempts, Call, Policy

SLACK_S = 0.3  # scheduling slack on a shared machine: a correctness bound, not a speed claim
Answer = httpx.Response | Exception


def refusal(status: int, code: str, retry_after_ms: float | None = None,
            header: str | None = None) -> httpx.Response:
    error: dict[str, Any] = {"code": code, "message": code}
    if retry_after_ms is not None:
        error["retry_after_ms"] = retry_after_ms
    headers = {"Retry-After": header} if header else {}
    return httpx.Response(status, json={"error": error}, headers=headers)


def ok(outputs: Any = (1.0, 2.0, 3.0)) -> httpx.Response:
    return httpx.Response(200, json={"model": "m", "outputs": list(outputs)})


@dataclass
class Script:
    """Answers in order (an exception is raised as if from the network); records requests."""

    answers: list[Answer]
    seen: list[httpx.Request] = field(default_factory=list)
    at: list[float] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        self.at.append(time.monotonic())
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise type(answer)(str(answer), request=request)  # type: ignore[call-arg]
        return answer

    def header(self, name: str) -> list[str | None]:
        return [r.headers.get(name) for r in self.seen]


def scripted(*answers: Answer, **options: Any) -> tuple[Client, Script]:
    script = Script(list(answers))
    return Client("http://vega", transport=httpx.MockTransport(script), **options), script


# --- retries on scripted answers ---------------------------------------------------

def test_refusals_are_retried_with_one_key_and_a_shrinking_deadline() -> None:
    client, script = scripted(refusal(429, "queue_full", 30), refusal(503, "not_ready", 30),
                              refusal(429, "shed", 30), ok())
    assert client.infer(window(4), deadline_s=2.0, idempotency_key="k-1") == [1.0, 2.0, 3.0]
    assert len(script.seen) == 4
    assert script.header("idempotency-key") == ["k-1"] * 4
    sent = [int(v or 0) for v in script.header("x-vega-deadline-ms")]
    assert sent[0] <= 2000 and all(later < earlier for earlier, later in zip(sent, sent[1:]))
    # Never back before the server said: each gap is at least its retry_after_ms.
    assert all(b - a >= 0.030 for a, b in zip(script.at, script.at[1:]))
    bodies = {r.content for r in script.seen}
    assert len(bodies) == 1 and b"deadline" not in next(iter(bodies))  # same bytes every time


def test_a_job_submit_keeps_its_key_across_retries_and_the_next_submit_gets_another() -> None:
    accepted = httpx.Response(202, json={"id": "j1", "status": "queued"},
                              headers={"Location": "/v1/jobs/j1"})
    client, script = scripted(refusal(503, "draining", 10), httpx.ReadError("reset"), accepted)
    assert client.submit_job(window(4), ttl_s=60) == "j1"
    assert client.submit_job(window(4)) == "j1"
    keys = script.header("idempotency-key")
    assert len(keys) == 4 and keys[0] and keys[0] == keys[1] == keys[2] != keys[3]
    assert script.header("x-vega-deadline-ms") == [None] * 4  # a job's life is its ttl_s
    assert orjson.loads(script.seen[0].content)["ttl_s"] == 60
    assert script.seen[0].url.path == "/v1/jobs"


def test_final_answers_are_not_retried() -> None:
    cases: list[tuple[httpx.Response, type[VegaClientError], str]] = [
        (refusal(422, "invalid_input"), InvalidRequestError, "invalid_input"),
        (refusal(404, "model_not_found"), InvalidRequestError, "model_not_found"),
        (refusal(500, "model_error"), ServerError, "model_error"),
        (httpx.Response(502, text="<html>bad gateway</html>"), ServerError, ""),
        (refusal(504, "deadline_exceeded"), DeadlineExceededError, "deadline_exceeded"),
    ]
    for answer, kind, code in cases:
        client, script = scripted(answer)
        with pytest.raises(kind) as raised:
            client.infer(window(4), deadline_s=2.0)
        assert len(script.seen) == 1, answer
        assert raised.value.code == code and raised.value.status == answer.status_code


def test_a_wait_longer_than_the_deadline_raises_at_once_with_the_refusal() -> None:
    client, script = scripted(refusal(429, "rate_limited", 5000, header="5"))
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError) as raised:
        client.infer(window(4), deadline_s=0.5)
    assert time.monotonic() - started < 0.5
    assert len(script.seen) == 1 and raised.value.attempts == 1
    last = raised.value.last
    assert isinstance(last, RefusedError) and last.code == "rate_limited"
    assert last.retry_after_s == 5.0 and raised.value.retry_after_s == 5.0


def test_attempts_are_bounded_as_a_backstop() -> None:
    client, script = scripted(refusal(429, "queue_full", 1), max_attempts=3)
    with pytest.raises(RefusedError) as raised:
        client.infer(window(4), deadline_s=5.0)
    assert len(script.seen) == 3 and raised.value.attempts == 3


def test_connection_errors_are_retried_only_where_safe() -> None:
    client, script = scripted(httpx.ConnectError("refused"), httpx.ConnectError("refused"), ok())
    assert client.infer(window(4), deadline_s=2.0) == [1.0, 2.0, 3.0]
    assert len(script.seen) == 3
    # Sent and then lost: resent only with an Idempotency-Key.
    client, script = scripted(httpx.RemoteProtocolError("gone"), ok())
    with pytest.raises(ConnectionFailedError) as raised:
        client.infer(window(4), deadline_s=2.0)
    assert len(script.seen) == 1 and raised.value.status is None
    client, script = scripted(httpx.ReadError("reset"), ok())
    assert client.infer(window(4), deadline_s=2.0, idempotency_key="k") == [1.0, 2.0, 3.0]
    assert script.header("idempotency-key") == ["k", "k"]
    # A read timeout is the deadline running out (the attempt's timeout is what was left).
    client, script = scripted(httpx.ReadTimeout("slow"), ok())
    with pytest.raises(DeadlineExceededError):
        client.infer(window(4), deadline_s=2.0, idempotency_key="k")
    assert len(script.seen) == 1


def test_priority_model_and_token_travel_as_headers() -> None:
    client, script = scripted(ok(), token="s3cret")
    client.infer(instances=[window(2)], model="a b", priority="critical")
    request = script.seen[0]
    assert request.headers["authorization"] == "Bearer s3cret"
    assert request.headers["x-vega-priority"] == "critical"
    assert request.url.raw_path == b"/v1/models/a%20b/infer"
    assert orjson.loads(request.content) == {"instances": [window(2)]}
    with pytest.raises(ValueError):
        client.infer(window(2), instances=[window(2)])
    with pytest.raises(ValueError):
        client.infer(window(2), priority="urgent")
    assert len(script.seen) == 1


def test_a_422_after_a_refusal_is_the_deadline_running_out_not_a_wrong_request() -> None:
    # The same body was refused for load, then, resent with less of its deadline left, was
    # too short for the server even on an idle queue: the call ran out of time.
    too_late = httpx.Response(422, json={"error": {"code": "invalid_input", "message":
                              "predicted to take 2.1 ms on an idle server, more than its "
                              "deadline (1.0 ms)"}})
    client, script = scripted(refusal(429, "queue_full", 30), too_late)
    with pytest.raises(DeadlineExceededError) as late:
        client.infer(window(4), deadline_s=2.0)
    assert len(script.seen) == 2 and late.value.last is not None
    assert late.value.last.code == "queue_full"
    client, _ = scripted(refusal(422, "invalid_input"))  # at once: the request is wrong
    with pytest.raises(InvalidRequestError):
        client.infer(window(4), deadline_s=2.0)
    # After a refusal, a 422 that is not about the deadline is a wrong request all the same.
    client, _ = scripted(refusal(429, "queue_full", 30), refusal(422, "invalid_input"))
    with pytest.raises(InvalidRequestError):
        client.infer(window(4), deadline_s=2.0)


def test_an_answer_that_ends_after_the_deadline_is_not_a_success() -> None:
    # Each read of a trickled answer came within its timeout; the whole came too late.
    now = [0.0]

    def late(request: httpx.Request) -> httpx.Response:
        now[0] += 5.0
        return ok()

    client = Client("http://vega", transport=httpx.MockTransport(late))
    client.policy = dataclasses.replace(client.policy, clock=lambda: now[0])
    with pytest.raises(DeadlineExceededError):
        client.infer(window(4), deadline_s=1.0)


def test_a_job_call_rides_out_a_retry_after_and_a_failed_submit_names_its_key() -> None:
    accepted = httpx.Response(202, json={"id": "j1", "status": "queued"},
                              headers={"Location": "/v1/jobs/j1"})
    # The job store away for a moment: 503 with Retry-After 1 s, then accepted. A job
    # call's own bound (not the 1-s inference deadline) leaves room to wait it out.
    client, script = scripted(refusal(503, "not_ready", header="1"), accepted)
    assert client.submit_job(window(4)) == "j1" and len(script.seen) == 2
    client, script = scripted(refusal(503, "not_ready", header="30"))
    with pytest.raises(DeadlineExceededError) as failed:
        client.submit_job(window(4))
    key = script.header("idempotency-key")[0]
    assert key and failed.value.idempotency_key == key  # a resubmit with it adds no job


def test_nan_in_the_inputs_is_refused_before_sending_not_sent_as_null() -> None:
    import numpy as np

    client, script = scripted(ok())
    for bad in ([[float("nan")] * 8] * 4, np.full((4, 8), np.inf, dtype=np.float32)):
        with pytest.raises(ValueError, match="NaN or infinity"):
            client.infer(bad)
    assert script.seen == []
    assert client.infer([[0.5] * 8] * 4) == [1.0, 2.0, 3.0]  # finite: sent


def test_decorrelated_jitter_stays_within_its_bounds() -> None:
    now = [0.0]
    policy = Policy(max_attempts=10_000, min_attempt_s=0.01, rng=random.Random(7),
                    clock=lambda: now[0])
    call = Call("POST", "/v1/infer", b"{}", {}, resend_safe=False)
    hints = [0.02, 0.5, None, 0.1, 0.001]
    for trial in range(200):
        attempts = Attempts(call, policy, deadline_s=30.0)
        previous = 0.0
        for n in range(6):
            attempts.start()
            hint = hints[(trial + n) % len(hints)]
            error = RefusedError("x", status=429, code="shed", retry_after_s=hint)
            wait = attempts.backoff(error)
            floor = hint if hint else 0.05
            assert floor <= wait <= max(floor, GROWTH * (previous or floor)) + 1e-9
            assert wait <= attempts.remaining_s() - policy.min_attempt_s
            previous = wait
            now[0] += wait
        now[0] = 0.0
    # Near the deadline the wait is cut to what is left; past it, the call ends.
    attempts = Attempts(call, policy, deadline_s=1.0)
    attempts.start()
    now[0] = 0.9
    assert attempts.backoff(RefusedError("x", retry_after_s=0.05)) <= 0.09
    with pytest.raises(DeadlineExceededError):
        attempts.backoff(RefusedError("x", retry_after_s=0.2))


def test_error_bodies_and_retry_after_are_read() -> None:
    error = error_from(429, httpx.Headers({"Retry-After": "2"}), b'{"error": {"code": "shed"}}')
    assert isinstance(error, RefusedError) and error.code == "shed" and error.retry_after_s == 2
    error = error_from(503, httpx.Headers({"Retry-After": "1"}),
                       b'{"error": {"code": "draining", "retry_after_ms": 250}}')
    assert isinstance(error, UnavailableError) and error.retry_after_s == 0.25
    assert error_from(503, httpx.Headers(), b"<html>").retry_after_s is None
    assert retry_after_header("soon") is None and retry_after_header("Wed, 21 Oct 2015 "
                                                                     "07:28:00 GMT") == 0.0


async def test_async_client_follows_the_same_rules() -> None:
    script = Script([refusal(429, "rate_limited", 20), httpx.ConnectError("refused"), ok()])
    async with AsyncClient("http://vega", transport=httpx.MockTransport(script)) as client:
        assert await client.infer(window(4), deadline_s=2.0, idempotency_key="a") == [1.0, 2.0,
                                                                                     3.0]
        script.answers = [refusal(429, "rate_limited", 5000)]
        with pytest.raises(DeadlineExceededError) as raised:
            await client.infer(window(4), deadline_s=0.5)
    assert len(script.seen) == 4 and script.header("idempotency-key")[:3] == ["a"] * 3
    sent = [int(v or 0) for v in script.header("x-vega-deadline-ms")[:3]]
    assert sent == sorted(sent, reverse=True) and sent[0] > sent[2]
    assert isinstance(raised.value.last, RefusedError)


# --- jobs against the DESIGN.md contract (scripted) ---------------------------------

def job(status: str, **extra: Any) -> httpx.Response:
    return httpx.Response(200, json={"id": "j1", "model": "m", "status": status,
                                     "created_ms": 1, **extra})


def test_wait_job_polls_until_done() -> None:
    client, script = scripted(job("queued"), refusal(503, "not_ready", 5), job("running"),
                              job("done", outputs=[7.0], finished_ms=2))
    assert client.wait_job("j1", timeout_s=5.0) == [7.0]
    assert [r.url.path for r in script.seen] == ["/v1/jobs/j1"] * 4
    assert {r.method for r in script.seen} == {"GET"}


def test_a_retry_after_of_0_while_a_job_runs_is_neither_a_spin_nor_the_end() -> None:
    running = httpx.Response(200, headers={"Retry-After": "0"}, json={
        "id": "j1", "model": "m", "status": "running", "created_ms": 1})
    client, script = scripted(running, running, job("done", outputs=[7.0], finished_ms=2))
    assert client.wait_job("j1", timeout_s=5.0) == [7.0]
    assert len(script.seen) == 3


def test_jobs_that_fail_expire_or_outlast_the_timeout_raise() -> None:
    client, _ = scripted(job("failed", error={"code": "model_error", "message": "boom"}))
    with pytest.raises(JobFailedError) as failed:
        client.wait_job("j1", timeout_s=2.0)
    assert failed.value.code == "model_error" and failed.value.message == "boom"
    client, _ = scripted(job("expired"))
    with pytest.raises(JobFailedError) as expired:
        client.wait_job("j1", timeout_s=2.0)
    assert expired.value.code == "expired"
    client, script = scripted(job("queued"))
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        client.wait_job("j1", timeout_s=0.3)
    assert time.monotonic() - started <= 0.3 + SLACK_S and len(script.seen) >= 2


def test_a_submit_s_retry_after_is_waited_out_within_the_timeout_of_wait_job() -> None:
    accepted = httpx.Response(202, headers={"Retry-After": "30"}, json={"id": "j1",
                                                                        "status": "queued"})
    client, script = scripted(accepted, job("done", outputs=[7.0], finished_ms=2))
    job_id = client.submit_job(window(4))
    started = time.monotonic()
    # Not 30 s: the one look the timeout leaves room for, at its end.
    assert client.wait_job(job_id, timeout_s=0.3) == [7.0]
    assert time.monotonic() - started <= 0.3 + SLACK_S and len(script.seen) == 2
    assert script.at[1] - started >= 0.3 - 2 * 0.01  # min_attempt_s kept, clock rounding
    client, script = scripted(accepted, job("queued"))
    job_id = client.submit_job(window(4))
    with pytest.raises(DeadlineExceededError):
        client.wait_job(job_id, timeout_s=0.3)
    assert len(script.seen) == 2 and script.seen[1].method == "GET"
    client, script = scripted(job("done", outputs=[7.0], finished_ms=2))
    assert client.wait_job("j1", timeout_s=0.3) == [7.0]  # a bare id: looked at at once
    # The body's retry_after_ms is the wait itself; the header rounds it up to a second.
    precise = httpx.Response(202, headers={"Retry-After": "30"}, json={
        "id": "j1", "status": "queued", "retry_after_ms": 100})
    client, script = scripted(precise, job("done", outputs=[7.0], finished_ms=2))
    job_id = client.submit_job(window(4))
    started = time.monotonic()
    assert client.wait_job(job_id, timeout_s=5.0) == [7.0]
    assert 0.1 - 0.01 <= script.at[1] - started <= 1.0


def test_job_status_and_cancel() -> None:
    client, script = scripted(job("queued"), httpx.Response(204), refusal(409, "job_running"),
                              refusal(404, "job_not_found"))
    assert client.job("j1")["status"] == "queued"
    assert client.cancel_job("j1") is True
    assert client.cancel_job("j1") is False
    with pytest.raises(InvalidRequestError) as unknown:
        client.cancel_job("nope")
    assert unknown.value.status == 404
    assert [r.method for r in script.seen] == ["GET", "DELETE", "DELETE", "DELETE"]


# --- the module stands alone ----------------------------------------------------------

def test_importing_the_client_imports_nothing_of_the_server() -> None:
    probe = ("import sys, vega.client; "
             "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('torch', 'starlette', 'uvicorn', 'redis', 'numpy', 'prometheus_client') "
             "or m.startswith('vega.') and not m.startswith('vega.client'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == ""


# --- against real servers -------------------------------------------------------------

ECHO = {"VEGA_MODEL": "python:tests.models:echo"}


@pytest.fixture(scope="module")
def plain(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    return vega_module(**ECHO, VEGA_AUTH_TOKENS="t0ken")


@pytest.fixture(scope="module")
def limited(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    # One unit a second, two in the bucket, a fifth of it kept for critical: a normal
    # call right after another waits ~0.2 s, one right after that ~1 s.
    return vega_module(**ECHO, VEGA_RATE_LIMIT="1", VEGA_BURST="2")


@pytest.fixture(scope="module")
def margined(vega_module: Callable[..., VegaProcess]) -> VegaProcess:
    # As ``limited``, with a 1-s margin in its deadline checks: a call that has less than
    # that left after a wait gets the 422 of a deadline that no retry could meet.
    return vega_module(**ECHO, VEGA_RATE_LIMIT="1", VEGA_BURST="2",
                       VEGA_DEADLINE_MARGIN_MS="1000")


@pytest.fixture
def attempts() -> Iterator[list[tuple[int, str]]]:
    yield []


def test_a_real_answer_and_a_real_422(plain: VegaProcess,
                                      attempts: list[tuple[int, str]]) -> None:
    record = lambda status, code: attempts.append((status, code))  # noqa: E731
    with Client(plain.url, token="t0ken", observer=record) as client:
        outputs = client.infer(window(16), deadline_s=5.0)
        assert isinstance(outputs, list) and len(outputs) == 3
        assert len(client.infer(instances=[window(4), window(8)])) == 2
        with pytest.raises(InvalidRequestError) as raised:
            client.infer([[1.0, 2.0]], deadline_s=5.0)
    assert raised.value.status == 422 and raised.value.code == "invalid_input"
    assert attempts == [(200, ""), (200, ""), (422, "invalid_input")]  # not retried
    with Client(plain.url, token="wrong") as client, pytest.raises(InvalidRequestError) as no:
        client.infer(window(16))
    assert no.value.status == 401 and no.value.code == "unauthorized"


def test_a_rate_limited_call_waits_as_told_and_keeps_its_deadline(
        limited: VegaProcess, attempts: list[tuple[int, str]]) -> None:
    record = lambda status, code: attempts.append((status, code))  # noqa: E731
    with Client(limited.url, observer=record) as client:
        client.infer(window(16), deadline_s=5.0)  # whatever the bucket held: it is empty now
        attempts.clear()
        started = time.monotonic()
        assert len(client.infer(window(16), deadline_s=3.0)) == 3
        elapsed = time.monotonic() - started
        assert elapsed <= 3.0 + SLACK_S
        assert len(attempts) >= 2 and attempts[-1] == (200, "")
        assert {a for a in attempts[:-1]} == {(429, "rate_limited")}
        # The bucket is empty again and refills in ~1 s: a 0.2-s call cannot wait for it.
        attempts.clear()
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as raised:
            client.infer(window(16), deadline_s=0.2)
        assert time.monotonic() - started <= 0.2 + SLACK_S
    assert attempts == [(429, "rate_limited")]
    assert raised.value.last is not None and raised.value.last.code == "rate_limited"


def test_a_422_after_a_refusal_is_the_deadline_only_where_the_server_says_so(
        margined: VegaProcess, attempts: list[tuple[int, str]]) -> None:
    # The server refuses for load (here its rate limit) before it checks the input, so a
    # wrong input under load is first refused, then, resent, refused as wrong.
    record = lambda status, code: attempts.append((status, code))  # noqa: E731
    with Client(margined.url, observer=record) as client:
        client.infer(window(16), deadline_s=5.0)  # the bucket is empty now
        attempts.clear()
        with pytest.raises(DeadlineExceededError) as late:
            client.infer(window(16), deadline_s=1.1)  # after the wait, under the margin
        assert attempts == [(429, "rate_limited"), (422, "invalid_input")]
        assert late.value.last is not None and late.value.last.code == "rate_limited"
        client.infer(window(16), deadline_s=5.0)
        attempts.clear()
        with pytest.raises(InvalidRequestError) as wrong:
            client.infer([[1.0, 2.0]], deadline_s=5.0)
    assert attempts == [(429, "rate_limited"), (422, "invalid_input")]
    assert wrong.value.code == "invalid_input" and "shape" in wrong.value.message


async def test_a_dead_port_is_retried_then_raises_within_the_deadline() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    tried: list[int] = []
    async with AsyncClient(url, observer=lambda status, code: tried.append(status)) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as raised:
            await client.infer(window(16), deadline_s=0.5)
    assert time.monotonic() - started <= 0.5 + SLACK_S
    assert len(tried) >= 2 and set(tried) == {0}
    assert isinstance(raised.value.last, ConnectionFailedError)


class Timed(httpx.HTTPTransport):
    """A real transport that notes when each request left and each answer came."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, float, httpx.Request, httpx.Response]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        sent = time.monotonic()
        response = super().handle_request(request)
        self.seen.append((sent, time.monotonic(), request, response))
        return response


class AsyncTimed(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, float, httpx.Request, httpx.Response]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = time.monotonic()
        response = await super().handle_async_request(request)
        self.seen.append((sent, time.monotonic(), request, response))
        return response


def looked_after_retry_after(seen: list[tuple[float, float, httpx.Request, httpx.Response]]
                             ) -> None:
    (_, answered, _, accepted), *polls = seen
    assert accepted.status_code == 202 and polls
    assert int(accepted.headers["retry-after"]) >= 1  # whole seconds
    wait_ms = accepted.json()["retry_after_ms"]  # the predicted wait itself
    assert isinstance(wait_ms, int) and 0 <= wait_ms <= 1000 * int(
        accepted.headers["retry-after"])
    # The job is not expected done before the wait its 202 asked for: no look before.
    # (A loop's timer may fire up to its clock's resolution early: 1 ms.)
    assert polls[0][2].method == "GET" and polls[0][0] >= answered + wait_ms / 1000 - 0.001


async def test_wait_job_looks_once_the_submit_s_retry_after_ends(plain: VegaProcess) -> None:
    timed = Timed()
    with Client(plain.url, token="t0ken", transport=timed) as client:
        job_id = client.submit_job(window(16), ttl_s=60)
        assert len(client.wait_job(job_id, timeout_s=30.0)) == 3
    looked_after_retry_after(timed.seen)
    async_timed = AsyncTimed()
    async with AsyncClient(plain.url, token="t0ken", transport=async_timed) as aclient:
        job_id = await aclient.submit_job(window(16), ttl_s=60)
        assert len(await aclient.wait_job(job_id, timeout_s=30.0)) == 3
    looked_after_retry_after(async_timed.seen)


def test_jobs_against_real_server(plain: VegaProcess) -> None:
    """The job methods against a real server (DESIGN.md "Jobs")."""
    with Client(plain.url, token="t0ken") as client:
        inline = client.infer(window(16), deadline_s=5.0)
        job_id = client.submit_job(window(16), ttl_s=60, idempotency_key="real-1")
        assert client.submit_job(window(16), ttl_s=60, idempotency_key="real-1") == job_id
        assert client.wait_job(job_id, timeout_s=30.0) == inline
        status = client.job(job_id)
        assert status["id"] == job_id and status["status"] == "done"
        with pytest.raises(InvalidRequestError) as unknown:
            client.job("no-such-job")
    assert unknown.value.status == 404


@pytest.mark.parametrize("kind", ["polite", "naive"])
def test_bench_callers_mode_reports_what_its_callers_saw(
        limited: VegaProcess, tmp_path: Path, kind: str) -> None:
    from vega.cli import main

    out = tmp_path / kind
    assert main(["bench", "--callers", "3", "--client", kind, "--duration-s", "1",
                 "--mix", "normal=1", "--deadline-ms", "1500", "--out", str(out),
                 limited.url]) == 0
    report = orjson.loads((out / "report.json").read_bytes())
    summary, meta = report["summary"], report["meta"]
    assert meta["client"] == kind and meta["callers"] == 3 and meta["unfinished"] == 0
    assert summary["calls"]["ok"] >= 1 and summary["refusals"]["rate_limited"] >= 1
    # Every attempt is a 200, a refusal or, for a naive caller resending with a sliver of
    # its deadline left, a 422 that ends its call (no retry could meet it): the books balance.
    calls = summary["calls"]
    assert summary["attempts"] == calls["ok"] + sum(summary["refusals"].values()) + calls.get(
        "invalid_input", 0)
    assert set(calls) <= {"ok", "deadline_exceeded", "invalid_input"}
    assert summary["p50_ms"] <= summary["p99_ms"]


def test_bench_callers_mode_takes_host_and_port_as_the_load_generator_does(
        limited: VegaProcess, tmp_path: Path) -> None:
    # Without a scheme each call was refused by httpx at once, a busy loop of failures.
    from vega.cli import main

    assert main(["bench", "--callers", "1", "--duration-s", "1", "--mix", "normal=1",
                 "--deadline-ms", "5000", "--out", str(tmp_path),
                 limited.url.removeprefix("http://")]) == 0
    assert orjson.loads((tmp_path / "report.json").read_bytes())["summary"]["calls"]["ok"] >= 1


@pytest.mark.parametrize("argv, message", [
    (["--out", "/proc/callers"], "vega bench: --out: cannot write in /proc"),
    (["--mix", "urgent=1"], "vega bench: mix class(es) ['urgent'] not in"),
    (["ftp://127.0.0.1:9"], "vega bench: url 'ftp://127.0.0.1:9': only http:// and https://"),
])
def test_bench_callers_mode_refuses_bad_options_in_one_line_before_any_call(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from vega.cli import main

    out = tmp_path / "run"
    assert main(["bench", "--callers", "2", "--duration-s", "1", "--out", str(out),
                 *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.splitlines()) == 1
    assert not out.exists()
