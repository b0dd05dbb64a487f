"""`vega cluster`: N processes, a local Redis and Nginx from one command; Ctrl-C stops all."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.infra import require
from tests.models import window
from tests.servers import ROOT, free_port, wait_until


@pytest.mark.timeout(180)
def test_cluster_command_serves_through_nginx_and_stops_everything(tmp_path: Path) -> None:
    require("nginx", "redis-server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
    env.update(VEGA_MODEL="python:tests.models:echo", VEGA_TORCH_THREADS="1",
               VEGA_WARMUP_BATCHES="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "cluster.out"
    # Under /tmp itself, not pytest's private folder: Nginx's unprivileged workers must
    # be able to reach the sockets, as they would in /run/vega.
    run_dir = Path(tempfile.mkdtemp(prefix="vega-cluster-test-"))
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vega", "cluster", "-n", "2", "--listen",
                                 f"127.0.0.1:{port}", "--dir", str(run_dir)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_until(lambda: "behind http://" in out.read_text(), 120, "the cluster to be ready")
        url = f"http://127.0.0.1:{port}"
        answers = [httpx.post(url + "/v1/infer", json={"inputs": window(4)}, timeout=30)
                   for _ in range(10)]
        assert [a.status_code for a in answers] == [200] * 10
        # Each process sees the other through the local Redis once a heartbeat has passed.
        wait_until(lambda: len(httpx.get(url + "/v1/status", timeout=10).json()["peers"]) == 1,
                   20, "the processes to see each other")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:  # a failed assertion: let it stop its children, then kill
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    sockets = list(run_dir.glob("vega-*.sock"))
    assert len(sockets) <= 2
    for path in sockets:  # nothing listens any more
        probe = subprocess.run(["python3", "-c", f"import socket; s=socket.socket(socket.AF_UNIX); "
                                f"s.connect({str(path)!r})"], capture_output=True, check=False)
        assert probe.returncode != 0
    shutil.rmtree(run_dir, ignore_errors=True)
