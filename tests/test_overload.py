"""Overload, rate limits, start-up, drain and disconnects against real `vega serve` processes."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.models import window
from tests.servers import VegaProcess, metric, wait_until

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

BODY = orjson.dumps({"inputs": window(16)})


async def fire(url: str, bodies: list[bytes], headers: list[dict[str, str]] | None = None,
               limits: int = 300) -> list[httpx.Response | Exception]:
    """Send all bodies at once, one connection each; return each answer (or the error)."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=limits)) as client:
        async def one(i: int) -> httpx.Response | Exception:
            try:
                return await client.post(url + "/v1/infer", content=bodies[i],
                                         headers=(headers or [{}] * len(bodies))[i])
            except httpx.HTTPError as error:
                return error
        return list(await asyncio.gather(*(one(i) for i in range(len(bodies)))))


async def admitted(server: VegaProcess, count: int, timeout_s: float = 30) -> None:
    """Until ``count`` requests are open or answered (polled, so a busy machine only waits)."""
    end = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            status = (await client.get(server.url + "/v1/status")).json()
            if status["active_requests"] + sum(status["outcomes"].values()) >= count:
                return
            assert asyncio.get_running_loop().time() < end, f"{count} requests not admitted"
            await asyncio.sleep(0.02)


def listening(server: VegaProcess) -> bool:
    try:
        return httpx.get(server.url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def codes(responses: list[httpx.Response | Exception]) -> Counter[str]:
    out: Counter[str] = Counter()
    for r in responses:
        if isinstance(r, Exception):
            out[type(r).__name__] += 1
        elif r.status_code == 200:
            out["ok"] += 1
        else:
            out[r.json()["error"]["code"]] += 1
    return out


async def test_overload_refuses_with_retry_after_and_answers_every_admitted(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="20",
                  VEGA_QUEUE_CAPACITY="8", VEGA_MAX_BATCH_SIZE="4")
    responses = await fire(server.url, [BODY] * 200)
    seen = codes(responses)
    assert sum(seen.values()) == 200
    assert set(seen) <= {"ok", "queue_full", "deadline_unmeetable"}, seen
    # At least the queue's bound for normal requests (90% of 8) is admitted and answered;
    # more when a batch leaves the queue before the flood has all arrived (not on a busy host).
    assert seen["ok"] >= 7 and seen["queue_full"] > 0, seen
    for r in responses:
        assert isinstance(r, httpx.Response)
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["retry_after_ms"] > 0
        else:
            assert r.status_code == 200 and len(r.json()["outputs"]) == 3


async def test_sheddable_goes_first_and_critical_keeps_headroom(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="30",
                  VEGA_QUEUE_CAPACITY="40", VEGA_SHED_WATERMARK="0.25",
                  VEGA_NORMAL_WATERMARK="0.5", VEGA_MAX_BATCH_SIZE="4", VEGA_MAX_WAIT_MS="1")

    def bodies(priority: str, count: int) -> list[bytes]:
        return [orjson.dumps({"inputs": window(16), "priority": priority, "deadline_ms": 20000})
                ] * count
    # Two sheddable to each normal, interleaved: an idle executor takes the first
    # arrivals whatever their class (VEGA_DISPATCH_WHEN_IDLE), so neither class may
    # come first as a block.
    classes = ["sheddable", "sheddable", "normal"] * 60
    flood = asyncio.create_task(fire(server.url, [bodies(c, 1)[0] for c in classes]))
    await asyncio.sleep(0.3)  # the queue is at normal's watermark by now
    critical = await fire(server.url, bodies("critical", 10))
    answers = await flood
    seen = codes(answers)
    sheddable = codes([a for a, c in zip(answers, classes) if c == "sheddable"])
    normal = codes([a for a, c in zip(answers, classes) if c == "normal"])
    assert codes(critical) == Counter(ok=10), codes(critical)
    assert sheddable["shed"] > 0 and set(sheddable) <= {"ok", "shed"}, seen
    assert set(normal) <= {"ok", "queue_full", "shed"}, seen
    assert sheddable["ok"] / 120 <= normal["ok"] / 60, seen


async def test_a_model_slower_than_the_interval_serves_callers_queued_behind_its_batch(
        vega: Callable[..., VegaProcess]) -> None:
    # Batches of 300 ms against the default 100-ms CoDel interval, default deadlines and
    # class: callers that arrive while a batch runs wait it out and are served, not shed
    # as a standing queue (nothing is overloaded). One bucket: what warm-up picks anyway.
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="300",
                  VEGA_LENGTH_BUCKETS="512")
    first = asyncio.create_task(fire(server.url, [BODY]))

    def running() -> bool:
        status = httpx.get(server.url + "/v1/status", timeout=5).json()
        return bool(status["models"]["echo"]["inflight_batches"])
    await asyncio.to_thread(wait_until, running, 30, "the first batch running")
    behind = await fire(server.url, [BODY] * 2)
    assert codes(behind + await first) == {"ok": 3}


