"""Real processes for tests: free ports, and a `vega serve` subprocess polled until ready."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from tests.forkserver import Forked, ForkServer

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def served_device() -> str:
    """The device a ``vega serve`` here picks (VEGA_DEVICE, by default a GPU where torch
    sees one): where in-process tests run their models, so that scripts/gpu-check's run
    of them on cuda tests what the servers do."""
    from vega.executor import pick_device

    return pick_device(os.environ.get("VEGA_DEVICE", "auto"))


def wait_until(check: Any, timeout_s: float = 60.0, what: str = "condition") -> Any:
    """Poll ``check()`` until it returns something truthy."""
    end = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


class VegaProcess:
    """``python -m vega serve`` on a free port, with settings given as VEGA_* env."""

    def __init__(self, env: dict[str, str] | None = None, log_path: Path | None = None,
                 port: int | None = None, host: str = "127.0.0.1",
                 prefix: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NAME]: run on a test host
        self.env = {"VEGA_TORCH_THREADS": "1", "VEGA_WARMUP_BATCHES": "1", **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | Forked | None = None

    def start(self, wait_ready: bool = True) -> VegaProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
        env.update(self.env)
        env["VEGA_PORT"] = str(self.port)
        env["VEGA_HOST"] = self.host
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        # A fork shares the fork server's interpreter start-up, so a test that changes
        # it (PYTHONPATH, a sitecustomize) gets a fresh interpreter.
        forkable = not self.prefix and not any(k.startswith("PYTHON") for k in self.env)
        if forkable and os.environ.get("TESTS_FORKSERVER", "1") == "1":
            self.proc = ForkServer.get().start(["serve"], env, ROOT, self.log_path)
        else:
            self.proc = self._popen(env)
        if wait_ready:
            self.wait_ready()
        return self

    def _popen(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = open(self.log_path, "wb") if self.log_path else None
        try:
            return subprocess.Popen([*self.prefix, sys.executable, "-m", "vega", "serve"],
                                    env=env, stdout=out or subprocess.DEVNULL,
                                    stderr=subprocess.STDOUT, cwd=ROOT)
        finally:
            if out is not None:
                out.close()  # the child has its own copy

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vega exited with {self.proc.returncode}: {self.log()}")
            try:
                return httpx.get(self.url + "/readyz", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout_s, "vega to be ready")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain), then wait; kill if it does not exit in time."""
        if self.proc is None:
            return 0
        code = self.proc.poll()
        if code is not None:
            return code
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def resources(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open descriptors) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def metric(proc: VegaProcess, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(proc.url + "/metrics", timeout=5).text.splitlines():
        match = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total
