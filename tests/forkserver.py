"""Start test servers as forks of a process that has already imported torch.

Importing torch costs a `vega serve` start about 1.5 s of CPU, and the suite starts
dozens of servers. A fork server is a fresh interpreter, with no threads of its own,
that imports the heavy third-party packages once (no Vega module: a per-process value
made at import, such as a request-id prefix, must stay per process) and then forks a
child per start. The child sets up its environment, working directory and log as
``subprocess.Popen`` would, and runs ``vega.cli.main``: a real `vega serve` process
(its own pid, sockets, signals, model processes and exit status), started faster.

The parent side (``ForkServer``, one per test process) speaks to it over pipes, a JSON
line per start; the fork server reaps its children and reports each exit status.
``Forked`` stands in for the ``subprocess.Popen`` of a start.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "numpy", "starlette.applications", "uvicorn", "uvloop", "httptools",
           "redis.asyncio", "orjson", "prometheus_client")


# -- the fork server (its own process) ---------------------------------------------

def main() -> None:
    # A Ctrl-C reaches the whole process group: the servers stop on it, and this process
    # stays to report their exits (it ends when the test process closes its pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in PRELOAD:
        __import__(name)
    requests, replies = sys.stdin.fileno(), sys.stdout.fileno()
    children: set[int] = set()
    pending = b""
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    _write(replies, {"ready": True})
    while True:
        if selector.select(timeout=0.05):
            chunk = os.read(requests, 65536)
            if not chunk:  # the test process is gone: so are its servers
                for pid in children:
                    _kill(pid)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _child(orjson.loads(line), requests, replies)
                children.add(pid)
                _write(replies, {"started": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _write(replies, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(request: dict[str, Any], requests: int, replies: int) -> None:
    """Become `vega <argv>` with the request's environment, directory and log; never return."""
    code = 1
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh `vega` has it
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) \
            if request["log"] else os.open(os.devnull, os.O_WRONLY)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in {requests, replies, log, null} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:0] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.argv = ["vega", *request["argv"]]
        from vega.cli import main as vega_main

        code = vega_main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _write(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, orjson.dumps(message) + b"\n")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# -- the test process's side --------------------------------------------------------

class Forked:
    """A forked `vega serve`, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._server.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.pid in self._server.codes,
                                                 timeout):
                raise subprocess.TimeoutExpired(f"vega (pid {self.pid})", timeout or 0.0)
        return self._server.codes[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # not yet reaped, so the pid is still this process's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The fork server of this test process, started on first use."""

    _instance: ForkServer | None = None
    _made = threading.Lock()

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=ROOT,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.codes: dict[int, int] = {}
        self.changed = threading.Condition()
        self._started: list[int] = []
        self._asking = threading.Lock()
        self._ready = False
        threading.Thread(target=self._read, name="forkserver", daemon=True).start()
        with self.changed:
            if not self.changed.wait_for(lambda: self._ready, 60):
                raise RuntimeError("the fork server did not start")

    @classmethod
    def get(cls) -> ForkServer:
        with cls._made:
            if cls._instance is None or cls._instance._proc.poll() is not None:
                cls._instance = ForkServer()
            return cls._instance

    def start(self, argv: list[str], env: dict[str, str], cwd: Path,
              log: Path | None) -> Forked:
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log) if log else ""}
        with self._asking, self.changed:
            assert self._proc.stdin is not None
            self._proc.stdin.write(orjson.dumps(request) + b"\n")
            self._proc.stdin.flush()
            if not self.changed.wait_for(lambda: self._started, 30):
                raise RuntimeError("the fork server did not answer")
            return Forked(self, self._started.pop())

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = orjson.loads(line)
            with self.changed:
                if "ready" in message:
                    self._ready = True
                elif "started" in message:
                    self._started.append(message["started"])
                else:
                    self.codes[message["exited"]] = message["code"]
                self.changed.notify_all()


if __name__ == "__main__":
    main()
