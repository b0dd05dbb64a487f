"""A model process's standby: the child of its next life, started ahead and waiting with
torch imported, so that a restart only builds and warms the models."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import VegaProcess, wait_until
from tests.test_executor import ECHO, echo_batch, echo_executor, infer, model_pid, ready
from vega.executor import Executor
from vega.modelproc import handle
from vega.models import SequenceModel

pytestmark = pytest.mark.slow


def imported_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped: it imported torch."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.05)


async def killed_and_back(executor: Executor, model: SequenceModel) -> None:
    """Kill the model process's life; wait for the next, and see it answer."""
    restarts, pid = executor.restarts, executor.processes[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    await until(lambda: executor.available and executor.restarts == restarts + 1,
                "the model process came back")
    batch = echo_batch(model, 0.5)
    await executor.run(batch)
    assert batch.items[0].future.result()[1] == 4.0


async def warm_executor() -> tuple[Executor, SequenceModel]:
    """The echo model's executor, warm (as after the server's warm-up): standbys kept."""
    executor, model = await echo_executor()
    executor.warm()
    return executor, model


async def test_a_restart_takes_the_waiting_standby_and_starts_the_next() -> None:
    executor, model = await echo_executor()
    process = executor.processes[0]
    try:
        # None beside the warm-up, whose timed passes its import would slow.
        await asyncio.sleep(0.5)
        assert process.standby.pid is None
        executor.warm()
        standby, first = process.standby.pid, process.pid
        assert standby is not None and standby != first
        # It imported torch while the first life served, before any restart needed it.
        await until(lambda: imported_torch(standby), "the standby imported torch")
        await killed_and_back(executor, model)
        assert process.pid == standby  # the restart took the child that was waiting
        # and starts the next once it is up (after it is seen ready, which it does not delay)
        await until(lambda: process.standby.pid not in (None, standby, first),
                    "the next standby started")
    finally:
        executor.shutdown()


async def test_a_standby_that_died_waiting_is_replaced_by_a_fresh_start() -> None:
    executor, model = await warm_executor()
    process = executor.processes[0]
    try:
        standby, first = process.standby.pid, process.pid
        assert standby is not None
        os.kill(standby, signal.SIGKILL)  # the OOM killer, an operator
        # No longer listed (/v1/status), nor left a zombie until the next restart.
        await until(lambda: process.standby.pid is None, "the dead standby unlisted")
        assert not Path(f"/proc/{standby}").exists()
        await killed_and_back(executor, model)
        assert process.pid not in (None, standby, first)
    finally:
        executor.shutdown()


async def test_a_standby_ends_with_its_executor() -> None:
    executor, _ = await warm_executor()
    waiting = executor.processes[0].standby.child
    assert waiting is not None
    executor.shutdown()
    # Its pipe closed: it exits (killed if still importing once the stop's grace ends).
    assert waiting.process.returncode is not None
    assert not Path(f"/proc/{waiting.process.pid}").exists()


def test_a_served_process_shows_its_standby_and_leaves_none_behind(
        vega: Callable[..., VegaProcess]) -> None:
    proc = vega(VEGA_MODEL=ECHO, VEGA_EXECUTOR="process")
    executor = httpx.get(proc.url + "/v1/status", timeout=5).json()["executor"]
    [standby] = executor["standby_pids"]
    assert standby not in (None, model_pid(proc))
    os.kill(model_pid(proc), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (ready(proc) and model_pid(proc) == standby):
        assert time.monotonic() < deadline, "the standby took over"
        time.sleep(0.05)
    assert infer(proc.url).status_code == 200

    def next_standby() -> Any:
        [pid] = httpx.get(proc.url + "/v1/status", timeout=5).json()["executor"]["standby_pids"]
        return pid

    while (after := next_standby()) in (None, standby):
        assert time.monotonic() < deadline, "the next standby started"
        time.sleep(0.05)
    assert proc.stop() == 0
    for pid in (standby, after):
        assert not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("backoff_s, load_ms", [(1.0, "0"), (0.0, "1500")],
                         ids=["during_the_backoff", "while_the_next_life_loads"])
async def test_a_model_process_stopped_between_lives_starts_none_and_logs_no_failure(
        backoff_s: float, load_ms: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vega.modelproc")
    monkeypatch.setattr(handle, "BACKOFF_S", (backoff_s,))
    monkeypatch.setenv("TEST_LOAD_SLEEP_MS", load_ms)
    executor, _ = await warm_executor()
    process = executor.processes[0]
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    await until(lambda: process.exits == 1, "the death seen")
    await asyncio.sleep(0.3)
    executor.shutdown()
    await asyncio.sleep(3.0)  # past the backoff, and a start's import
    started = [r for r in caplog.records if "ready (pid" in r.getMessage()]
    assert len(started) == 1  # the first life's; none after the stop
    assert "failed to start" not in caplog.text and process.exits == 1


async def test_a_stop_while_a_restart_starts_its_child_leaves_no_child(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No standby waits (before warm-up), so the restart starts a child; the stop comes
    while it forks. The child must not outlive the stop: it was handed the shared memory
    the stop frees (and its fd number, reused)."""
    monkeypatch.setattr(handle, "BACKOFF_S", (0.05,))
    executor, _ = await echo_executor()
    process = executor.processes[0]
    assert process.pid is not None
    fork = subprocess.Popen
    started: list[tuple[bool, subprocess.Popen[bytes]]] = []
    stopped: list[bool] = []

    def slow_fork(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        time.sleep(0.5)  # the watcher thread descheduled just before its fork
        started.append((bool(stopped), fork(*args, **kwargs)))
        return started[-1][1]

    monkeypatch.setattr(subprocess, "Popen", slow_fork)
    os.kill(process.pid, signal.SIGKILL)
    await until(lambda: process.exits == 1, "the death seen")
    await asyncio.sleep(0.2)
    executor.shutdown()
    stopped.append(True)
    await until(lambda: bool(started), "the fork")
    await asyncio.sleep(0.5)
    [(after_the_stop, child)] = started
    assert not after_the_stop  # the stop waited: the memory it is handed was still there
    assert child.poll() is not None  # and it was stopped at once


async def test_a_restart_that_runs_out_of_fds_once_tries_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of connections can leave no fd for the next life's pipe: that start fails
    like any other (logged, backed off), not the watcher thread with it."""
    monkeypatch.setattr(handle, "BACKOFF_S", (0.05, 0.1))
    executor, _ = await echo_executor()
    process = executor.processes[0]
    assert process.pid is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        os.kill(process.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)  # a start or two failed: no fd for a socket pair
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        await until(lambda: process.up, "the model process came back")
    finally:
        executor.shutdown()


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_model_process_hung_in_a_batch_goes_when_the_serving_process_is_killed(
        vega: Callable[..., VegaProcess], tmp_path: Path) -> None:
    # A child reads its pipe's end only between batches: one hung in a batch outlived a
    # kill -9 (or an OOM kill) of the serving process for as long as it hung.
    forwards = tmp_path / "forwards"
    proc = vega(VEGA_MODEL=ECHO, VEGA_EXECUTOR="process", TEST_HANG_MS="600000",
                TEST_FORWARD_LOG=str(forwards))
    child = model_pid(proc)

    def standby() -> int | None:
        [pid] = httpx.get(proc.url + "/v1/status", timeout=5).json()["executor"]["standby_pids"]
        return None if pid is None else int(pid)
    waiting = wait_until(standby, 60, "the standby")
    passes = len(forwards.read_text().splitlines())
    assert infer(proc.url, first=-666.0, deadline_ms=500).status_code == 504
    assert len(forwards.read_text().splitlines()) == passes + 1  # in the hung batch
    proc.kill()
    try:
        wait_until(lambda: not running(child) and not running(waiting), 30,
                   "the model process and its standby to end")
    finally:
        for pid in (child, waiting):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
