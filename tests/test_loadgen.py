"""Load generator: traffic profiles, the HDR histogram, reports, and a real run against vega."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.servers import VegaProcess
from vega.lab import loadgen, traffic
from vega.lab.hdr import Histogram
from vega.lab.plots import write_plots
from vega.lab.report import (
    Record,
    Tally,
    build_report,
    distribution,
    distribution_delta,
    format_summary,
    prometheus_histogram,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def counts_between(t: np.ndarray, edges: list[float]) -> list[int]:
    return [int(((t >= a) & (t < b)).sum()) for a, b in itertools.pairwise(edges)]


# --- traffic -----------------------------------------------------------------------

def test_burst_constant_gives_exact_counts_per_phase() -> None:
    phases = traffic.burst(rate=100, factor=5, at_s=2, burst_s=1, duration_s=5)
    t = traffic.arrival_times(phases, "constant")
    assert counts_between(t, [0, 2, 3, 5]) == [200, 500, 200]
    assert np.all(np.diff(t) > 0)


def test_burst_poisson_counts_are_within_five_sigma() -> None:
    phases = traffic.burst(rate=1000, factor=10, at_s=1, burst_s=1, duration_s=3)
    t = traffic.arrival_times(phases, "poisson", np.random.default_rng(7))
    for got, expected in zip(counts_between(t, [0, 1, 2, 3]), [1000, 10000, 1000]):
        assert abs(got - expected) <= 5 * math.sqrt(expected)


def test_step_and_ramp_counts() -> None:
    steps = traffic.step(traffic.parse_steps("100:1,400:2,50:2"))
    t = traffic.arrival_times(steps, "constant")
    assert counts_between(t, [0, 1, 3, 5]) == [100, 800, 100]
    ramp = traffic.arrival_times(traffic.ramp(0, 1000, 2), "constant")
    assert len(ramp) == 1000
    assert counts_between(ramp, [0, 1, 2]) == [250, 750]  # Λ(1) = 250


def test_limit_keeps_the_earliest_arrivals() -> None:
    t = traffic.arrival_times(traffic.steady(1000, 10), "constant", limit=50)
    assert len(t) == 50 and t[-1] < 0.05


def test_mix_and_lengths() -> None:
    mix = traffic.parse_mix("sheddable=70,normal=25,critical=5")
    assert mix == pytest.approx({"critical": 0.05, "normal": 0.25, "sheddable": 0.70})
    assert traffic.parse_lengths("16=1,64=3") == {16: 0.25, 64: 0.75}
    assert len(traffic.parse_lengths("uniform:8:15")) == 8
    priority, length = traffic.draw(20000, mix, {16: 0.25, 64: 0.75}, np.random.default_rng(1))
    assert abs((priority == 2).mean() - 0.70) < 0.02
    assert abs((length == 64).mean() - 0.75) < 0.02
    with pytest.raises(traffic.TrafficError):
        traffic.parse_mix("bulk=1")


def test_trace_replay(tmp_path: Path) -> None:
    path = tmp_path / "trace.txt"
    path.write_text("# t priority length\n10.5 critical 32\n10.0 - 8\n11.0\n")
    arrivals = traffic.trace_arrivals(path, 2.0, {"normal": 1.0}, {16: 1.0},
                                      np.random.default_rng(0))
    assert arrivals.t_s.tolist() == [0.0, 0.25, 0.5]
    assert arrivals.priority.tolist() == [1, 0, 1]
    assert arrivals.length.tolist() == [8, 32, 16]


def test_spec_file_then_flags_win(tmp_path: Path) -> None:
    spec = tmp_path / "burst.spec"
    spec.write_text("# a burst\nprofile=burst\nrate=50\nburst-factor=4\nduration_s=6\n")
    parser = argparse.ArgumentParser()
    loadgen.configure(parser)
    options = traffic.resolve(vars(parser.parse_args(["--spec", str(spec), "--rate", "80"])))
    assert (options["profile"], options["rate"], options["burst_factor"]) == ("burst", 80.0, 4.0)
    assert options["duration_s"] == 6.0 and options["mode"] == "open"
    spec.write_text(json.dumps({"profile": "step", "steps": "10:1,20:2"}))
    options = traffic.resolve(vars(parser.parse_args(["--spec", str(spec)])))
    assert options["duration_s"] == 3.0
    spec.write_text("rate=fast\n")
    with pytest.raises(traffic.TrafficError):
        traffic.resolve(vars(parser.parse_args(["--spec", str(spec)])))


@pytest.mark.parametrize("argv, spec, message", [
    (["--requests", "-3"], None, "requests must be >= 1"),
    (["--requests", "0"], None, "requests must be >= 1"),
    (["--seed", "-1"], None, "seed must be >= 0"),
    (["--poll-s", "-1"], None, "poll_s must be >= 0"),
    (["--path", "v1/infer"], None, "must start with /"),
    (["--deadline-ms", "abc"], None, "deadline_ms 'abc'"),
    (["--deadline-ms", "0"], None, "each deadline must be a number > 0"),
    (["--mix", "urgent=1"], None, "mix class(es) ['urgent'] not in"),
    (["--lengths", "16,x"], None, "lengths '16,x'"),
    ([], {"rate": None, "duration_s": 1}, "rate must be > 0, not None"),
])
def test_bad_options_are_refused_before_any_load(argv: list[str], spec: Any, message: str,
                                                 tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    loadgen.configure(parser)
    if spec is not None:
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        argv = [*argv, "--spec", str(tmp_path / "spec.json")]
    with pytest.raises(traffic.TrafficError, match=re.escape(message)):
        traffic.resolve(vars(parser.parse_args(argv)))


# --- HDR histogram -----------------------------------------------------------------

def test_hdr_percentiles_within_stated_error() -> None:
    values = np.random.default_rng(3).lognormal(mean=-5, sigma=1.5, size=50_000)
    h = Histogram()
    for v in values.tolist():
        h.record(v)
    exact = np.sort(values)
    for q in (1, 10, 50, 90, 99, 99.9, 100):
        want = float(exact[max(1, math.ceil(round(q / 100 * len(exact), 9))) - 1])  # nearest rank
        tolerance = h.relative_error * want + h.unit_s
        assert abs(h.percentile(q) - want) <= tolerance, q
    assert h.count == len(values)
    assert h.mean_s == pytest.approx(float(values.mean()))


def test_hdr_merge_equals_recording_everything() -> None:
    a, b, both = Histogram(), Histogram(), Histogram()
    for i in range(1, 2000):
        (a if i % 3 else b).record(i * 1e-4)
        both.record(i * 1e-4)
    a.merge(b)
    assert a.counts == both.counts and a.count == both.count
    assert a.percentile(99) == both.percentile(99)
    assert Histogram.from_dict(a.to_dict()).percentile(50) == a.percentile(50)


# --- report from records (what the simulator feeds) --------------------------------

def synthetic_records() -> list[Record]:
    records = []
    for i in range(300):
        t = i / 100
        priority = ("critical", "normal", "sheddable")[i % 3]
        if i % 10 == 0:
            records.append(Record(t, 0.001, 429, "shed", priority, 0.1))
        elif i % 10 == 1:
            records.append(Record(t, 0.2, 200, "", priority, 0.1))  # late
        elif i == 299:
            records.append(Record(t, None, 0, "unsent", priority, 0.1))
        else:
            records.append(Record(t, 0.01, 200, "", priority, 0.1))
    return records


def test_report_from_records(tmp_path: Path) -> None:
    sizes = distribution([1, 2, 2, 8, 40], [1, 2, 4, 8, 16, 32])
    report = build_report(synthetic_records(), bin_s=0.5,
                          snapshots=[{"t": 0.0, "depth": {"normal": 3}},
                                     {"t": 1.0, "depth": {"normal": 1}}],
                          batches={"size": sizes}, meta={"mode": "sim"})
    s = report["summary"]
    assert (s["offered"], s["sent"], s["unsent"]) == (300, 299, 1)
    assert sum(s["counts_by_status"].values()) == s["sent"]
    assert s["counts_by_status"] == {"200": 269, "429": 30}
    assert s["counts_by_outcome"]["429 shed"] == 30
    assert s["in_deadline"] == 269 - 30
    assert report["timeline"]["bin_s"] == 0.5
    assert sum(report["timeline"]["offered"]) * 0.5 == 300
    assert sizes["counts"] == [1, 2, 0, 1, 0, 0, 1]
    files = write_plots(report, tmp_path)
    assert {f.name for f in files} == {"rates.png", "latency.png", "queue.png", "batches.png"}
    assert all(f.read_bytes()[:8] == PNG_MAGIC for f in files)
    tally = Tally(0.5)
    for r in synthetic_records():
        tally.add(r)
    assert build_report(tally)["summary"] == build_report(synthetic_records(),
                                                          bin_s=0.5)["summary"]


def test_settled_latency_leaves_out_the_first_second() -> None:
    # The onset of a closed loop (every connection at once) is slow; after it, fast.
    onset = [Record(0.01 * i, 0.5, 200, "", "normal", 5.0) for i in range(50)]
    settled = [Record(1.0 + 0.01 * i, 0.01, 200, "", "normal", 5.0) for i in range(200)]
    report = build_report(onset + settled, bin_s=0.1)
    summary = report["summary"]
    assert summary["latency_ms"]["count"] == 250
    assert summary["latency_ms"]["p99"] == pytest.approx(500, rel=0.01)
    after = summary["latency_ms_after_1s"]
    assert after["count"] == 200
    assert after["p99"] == pytest.approx(10, rel=0.01)
    assert "of those sent after the first second: p50 10" in format_summary(report)


def test_prometheus_histogram_delta() -> None:
    def text(counts: tuple[int, int, int]) -> str:
        return "\n".join([
            "# HELP vega_batch_size Items per batch", "# TYPE vega_batch_size histogram",
            f'vega_batch_size_bucket{{le="1.0",model="m"}} {counts[0]}',
            f'vega_batch_size_bucket{{le="2.0",model="m"}} {counts[1]}',
            f'vega_batch_size_bucket{{le="+Inf",model="m"}} {counts[2]}',
            f'vega_batch_size_count{{model="m"}} {counts[2]}',
            f'vega_batch_size_sum{{model="m"}} {counts[2] * 2}', ""])
    before = prometheus_histogram(text((1, 2, 3)), "vega_batch_size")
    after = prometheus_histogram(text((2, 5, 9)), "vega_batch_size")
    delta = distribution_delta(before, after)
    assert delta is not None
    assert (delta["le"], delta["counts"], delta["count"]) == (["1", "2", "+Inf"],
                                                              [1, 2, 3], 6)


def test_batches_are_left_out_when_the_readings_are_of_two_processes() -> None:
    # Behind Nginx the /metrics before and after the run came from different processes:
    # their difference was no run's batches (negative counts in report.json).
    def text(count: int, created: float) -> str:
        return "\n".join([
            "# HELP vega_batch_size Items per batch", "# TYPE vega_batch_size histogram",
            f'vega_batch_size_bucket{{le="1.0",model="m"}} {count}',
            f'vega_batch_size_bucket{{le="+Inf",model="m"}} {count}',
            f'vega_batch_size_count{{model="m"}} {count}',
            f'vega_batch_size_sum{{model="m"}} {count}',
            "# HELP vega_batch_size_created Items per batch",
            "# TYPE vega_batch_size_created gauge",
            f'vega_batch_size_created{{model="m"}} {created}', ""])
    one = loadgen.batch_distributions(text(5, 1.7e9), text(9, 1.7e9))
    assert one is not None and one["size"]["count"] == 4
    assert loadgen.batch_distributions(text(500, 1.7e9), text(9, 1.7e9 + 3)) is None


# --- a real run --------------------------------------------------------------------

def test_open_loop_run_against_vega(vega: Callable[..., VegaProcess], tmp_path: Path) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo")
    out = tmp_path / "bench"
    code = loadgen.main([server.url, "--rate", "150", "--duration-s", "2", "--seed", "5",
                         "--lengths", "8=1,16=1", "--deadline-ms", "300", "--poll-s", "0.2",
                         "--drain-s", "3", "--no-progress", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    assert s["sent"] == sum(s["counts_by_status"].values())
    assert s["sent"] + s["unsent"] == s["offered"] > 200
    for key in ("throughput", "goodput", "goodput_ratio", "latency_ms", "counts_by_outcome"):
        assert key in s
    assert set(report["classes"]) <= {"critical", "normal", "sheddable"}
    assert report["meta"]["mode"] == "open" and report["client"]["connect_errors"] == 0
    assert report["queue"]["t"] and set(report["queue"]["depth"]) == {"critical", "normal",
                                                                      "sheddable"}
    assert report["batches"]["size"]["count"] > 0
    assert report["timeline"]["offered"] and report["timeline"]["answered"]
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["batches.png", "latency.png", "queue.png", "rates.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)

    closed = tmp_path / "closed"
    code = loadgen.main([server.url, "--mode", "closed", "--connections", "4", "--duration-s",
                         "1", "--no-progress", "--no-plots", "--poll-s", "0", "--out",
                         str(closed)])
    assert code == 0
    report = json.loads((closed / "report.json").read_text())
    s = report["summary"]
    assert s["sent"] == sum(s["counts_by_status"].values()) == s["offered"] > 0
    assert report["meta"]["mode"] == "closed" and report["client"]["max_connections_used"] == 4


def test_bench_sends_a_bearer_token_and_keeps_it_out_of_its_report(
        vega: Callable[..., VegaProcess], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", VEGA_AUTH_TOKENS="s3cret")
    for token, status in ((None, "401"), ("s3cret", "200")):
        out = tmp_path / str(status)
        code = loadgen.main([server.url, "--mode", "closed", "--connections", "2",
                             "--duration-s", "0.5", "--no-progress", "--no-plots",
                             "--poll-s", "0", "--no-metrics", "--out", str(out),
                             *(["--token", token] if token else [])])
        assert code == 0
        text = (out / "report.json").read_text()
        assert set(json.loads(text)["summary"]["counts_by_status"]) == {status}
        assert "s3cret" not in text
        assert ("wants a bearer token" in capsys.readouterr().err) is (token is None)


# --- the async lane's client side, against a double of its contract ----------------

class JobsContractDouble:
    """A stand-in for the job API of DESIGN.md "Jobs", written for the client's tests
    while the server's routes are built elsewhere: every /v1/infer with ``Prefer:
    respond-async`` becomes a job (202, Location, Retry-After: 1); without it, a 200.
    Job n ends by n % 6: done, failed, expired, cancelled, never (lost), or forgotten
    (404 once polled: lost). GETs of an unfinished job carry Retry-After: 0.2."""

    FATES = ("done", "failed", "expired", "cancelled", "never", "forgotten")

    def __init__(self) -> None:
        self.inline = 0
        self.fates: dict[str, str] = {}
        self.created_s: dict[str, float] = {}
        self.polled_s: dict[str, list[float]] = {}
        self.bad_polls = 0

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def infer(request: Request) -> JSONResponse:
            await request.body()
            if "respond-async" not in request.headers.get("prefer", ""):
                self.inline += 1
                return JSONResponse({"outputs": [0.0]})
            job_id = f"j{len(self.fates)}"
            self.fates[job_id] = self.FATES[len(self.fates) % len(self.FATES)]
            self.created_s[job_id] = time.monotonic()
            return JSONResponse({"id": job_id, "status": "queued"}, 202, headers={
                "Location": f"/v1/jobs/{job_id}", "Retry-After": "1"})

        async def job(request: Request) -> JSONResponse:
            job_id = request.path_params["id"]
            fate = self.fates.get(job_id)
            if fate is None:
                self.bad_polls += 1
                return JSONResponse({"error": {"code": "job_not_found"}}, 404)
            polls = self.polled_s.setdefault(job_id, [])
            polls.append(time.monotonic())
            if fate == "forgotten":
                return JSONResponse({"error": {"code": "job_not_found"}}, 404)
            view = {"id": job_id, "model": "m", "created_ms": 1_000_000}
            if fate == "never" or len(polls) < 2:
                return JSONResponse(view | {"status": "queued" if len(polls) < 2 else
                                            "running"}, headers={"Retry-After": "0.2"})
            view |= {"status": fate, "finished_ms": 1_000_250}
            return JSONResponse(view | ({"outputs": [0.0]} if fate == "done" else {}))

        return Starlette(routes=[Route("/v1/infer", infer, methods=["POST"]),
                                 Route("/v1/jobs/{id}", job, methods=["GET"])])


@asynccontextmanager
async def serving(app: Any, sock: Path) -> AsyncIterator[None]:
    """``app`` under uvicorn on the unix socket ``sock`` while the block runs."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), lifespan="off",
                                           log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        await task