def test_token_bucket_rate_limits_with_retry_after(vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_RATE_LIMIT="2", VEGA_BURST="4")
    answers = [httpx.post(server.url + "/v1/infer", content=BODY, timeout=10) for _ in range(8)]
    limited = [r for r in answers if r.status_code == 429]
    assert limited and all(r.json()["error"]["code"] == "rate_limited" for r in limited)
    assert all(int(r.headers["retry-after"]) >= 1 for r in limited)
    assert sum(r.status_code == 200 for r in answers) >= 2


def test_not_ready_while_warming_up(vega: Callable[..., VegaProcess]) -> None:
    server = vega(wait_ready=False, VEGA_MODEL="python:tests.models:echo",
                  TEST_LOAD_SLEEP_MS="4000")
    wait_until(lambda: listening(server), 60, "vega to listen")
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
    refused = httpx.post(server.url + "/v1/infer", content=BODY)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    assert int(refused.headers["retry-after"]) >= 1
    # A job it cannot look up yet (its models' runners start once warm) is not "gone":
    # behind Nginx a 503 sends the poll to a process that can answer it.
    polled = httpx.get(server.url + "/v1/jobs/AAAAAAAAAAAAAAAAAAAAAA")
    assert polled.status_code == 503 and polled.json()["error"]["code"] == "not_ready"
    server.wait_ready()
    assert httpx.post(server.url + "/v1/infer", content=BODY).status_code == 200
    # Counted under the model it asked for (loaded, not yet warm), not under `_unknown`.
    assert metric(server, "vega_requests_total", model="echo", outcome="not_ready") == 1


def test_a_caller_that_stops_mid_body_does_not_hold_the_stop(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_DRAIN_TIMEOUT_S="1")
    with socket.create_connection(("127.0.0.1", server.port)) as stalled:
        stalled.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"inputs\": [")  # and no more
        time.sleep(0.5)
        server.signal(signal.SIGTERM)
        # Drained (1 s), then the grace uvicorn gives what it still waits for (2 s).
        assert server.proc is not None and server.proc.wait(15) == 0


def test_a_body_that_never_finishes_is_answered_once_no_deadline_could_be_met(
        vega: Callable[..., VegaProcess]) -> None:
    # Held open, it held its bytes and its connection for good (4 MB each, a few
    # hundred such connections a server's memory).
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_MAX_DEADLINE_MS="1000")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stalled:
        stalled.sendall(b"POST /v1/infer HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"inputs\": [")  # and no more
        reply = stalled.recv(4096)
    assert reply.startswith(b"HTTP/1.1 504"), reply[:100]
    assert b'"code":"deadline_exceeded"' in reply


