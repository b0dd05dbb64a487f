"""A model process's start as an operator sees it: what the log says when it cannot, what
the serving process holds once it can, and its coming back after a crash."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.servers import VegaProcess, resources, wait_until

ECHO = "python:tests.models:echo"


def failed_start(tmp_path: Path, **env: str) -> tuple[int, str]:
    """The exit status and log of a process of ``env`` whose start fails."""
    proc = VegaProcess({"VEGA_MODEL": ECHO, "VEGA_EXECUTOR": "process", **env},
                       log_path=tmp_path / "log")
    proc.start(wait_ready=False)
    try:
        wait_until(lambda: proc.proc is not None and proc.proc.poll() is not None, 60,
                   "the start to fail")
        assert proc.proc is not None
        code = proc.proc.poll()
        assert code is not None
        return code, proc.log()
    finally:
        proc.kill()


def test_a_warm_up_pass_past_the_model_timeout_names_the_shape(tmp_path: Path) -> None:
    # Every forward takes 1.5 s: loading (bounded by the start timeout) gets through, the
    # first warm-up pass is past VEGA_MODEL_TIMEOUT_S, and the start fails saying where.
    code, log = failed_start(tmp_path, VEGA_MODEL_TIMEOUT_S="0.5", TEST_SLEEP_MS="1500")
    assert code != 0
    assert "start failed" in log and "warm-up (1 x 16 steps)" in log


def test_a_module_failing_on_longer_windows_stops_the_start_naming_the_shape_and_the_fix(
        tmp_path: Path) -> None:
    code, log = failed_start(tmp_path, VEGA_MODEL="python:tests.models:positions_of_100",
                             VEGA_EXECUTOR="auto")
    assert code == 3  # a model that cannot start, as one that cannot load
    line = [row for row in log.splitlines() if row.startswith("vega: ")]
    assert line == [line[0]] and "model 'positions_of_100' failed warming up on a batch of 1 x " \
        "128 steps (RuntimeError: " in line[0], log
    assert "windows of 1..512 steps are accepted" in line[0] and "vega_max_length" in line[0]


def test_a_model_process_that_loads_past_the_start_timeout_fails_the_start(
        tmp_path: Path) -> None:
    code, log = failed_start(tmp_path, VEGA_MODEL_START_TIMEOUT_S="1",
                             TEST_LOAD_SLEEP_MS="4000")
    assert code != 0 and "did not load within 1 s" in log


def model_pid(proc: VegaProcess) -> int | None:
    [pid] = httpx.get(proc.url + "/v1/status").json()["executor"]["pids"]
    return int(pid) if pid is not None else None


def test_the_serving_process_keeps_no_copy_of_weights_its_model_process_runs(
        tmp_path: Path) -> None:
    proc = VegaProcess({"VEGA_MODEL": "python:tests.models:heavy", "VEGA_EXECUTOR": "process"},
                       log_path=tmp_path / "log").start()
    try:
        assert proc.proc is not None
        child = model_pid(proc)
        assert child is not None
        # 256 MB of weights: in the model process, not also in the serving process.
        held_kib = resources(child)[0], resources(proc.proc.pid)[0]
        assert held_kib[0] - held_kib[1] > 192 * 1024, held_kib
        assert httpx.post(proc.url + "/v1/infer",
                          json={"inputs": [[1.0] * 8] * 4}).json()["outputs"] == [1.0] * 8
    finally:
        proc.stop()


def test_a_module_drawn_without_a_seed_starts_and_comes_back_after_a_crash(
        tmp_path: Path) -> None:
    proc = VegaProcess({"VEGA_MODEL": "python:tests.models:drawn", "VEGA_EXECUTOR": "process"},
                       log_path=tmp_path / "log").start()
    try:
        body = {"inputs": [[1.0] * 8] * 4}
        first = httpx.post(proc.url + "/v1/infer", json=body)
        assert first.status_code == 200 and "drawn without a seed?" in proc.log()
        child = model_pid(proc)
        assert child is not None
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: model_pid(proc) not in (child, None)
                   and httpx.get(proc.url + "/readyz").status_code == 200, 60,
                   "the model process back")
        assert httpx.post(proc.url + "/v1/infer", json=body).status_code == 200
    finally:
        proc.stop()


def test_the_model_list_is_503_while_warming_up_then_lists_the_model(
        vega: Callable[..., VegaProcess]) -> None:
    proc = vega(VEGA_MODEL="python:tests.models:echo", TEST_LOAD_SLEEP_MS="4000",
                wait_ready=False)

    def listed() -> httpx.Response | None:
        try:
            return httpx.get(proc.url + "/v1/models", timeout=5)
        except httpx.TransportError:
            return None
    warming = wait_until(listed, 60, "the process listening")
    # An empty list would read as "serves nothing": not known yet, as the routes say.
    assert warming.status_code == 503 and warming.json()["error"]["code"] == "not_ready"
    wait_until(lambda: httpx.get(proc.url + "/readyz", timeout=5).status_code == 200, 60,
               "warm")
    assert [m["name"] for m in httpx.get(proc.url + "/v1/models").json()["models"]] == ["echo"]


def test_a_slow_model_process_build_is_logged_while_the_process_is_not_ready(
        tmp_path: Path) -> None:
    # Building may take minutes: the journal must not stay silent until it is over.
    proc = VegaProcess({"VEGA_MODEL": ECHO, "VEGA_EXECUTOR": "process",
                        "TEST_LOAD_SLEEP_MS": "4000"}, log_path=tmp_path / "log")
    proc.start(wait_ready=False)
    try:
        log_path = tmp_path / "log"  # made by the forked server: not there at once
        wait_until(lambda: log_path.exists() and "model process 0 (pid " in proc.log(), 60,
                   "the build logged")
        log = proc.log()
        assert "building the model(s) python:tests.models:echo" in log
        assert "building the model(s), 300 s at most" in log and "ready (pid" not in log
        assert httpx.get(proc.url + "/readyz", timeout=5).status_code == 503
        proc.wait_ready()
    finally:
        proc.stop()