async def test_bench_follows_jobs_to_their_end(tmp_path: Path) -> None:
    double = JobsContractDouble()
    sock = tmp_path / "double.sock"
    async with serving(double.app(), sock):
        options = traffic.resolve({
            "url": "http://double", "uds": str(sock), "rate": 60.0, "duration_s": 1.0,
            "process": "constant", "seed": 3, "can_wait": 0.4, "job_ttl_s": 1.5,
            "drain_s": 0.5, "poll_s": 0, "metrics": False, "plots": False,
            "progress": False})
        report = await loadgen.bench(options)

    waits = int(traffic.can_wait(60, 0.4, 3).sum())
    assert 0 < waits < 60
    assert len(double.fates) == waits and double.inline == 60 - waits
    jobs = report["jobs"]
    fates = list(double.fates.values())
    assert jobs["accepted"] == waits
    for state in ("done", "failed", "expired", "cancelled"):
        assert jobs[state] == fates.count(state), state
    assert jobs["lost"] == fates.count("never") + fates.count("forgotten") > 0
    assert jobs["not_found"] == fates.count("forgotten")
    assert double.bad_polls == 0 and jobs["unreadable"] == 0
    assert report["summary"]["counts_by_status"] == {"200": 60 - waits, "202": waits}
    for job_id, polls in double.polled_s.items():
        assert polls[0] - double.created_s[job_id] >= 0.9  # Retry-After: 1 was waited out
        if double.fates[job_id] == "never":  # polled until its window (ttl + drain) ended
            assert 1.9 <= polls[-1] - double.created_s[job_id] < 3.0
    assert jobs["latency_ms"]["count"] == fates.count("done")
    assert jobs["last_finished_after_load_s"] is not None
    assert "lost " + str(jobs["lost"]) in format_summary(report)