async def test_drain_on_sigterm_answers_everything_admitted(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="150",
                  VEGA_MAX_BATCH_SIZE="4", VEGA_QUEUE_CAPACITY="1000",
                  VEGA_DEFAULT_DEADLINE_MS="20000",
                  # This queue stands for 1.5 s on purpose; keep it from being shed as stale.
                  VEGA_CODEL_INTERVAL_MS="60000")
    load = asyncio.create_task(fire(server.url, [BODY] * 40))
    await admitted(server, 40)  # all of the load is in before the signal
    server.signal(signal.SIGTERM)
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(500):  # until the signal is handled, however loaded the machine
            if (await client.get(server.url + "/readyz")).status_code == 503:
                break
            await asyncio.sleep(0.02)
        during = await client.post(server.url + "/v1/infer", content=BODY)
    assert during.status_code == 503 and during.json()["error"]["code"] == "draining"
    assert int(during.headers["retry-after"]) >= 1
    # A keep-alive client sends its next request on a new connection, not onto this one
    # as the process closes it unanswered.
    assert during.headers["connection"] == "close"
    assert httpx.get(server.url + "/readyz").status_code == 503
    seen = codes(await load)
    assert seen == Counter(ok=40), seen
    assert server.proc is not None
    assert await asyncio.to_thread(server.proc.wait, 30) == 0


async def test_a_drain_that_runs_out_answers_what_never_began_503(
        vega: Callable[..., VegaProcess]) -> None:
    # Six seconds of work admitted, a drain of one: what is still queued when the drain
    # runs out gets 503 `draining` in JSON (never began: Nginx may send it elsewhere),
    # not uvicorn's plain 500 when it cuts the connections.
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="500",
                  VEGA_MAX_BATCH_SIZE="1", VEGA_DRAIN_TIMEOUT_S="1",
                  VEGA_CODEL_INTERVAL_MS="60000")
    body = orjson.dumps({"inputs": window(16), "deadline_ms": 30000})
    load = asyncio.create_task(fire(server.url, [body] * 12))
    await admitted(server, 12)
    server.signal(signal.SIGTERM)
    seen = codes(await load)
    assert seen["draining"] >= 1 and seen["ok"] + seen["draining"] == 12, seen
    assert server.proc is not None
    assert await asyncio.to_thread(server.proc.wait, 30) == 0


def test_a_model_hung_in_its_thread_does_not_hold_the_stop(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_EXECUTOR="thread",
                  TEST_HANG_MS="600000", VEGA_DRAIN_TIMEOUT_S="1", VEGA_WARMUP_BATCHES="1")
    hang = orjson.dumps({"inputs": [[-666.0] + [0.0] * 7], "deadline_ms": 500})
    answer = httpx.post(server.url + "/v1/infer", content=hang, timeout=30)
    assert answer.status_code == 504
    server.signal(signal.SIGTERM)
    # The drain (1 s), uvicorn's grace (2 s), the executor's wait (2 s); then it exits
    # without the thread, which the interpreter would wait for forever.
    assert server.proc is not None and server.proc.wait(30) == 0
    assert "exiting without it" in server.log()


def test_sigterm_during_warm_up_stops_at_the_next_shape(vega: Callable[..., VegaProcess]) -> None:
    # A warm-up of about two minutes (one second a batch): the stop does not wait for it.
    server = vega(wait_ready=False, VEGA_MODEL="python:tests.models:echo",
                  VEGA_EXECUTOR="thread", TEST_SLEEP_MS="1000")
    wait_until(lambda: listening(server) and "warming up" in server.log(), 60, "warm-up")
    server.signal(signal.SIGTERM)
    assert server.proc is not None and server.proc.wait(30) == 0


