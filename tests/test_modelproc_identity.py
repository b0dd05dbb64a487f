"""A model process serves only the model this process advertises (its identity)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.servers import served_device, wait_until
from vega.executor import Executor, driven
from vega.modelproc import ProcessPlan
from vega.models import identity, load_model

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

# A user's module whose weights come from a file (TEST_WEIGHTS), read as it is built.
FROM_FILE = '''
import os

import torch


def scaled(name):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with open(os.environ["TEST_WEIGHTS"]) as weights:
                values = [float(v) for v in weights.read().split()]
            self.scale = torch.nn.Parameter(torch.tensor(values))

        def forward(self, x, lengths):
            return x.sum(dim=1) / lengths[:, None].to(x.dtype) * self.scale

    return Scaled()
'''
SPEC = "python:vega_test_weights_file:scaled"
OLD, NEW = "1 2 3 4 5 6 7 8", "8 7 6 5 4 3 2 1"


@pytest.fixture
def weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "vega_test_weights_file.py").write_text(FROM_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the child's PYTHONPATH is this sys.path
    path = tmp_path / "weights.txt"
    path.write_text(OLD)
    monkeypatch.setenv("TEST_WEIGHTS", str(path))
    return path


def executor_of(spec: str) -> Executor:
    plan = ProcessPlan(specs=((spec, "scaled"),), device=served_device(), torch_threads=1,
                       slot_bytes=1 << 20, timeout_s=30.0)
    return Executor({"scaled": load_model(spec, "scaled")}, plan=plan)


def test_a_model_changed_on_disk_is_not_served_by_a_restarted_model_process(
        weights: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The weights file overwritten in place, then the model process killed: restarted, it
    built the new weights while this process still advertised the old model's identity,
    so peers and the response cache mixed the answers of two models."""
    executor = executor_of(SPEC)
    executor.load(served_device())
    try:
        pid = executor.processes[0].pid
        assert pid is not None and executor.available
        weights.write_text(NEW)
        with caplog.at_level(logging.ERROR, logger="vega.modelproc"):
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: "changed on disk?" in caplog.text, 60, "a refused restart")
            assert "Restart the process to serve it" in caplog.text
            assert not executor.available and executor.restarts == 0
            weights.write_text(OLD)  # what this process serves: the next try takes it
            wait_until(lambda: executor.available, 60, "the restart")
        assert executor.restarts == 1
    finally:
        executor.shutdown()


def test_a_model_built_otherwise_by_its_model_process_is_served_as_that_process_built_it(
        weights: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A module that draws its weights (no seed) builds other ones in each process: what
    is served, and keyed by peers and the cache, is the model process's copy; and its
    model process, killed, comes back (it draws again; nothing to check it against)."""
    executor = executor_of(SPEC)
    parents = identity(executor.models["scaled"])
    weights.write_text(NEW)  # after this process built it, before its model process did
    with driven(executor):
        with caplog.at_level(logging.WARNING, logger="vega.executor"):
            executor.load(served_device())
        assert "drawn without a seed?" in caplog.text
        served = identity(executor.models["scaled"])
        assert served != parents and served == identity(load_model(SPEC, "scaled"))
        outputs, _ = executor.run_sync("scaled", [np.ones((2, 8), np.float32)], 2)
        np.testing.assert_allclose(outputs[0], [8, 7, 6, 5, 4, 3, 2, 1])
        pid = executor.processes[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: executor.restarts == 1 and executor.available, 60, "the restart")