def test_job_paths_from_the_network_are_checked() -> None:
    from vega.lab.jobs import job_path

    assert job_path(b'{"id": "a-1", "status": "queued"}', None) == "/v1/jobs/a-1"
    assert job_path(b"{}", b"/v1/jobs/B_2") == "/v1/jobs/B_2"
    assert job_path(b'{"id": "x\\r\\nHost: evil"}', None) is None
    assert job_path(b'{"id": "ok"}', b"/v1/jobs/a b") == "/v1/jobs/ok"
    assert job_path(b"not json", b"http://elsewhere/v1/jobs/1") is None
    assert job_path(b'{"id": 7}', None) is None


async def test_ctrl_c_while_answers_are_awaited_ends_the_run_and_writes_its_report(
        tmp_path: Path) -> None:
    # Ctrl-C stopped the sending, then the run waited out --drain-s for answers anyway.
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    release = asyncio.Event()

    async def stuck(request: Request) -> JSONResponse:
        await request.body()
        await release.wait()
        return JSONResponse({"outputs": [0.0]})

    sock = tmp_path / "stuck.sock"
    async with serving(Starlette(routes=[Route("/v1/infer", stuck, methods=["POST"])]), sock):
        options = traffic.resolve({
            "url": "http://stuck", "uds": str(sock), "rate": 20.0, "duration_s": 0.5,
            "process": "constant", "seed": 1, "drain_s": 60.0, "timeout_s": 60.0,
            "poll_s": 0, "metrics": False, "plots": False, "progress": False})
        asyncio.get_running_loop().call_later(1.0, os.kill, os.getpid(), signal.SIGINT)
        try:
            report = await asyncio.wait_for(loadgen.bench(options), 10)
        finally:
            release.set()
    summary = report["summary"]
    assert summary["sent"] == 10 and summary["ok"] == 0, summary