def test_disconnected_caller_is_dropped_before_dispatch(vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="1000",
                  VEGA_MAX_BATCH_SIZE="1", VEGA_MAX_INFLIGHT_BATCHES="1",
                  VEGA_WARMUP_BATCHES="1")
    body = orjson.dumps({"inputs": window(8), "deadline_ms": 10000})  # a 1-s model's
    request = (f"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
               .encode() + body)
    with socket.create_connection(("127.0.0.1", server.port)) as busy:
        busy.sendall(request)  # occupies the only executor slot for 1 s
        wait_until(lambda: metric(server, "vega_inflight_batches") == 1, 10, "the first running")
        with socket.create_connection(("127.0.0.1", server.port)) as gone:
            gone.sendall(request)
            wait_until(lambda: metric(server, "vega_queue_depth") == 1, 10, "the second queued")
        assert busy.recv(100).startswith(b"HTTP/1.1 200")

    def counted() -> str:
        metrics = httpx.get(server.url + "/metrics").text
        return metrics if 'outcome="disconnected"' in metrics else ""
    metrics = wait_until(counted, 10, "the disconnect to be counted")
    assert 'vega_batch_size_count{model="echo"} 1.0' in metrics  # only the first one ran


async def test_a_paced_refusal_is_not_held_past_the_request_s_deadline(
        vega: Callable[..., VegaProcess]) -> None:
    # 40 refusals at 5 a second would be held up to the 5-s cap; their callers said
    # they wait 300 ms, so each goes by then (a caller gone reconnects: dearer).
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_RATE_LIMIT="1", VEGA_BURST="1",
                  VEGA_REFUSAL_RATE="5", VEGA_REFUSAL_MAX_HOLD_MS="5000")
    loop = asyncio.get_running_loop()
    started = loop.time()
    responses = await fire(server.url, [BODY] * 40, [{"X-Vega-Deadline-Ms": "300"}] * 40)
    took_s = loop.time() - started
    assert codes(responses)["rate_limited"] >= 38
    assert metric(server, "vega_refusals_paced_total") >= 30  # paced, each within its deadline
    assert took_s < 2.5, took_s


def test_a_caller_gone_while_its_batch_ran_is_counted_disconnected_not_ok(
        vega: Callable[..., VegaProcess]) -> None:
    # Its answer reached nobody: counted ok, the work wasted under overload by callers
    # that time out would look like goodput on the dashboard.
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="1000",
                  VEGA_WARMUP_BATCHES="1")
    body = orjson.dumps({"inputs": window(8), "deadline_ms": 10000})
    with socket.create_connection(("127.0.0.1", server.port)) as gone:
        gone.sendall(f"POST /v1/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}"
                     "\r\n\r\n".encode() + body)
        wait_until(lambda: metric(server, "vega_inflight_batches") == 1, 10, "its batch")

    def counted() -> str:
        metrics = httpx.get(server.url + "/metrics").text
        return metrics if 'outcome="disconnected"' in metrics else ""
    metrics = wait_until(counted, 10, "the hang-up to be counted")
    assert 'vega_batch_size_count{model="echo"} 1.0' in metrics  # it ran, then was dropped
    assert 'outcome="ok"' not in metrics


async def test_refusals_past_the_refusal_rate_are_held_for_their_turn(
        vega: Callable[..., VegaProcess]) -> None:
    paced = vega(VEGA_MODEL="python:tests.models:echo", VEGA_RATE_LIMIT="1", VEGA_BURST="1",
                 VEGA_REFUSAL_RATE="20", VEGA_REFUSAL_MAX_HOLD_MS="5000")
    unpaced = vega(VEGA_MODEL="python:tests.models:echo", VEGA_RATE_LIMIT="1", VEGA_BURST="1",
                   VEGA_REFUSAL_RATE="0")
    for server, held in ((paced, True), (unpaced, False)):
        responses = await fire(server.url, [BODY] * 40)
        seen = codes(responses)
        assert set(seen) <= {"ok", "rate_limited"} and seen["rate_limited"] >= 38, seen
        for r in responses:
            assert isinstance(r, httpx.Response)
            assert r.status_code == 200 or int(r.headers["retry-after"]) >= 1
        # 40 refusals at once against 20 a second: all but the first few wait a turn.
        count = metric(server, "vega_refusals_paced_total")
        assert count >= 30 if held else count == 0, (held, count)
