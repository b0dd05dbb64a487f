"""Fixtures that start the real programs: ``redis-server`` and ``nginx``, on free ports.

Registered through ``pytest_plugins`` in conftest.py. Each program runs under
tmp_path, is polled until it answers, and is stopped (and waited for) afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import pytest

from tests.servers import free_port, wait_until
from vega.lab.cluster import render_nginx

# Every redis-server started here, so that none outlives the session even where a
# fixture's teardown did not run (a dropped Popen of a running server would also turn
# into a ResourceWarning, an error, in whichever test the collector happens to run).
_REDIS: list[subprocess.Popen[bytes]] = []


def start_redis(args: Sequence[str], cwd: Path | None = None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=cwd)
    _REDIS.append(proc)
    return proc


def pytest_sessionfinish() -> None:
    for proc in _REDIS:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def unavailable(why: str) -> NoReturn:
    """Skip a test this machine cannot run, except in CI, whose machines can run them all:
    there a missing part is a broken setup, so the test fails."""
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def require(*programs: str) -> None:
    """Skip (fail in CI) when a program the test starts is missing."""
    missing = [name for name in programs if shutil.which(name) is None]
    if missing:
        unavailable(f"{', '.join(missing)} not installed (scripts/system-deps installs it)")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` without persistence on a free port; ``stop``/``start`` keep the port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.proc = start_redis(["--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(self.workdir)])
        wait_until(lambda: _answers(self.port), 10, "redis-server")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # as a crash would: no goodbye to the clients
            self.proc.wait()

    def pause(self, seconds: float) -> None:
        """Freeze the server (SIGSTOP) for ``seconds``: connections stay open, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    require("redis-server")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


class Nginx:
    """Nginx with the repository's nginx.conf rendered for the given upstreams."""

    def __init__(self, upstreams: Sequence[str], workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(render_nginx(upstreams, f"127.0.0.1:{self.port}", workdir))
        self.proc: subprocess.Popen[bytes] | None = None

    def check(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nginx", "-t", "-p", str(self.workdir), "-e",
                               str(self.workdir / "nginx-error.log"), "-c", str(self.conf)],
                              capture_output=True, text=True, check=False)

    def start(self) -> Nginx:
        self.proc = subprocess.Popen(
            ["nginx", "-p", str(self.workdir), "-e", str(self.workdir / "nginx-error.log"),
             "-c", str(self.conf), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return True
            except OSError:
                assert self.proc is not None and self.proc.poll() is None, "nginx exited"
                return False
        wait_until(listening, 10, "nginx")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Callable[[Sequence[str]], Nginx]]:
    """Factory: ``nginx(["127.0.0.1:8001", "unix:/path.sock"])`` starts one in front of them."""
    require("nginx")
    started: list[Nginx] = []

    def start(upstreams: Sequence[str]) -> Nginx:
        workdir = tmp_path / f"nginx-{len(started)}"
        workdir.mkdir()
        proxy = Nginx(upstreams, workdir)
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in started:
        proxy.stop()
