"""The tests' fork server outlives a Ctrl-C, so the exits of its forks are still reported."""

from __future__ import annotations

import os
import signal

from tests.forkserver import ROOT, ForkServer


def test_a_ctrl_c_leaves_the_fork_server_reporting_exits() -> None:
    server = ForkServer()  # its own, not the shared one
    try:
        os.kill(server._proc.pid, signal.SIGINT)  # what a Ctrl-C sends the process group
        env = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
        forked = server.start(["config"], env, ROOT, None)
        assert forked.wait(30) == 0
        assert server._proc.poll() is None
    finally:
        assert server._proc.stdin is not None and server._proc.stdout is not None
        server._proc.stdin.close()  # the fork server ends with its pipe
        server._proc.wait(30)
        server._proc.stdout.close()
