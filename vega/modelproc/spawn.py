"""Starting a model process's child, keeping the next one waiting, and how one ended.

Most of a child's start is importing torch (about a second on a CPU), not building the
models. So while one life serves, the child for the next is already started and waits with
torch imported (the standby: about 150 MB of memory, no CPU, nothing on the device). A
restart then only builds and warms the models: the time every caller gets 503 shrinks
from the backoff plus ~1.5 s to the backoff plus the build.

The child reads its configuration as soon as it starts, imports, and then waits for GO
before it builds anything; the first life is sent GO at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from vega.modelproc.child import ChildConfig, encode_config

log = logging.getLogger("vega.modelproc")


@dataclass
class Child:
    """A started child: its process and our end of its pipe."""

    process: subprocess.Popen[bytes]
    conn: Connection


def start_child(config: ChildConfig, slot_fd: int) -> Child:
    """Start ``python -m vega.modelproc`` and send it ``config``; it then imports torch and
    waits for GO."""
    ours, theirs = socket.socketpair()
    # The child imports the models as this process did: same path, same directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "vega.modelproc", str(theirs.fileno()), str(slot_fd)],
            pass_fds=(theirs.fileno(), slot_fd), env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    try:
        conn.send_bytes(encode_config(config))
    except OSError:
        pass  # it is gone already: the first read of its pipe says so
    return Child(process, conn)


def stop_child(child: Child, grace_s: float) -> None:
    """Close its pipe (a child waiting or serving then exits); kill it past ``grace_s``."""
    child.conn.close()
    try:
        child.process.wait(grace_s)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait(5.0)


class Standby:
    """The child for a model process's next life, started ahead and left waiting."""

    def __init__(self, start: Callable[[], Child]) -> None:
        self._start = start
        self._lock = threading.Lock()  # the watcher thread takes, the server's thread closes
        self._child: Child | None = None
        self._armed = False  # none is started before arm(): the server's warm-up first
        self._closed = False

    @property
    def child(self) -> Child | None:
        """The child waiting, if one is."""
        return self._child

    @property
    def pid(self) -> int | None:
        """The waiting child's pid; None once it died waiting (polled, so reaped: no zombie
        is left listed in /v1/status and ps until the next restart)."""
        child = self.child
        return None if child is None or child.process.poll() is not None else child.process.pid

    def arm(self) -> None:
        """Keep a child waiting from now on."""
        with self._lock:
            self._armed = True
        self.refill()

    def refill(self) -> None:
        """Start the next life's child, unless one is waiting (called once a life is up)."""
        with self._lock:
            if self._closed or not self._armed or \
                    (self._child is not None and self._child.process.poll() is None):
                return
            try:
                self._child = self._start()
            except OSError as error:  # out of fds or processes: a restart starts its own
                log.warning("model process standby not started: %s", error)

    def take(self) -> Child | None:
        """The waiting child if it is still alive, else one started now; None once closed
        (the shared memory a child is handed may be freed by then). Raises OSError."""
        with self._lock:  # started under it: never after close() returned
            if self._closed:
                return None
            child, self._child = self._child, None
            if child is not None and child.process.poll() is None:
                return child
            if child is not None:  # it died waiting (the OOM killer, an operator)
                stop_child(child, grace_s=0.0)
            return self._start()

    def close(self, grace_s: float) -> None:
        with self._lock:
            self._closed = True
            child, self._child = self._child, None
        if child is not None:
            stop_child(child, grace_s)


def exit_status(process: subprocess.Popen[bytes], wait_s: float) -> int | None:
    """A child's exit status, once its pipe has closed: it is exiting, so the wait is
    short (None if it is not over within ``wait_s``)."""
    try:
        return process.wait(wait_s)
    except subprocess.TimeoutExpired:
        return None


def ended(status: int | None) -> str:
    """How a child ended, for the log line that says it died: ", killed by SIGSEGV"."""
    if status is None:
        return ""
    try:
        return f", killed by {signal.Signals(-status).name}" if status < 0 \
            else f", exit status {status}"
    except ValueError:
        return f", killed by signal {-status}"
