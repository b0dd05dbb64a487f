"""The operator's scripts leave nothing behind when a Ctrl-C stops them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.infra import require
from tests.servers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_ctrl_c_during_bench_overflow_removes_its_folder(tmp_path: Path) -> None:
    # Its folder of sockets, logs and wrk scripts was left in /tmp, Ctrl-C or not.
    require("redis-server")
    run = subprocess.Popen([str(ROOT / "scripts" / "bench-overflow"), "1", "8"],
                           env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any(tmp_path.glob("vega-bench.*/critical.lua")), 30, "its folder")
        os.killpg(run.pid, signal.SIGINT)  # what a Ctrl-C sends
        run.wait(60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [(["10"], "requests: at least 64"),
                                           (["--rounds", "0"], "--rounds: at least 1")])
def test_bench_loop_refuses_too_few_requests_or_rounds_in_one_line(
        argv: list[str], message: str) -> None:
    # 10 requests divided by zero after the warm-up; 0 rounds took the median of nothing.
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_loop.py"), *argv],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_gpu_check_without_a_gpu_says_so_and_what_to_run_instead(tmp_path: Path) -> None:
    # Any GPU here is hidden from it: the host without one is what is under test.
    run = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1
    assert "torch sees no CUDA device here" in run.stderr
    assert "--device cpu runs the same steps" in run.stderr


def test_a_ctrl_c_while_a_bench_waits_for_its_server_stops_the_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A SIGINT to the script alone, while a server warmed up, left that server running.
    import importlib.util
    import socket

    spec = importlib.util.spec_from_file_location("bench_core", ROOT / "scripts" / "bench_core.py")
    assert spec is not None and spec.loader is not None
    bench_core: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_core)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there: never ready

    sleep = time.sleep

    def interrupted(seconds: float) -> None:
        monkeypatch.setattr(time, "sleep", sleep)  # once: the Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", interrupted)
    server = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(KeyboardInterrupt):
            bench_core.ready(server, port)
        assert server.poll() is not None
    finally:
        server.kill()
        server.wait()