async def test_ctrl_c_ends_a_callers_run_and_its_report_says_so(tmp_path: Path) -> None:
    # `vega bench --callers` took no Ctrl-C: it ended in a traceback and wrote no report.
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from vega.lab import callers

    async def infer(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"outputs": [0.0]})

    sock = tmp_path / "infer.sock"
    async with serving(Starlette(routes=[Route("/v1/infer", infer, methods=["POST"])]), sock):
        options = traffic.resolve({"url": "http://callers", "uds": str(sock),
                                   "duration_s": 600.0, "mix": "normal=1", "seed": 1})
        asyncio.get_running_loop().call_later(1.0, os.kill, os.getpid(), signal.SIGINT)
        report = await asyncio.wait_for(callers.drive(options, 2, polite=True), 30)
    meta, summary = report["meta"], report["summary"]
    assert meta["interrupted"] and meta["unfinished"] == 0 and meta["calling_s"] < 30
    assert summary["calls"]["ok"] >= 1 and summary["ok_per_s"] > 0
    assert "(Ctrl-C after" in callers.format_summary(report)


async def test_a_target_whose_metrics_are_not_prometheus_text_still_gets_a_report(
        tmp_path: Path) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def infer(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse({"outputs": [0.0]})

    async def page(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok\n")  # a proxy's answer to every path, not metrics

    app = Starlette(routes=[Route("/v1/infer", infer, methods=["POST"]),
                            Route("/metrics", page), Route("/v1/status", page)])
    sock = tmp_path / "proxy.sock"
    async with serving(app, sock):
        options = traffic.resolve({
            "url": "http://proxy", "uds": str(sock), "rate": 50.0, "duration_s": 0.5,
            "process": "constant", "seed": 1, "poll_s": 0, "plots": False,
            "progress": False})
        report = await loadgen.bench(options)
    assert report["summary"]["counts_by_status"] == {"200": 25}
