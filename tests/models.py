"""Models for tests, loaded by a server through ``VEGA_MODEL=python:tests.models:NAME``.

They take the same inputs as the built-in sensor model (windows of L x 8 floats)
and are tuned through ``TEST_*`` environment variables, since they run inside a
server subprocess.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np

from vega.models.base import SequenceModel

FAIL_MARK = 666.0  # an instance whose first value is this makes the batch raise


class _Echo:
    """forward: per item, [sum of valid inputs, length, batch size]; optional sleep, failure."""

    def __init__(self) -> None:
        self.sleep_s = float(os.environ.get("TEST_SLEEP_MS", "0")) / 1000
        self.per_item_s = float(os.environ.get("TEST_PER_ITEM_MS", "0")) / 1000
        self.hang_s = float(os.environ.get("TEST_HANG_MS", "0")) / 1000
        self.forwards: dict[float, int] = {}
        self.lock = threading.Lock()

    def to(self, device: Any) -> _Echo:
        time.sleep(float(os.environ.get("TEST_LOAD_SLEEP_MS", "0")) / 1000)  # a slow start
        return self

    def eval(self) -> _Echo:
        return self

    def __call__(self, x: Any, lengths: Any) -> Any:
        import torch

        batch = x.shape[0]
        if self.sleep_s or self.per_item_s:
            time.sleep(self.sleep_s + self.per_item_s * batch)
        if bool((x[:, 0, 0] == FAIL_MARK).any()):
            raise ValueError("test model asked to fail")
        if self.hang_s and bool((x[:, 0, 0] == -FAIL_MARK).any()):
            time.sleep(self.hang_s)
        total = x.sum(dim=(1, 2))
        return torch.stack([total, lengths.to(x.dtype),
                            torch.full_like(total, float(batch))], dim=1)


def echo(name: str) -> SequenceModel:
    return SequenceModel(_Echo(), name, channels=8, max_length=512, output_size=3)


def window(length: int, value: float = 0.5) -> list[list[float]]:
    """A valid instance for the test and sensor models."""
    return np.full((length, 8), value, dtype=np.float32).tolist()  # type: ignore[no-any-return]
