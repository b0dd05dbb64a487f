"""`vega cluster`: N processes, a local Redis and Nginx from one command; Ctrl-C stops all."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from tests.books import NOT_ACCEPTED, Books, offer, steady
from tests.infra import require
from tests.models import ledger, tagged, window
from tests.servers import ROOT, free_port, wait_until
from vega.lab.cluster import _ready


def stop(proc: subprocess.Popen[bytes]) -> None:
    """After a failed assertion: let `vega cluster` stop its children, then kill it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_cluster(processes: int, port: int, out: Path, **env: str
                  ) -> tuple[subprocess.Popen[bytes], Path]:
    """`vega cluster -n PROCESSES` of the echo model on PORT, ready, its output in OUT; and its
    folder, under /tmp itself, not pytest's private one: Nginx's unprivileged workers
    must be able to reach the sockets, as they would in /run/vega."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
    environ.update(VEGA_MODEL="python:tests.models:echo", VEGA_TORCH_THREADS="1",
                   VEGA_WARMUP_BATCHES="1", PYTHONPATH=str(ROOT), **env)
    run_dir = Path(tempfile.mkdtemp(prefix="vega-cluster-test-"))
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vega", "cluster", "-n", str(processes),
                                 "--listen", f"127.0.0.1:{port}", "--dir", str(run_dir)],
                                env=environ, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_until(lambda: "behind http://" in out.read_text(), 120, "the cluster to be ready")
    except BaseException:
        stop(proc)
        raise
    return proc, run_dir


def cluster_in(tmp_path: Path, processes: int, **env: str
               ) -> tuple[subprocess.Popen[bytes], Path, int, Path]:
    """`vega cluster` started on a free port (Nginx and Redis needed): the process, its
    folder, the port and the file its output goes to."""
    require("nginx", "redis-server")
    port = free_port()
    out = tmp_path / "cluster.out"
    proc, run_dir = start_cluster(processes, port, out, **env)
    return proc, run_dir, port, out


@pytest.mark.timeout(180)
def test_cluster_command_serves_through_nginx_and_stops_everything(tmp_path: Path) -> None:
    proc, run_dir, port, out = cluster_in(tmp_path, 2)
    try:
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
        stop(proc)
    sockets = list(run_dir.glob("vega-*.sock"))
    assert len(sockets) <= 2
    for path in sockets:  # nothing listens any more
        probe = subprocess.run(["python3", "-c", f"import socket; s=socket.socket(socket.AF_UNIX); "
                                f"s.connect({str(path)!r})"], capture_output=True, check=False)
        assert probe.returncode != 0
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.timeout(180)
def test_stopping_the_cluster_answers_what_it_admitted_and_no_502(tmp_path: Path) -> None:
    # Nginx stops gracefully (given SIGTERM it closed the connections of the requests the
    # processes were still answering), and with the processes: after them, it answered
    # 502 from their closed sockets until it had stopped.
    proc, run_dir, port, _ = cluster_in(tmp_path, 1, TEST_SLEEP_MS="1000",
                                        VEGA_LENGTH_BUCKETS="16")
    url = f"http://127.0.0.1:{port}/v1/infer"

    def meanwhile() -> list[int]:
        """Statuses of requests sent one after another until the cluster has exited."""
        statuses = []
        while proc.poll() is None:
            try:
                statuses.append(httpx.post(url, json={"inputs": window(4)}, timeout=30)
                                .status_code)
            except httpx.TransportError:
                statuses.append(0)  # refused: Nginx no longer listens
        return statuses
    try:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(httpx.post, url, json={"instances": [window(4), window(9)],
                                                         "deadline_ms": 20_000}, timeout=60)
            wait_until(lambda: _inflight(port) >= 1, 30, "its batch running")
            proc.send_signal(signal.SIGTERM)
            later = pool.submit(meanwhile)
            answer = running.result()
            assert answer.status_code == 200 and len(answer.json()["outputs"]) == 2
            assert set(later.result()) <= {503, 0}, later.result()
        assert proc.wait(60) == 0
    finally:
        stop(proc)
    shutil.rmtree(run_dir, ignore_errors=True)


def _inflight(port: int) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("vega_inflight_batches"))


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.timeout(180)
def test_nginx_killed_outright_stops_the_cluster_and_leaves_no_worker_on_the_port(
        tmp_path: Path) -> None:
    proc, run_dir, port, out = cluster_in(tmp_path, 1)
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        master = next(int(pid) for pid in children
                      if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"nginx"))
        assert len(group_members(master)) > 1  # the master and its workers
        os.kill(master, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "nginx exited with -9; stopping" in out.read_text()
        assert group_members(master) == []
        with socket.socket() as probe:  # nothing listens on the cluster's port any more
            assert probe.connect_ex(("127.0.0.1", port)) != 0
    finally:
        stop(proc)
    shutil.rmtree(run_dir, ignore_errors=True)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(180)
def test_a_second_sigterm_while_stopping_still_stops_every_child(tmp_path: Path) -> None:
    proc, run_dir, _, _ = cluster_in(tmp_path, 1)
    try:
        children = [int(pid) for pid in
                    Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(children) == 3  # Redis, the Vega process, Nginx
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "SIGTERM: draining" in (run_dir / "vega-1.log").read_text(), 30,
                   "the process to start draining")
        proc.send_signal(signal.SIGTERM)  # while the cluster waits for it to drain
        assert proc.wait(60) == 0
        assert [pid for pid in children if alive(pid)] == []
    finally:
        stop(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


def vega_children(pid: int) -> list[int]:
    """The `vega serve` processes a `vega cluster` started (its direct children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = []
    for child in map(int, children):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-m", b"vega", b"serve"]:
            found.append(child)
    return found


@pytest.mark.timeout(240)
async def test_a_killed_process_is_restarted_and_nothing_it_read_is_run_again(
        tmp_path: Path) -> None:
    """Callers whose request the killed process had read get 502 process_lost (it may
    have run): Nginx does not run it a second time elsewhere. Every other caller gets 200."""
    ledger_path = tmp_path / "ledger"
    proc, run_dir, port, out = cluster_in(tmp_path, 2, TEST_SLEEP_MS="10",
                                          TEST_LEDGER=str(ledger_path))
    try:
        victim = vega_children(proc.pid)[0]
        books = Books()
        plan = steady(80, 6.0, lambda i, p: orjson.dumps({"inputs": tagged(i)}))
        load = asyncio.ensure_future(offer(f"http://127.0.0.1:{port}", plan, books,
                                           connections=32))
        await asyncio.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        await load
        problems = books.problems(ran=ledger(str(ledger_path)))
        assert [p for p in problems if "outside DESIGN.md" not in p] == [], books.summary()
        lost = [outcome for _, outcome in books.outside_table]  # at most one a connection
        assert set(lost) <= {"502 process_lost"} and len(lost) <= 32, books.summary()
        assert NOT_ACCEPTED not in books.tally()
        assert books.tally()["200"] >= 0.9 * len(plan), books.summary()
        # Back and warm within 30 s of the kill, and said so.
        await asyncio.to_thread(wait_until, lambda: "process 1 restarted" in out.read_text()
                                or "process 2 restarted" in out.read_text(), 30, "a restart")
        sockets = sorted(run_dir.glob("vega-*.sock"))
        await asyncio.to_thread(wait_until, lambda: all(_ready(s) for s in sockets), 30,
                                "both ready")
        assert victim not in vega_children(proc.pid) and len(vega_children(proc.pid)) == 2
        # The process's log holds what the killed life wrote, then the restart's.
        logs = "".join(path.read_text() for path in run_dir.glob("vega-*.log"))
        assert f"Started server process [{victim}]" in logs
        assert logs.count("Started server process") == 3
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0  # still drains and stops
    finally:
        stop(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.timeout(60)
def test_a_cluster_whose_listen_address_is_taken_says_so_before_starting_anything() -> None:
    # Nginx found it only once Redis and every process had started, and its last line,
    # the one quoted, was "nginx: [emerg] still could not bind()".
    require("nginx", "redis-server")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
    environ.update(VEGA_MODEL="python:tests.models:echo", PYTHONPATH=str(ROOT))
    run_dir = Path(tempfile.mkdtemp(prefix="vega-cluster-test-"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run([sys.executable, "-m", "vega", "cluster", "-n", "1", "--listen",
                               listen, "--dir", str(run_dir)],
                              env=environ, capture_output=True, text=True, cwd=ROOT, timeout=50)
    assert done.returncode == 3
    assert done.stderr.splitlines() == [f"vega cluster: --listen {listen}: Address already in use"]
    assert not (run_dir / "vega-1.log").exists() and not (run_dir / "redis.log").exists()
    shutil.rmtree(run_dir)


@pytest.mark.parametrize("folder, why", [
    ("{tmp}/file", "{tmp}/file exists and is not a directory"),
    ("/proc/vc", "cannot write in /proc"),  # tried: root may write anywhere by the bits
])
def test_a_cluster_whose_folder_cannot_be_made_says_so_before_starting_anything(
        tmp_path: Path, folder: str, why: str) -> None:
    # It was a traceback (FileExistsError, FileNotFoundError) from making the folder.
    (tmp_path / "file").write_text("")
    done = subprocess.run([sys.executable, "-m", "vega", "cluster", "-n", "1", "--listen",
                           f"127.0.0.1:{free_port()}", "--dir", folder.format(tmp=tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=50)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"vega cluster: --dir {folder.format(tmp=tmp_path)}: {why.format(tmp=tmp_path)}"]


@pytest.mark.timeout(120)
def test_a_cluster_that_cannot_start_says_why_in_one_line_and_stops_everything(
        tmp_path: Path) -> None:
    require("nginx", "redis-server")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
    environ.update(VEGA_MODEL="python:nosuch.module:build", PYTHONPATH=str(ROOT))
    run_dir = Path(tempfile.mkdtemp(prefix="vega-cluster-test-"))
    done = subprocess.run([sys.executable, "-m", "vega", "cluster", "-n", "1", "--listen",
                           f"127.0.0.1:{free_port()}", "--dir", str(run_dir)],
                          env=environ, capture_output=True, text=True, cwd=ROOT, timeout=100)
    assert done.returncode == 3
    assert done.stderr.splitlines() == [
        "vega cluster: vega serve exited with 3: vega: python:nosuch.module:build: "
        f"No module named 'nosuch' (logs in {run_dir})"]
    assert subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True).returncode == 1
