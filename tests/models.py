"""Models for tests, loaded by a server through ``VEGA_MODEL=python:tests.models:NAME``.

They take the same inputs as the built-in sensor model (windows of L x 8 floats)
and are tuned through ``TEST_*`` environment variables, since they run inside a
server subprocess.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from typing import Any

import numpy as np

from vega.models.base import SequenceModel

FAIL_MARK = 666.0  # an instance whose first value is this makes the batch raise
CRASH_MARK = 777.0  # ... this takes the process running the batch down (SIGSEGV)


class _Echo:
    """forward: per item, [sum of valid inputs, length, batch size]; optional sleep, failure."""

    def __init__(self, fast: bool = False) -> None:
        self.sleep_s = 0.0 if fast else float(os.environ.get("TEST_SLEEP_MS", "0")) / 1000
        # TEST_FORWARD_LOG: a file that gets one line (the batch size) per forward pass.
        self.forward_log = os.environ.get("TEST_FORWARD_LOG", "")
        # TEST_LEDGER: a file that gets the id of every item run (window[0][1], see tagged()).
        self.ledger = os.environ.get("TEST_LEDGER", "")
        self.per_item_s = float(os.environ.get("TEST_PER_ITEM_MS", "0")) / 1000
        self.hang_s = float(os.environ.get("TEST_HANG_MS", "0")) / 1000
        self.forwards: dict[float, int] = {}
        self.lock = threading.Lock()
        # TEST_EXIT_LOG: a file that gets the pid of each process holding one that exits as
        # a process does when it is stopped, not killed.
        if os.environ.get("TEST_EXIT_LOG"):
            atexit.register(_log_exit, os.environ["TEST_EXIT_LOG"])

    def to(self, device: Any) -> _Echo:
        time.sleep(float(os.environ.get("TEST_LOAD_SLEEP_MS", "0")) / 1000)  # a slow start
        return self

    def eval(self) -> _Echo:
        return self

    def __call__(self, x: Any, lengths: Any) -> Any:
        import torch

        batch = x.shape[0]
        if self.forward_log:
            with self.lock, open(self.forward_log, "a") as log:
                log.write(f"{batch}\n")
        if self.sleep_s or self.per_item_s:
            time.sleep(self.sleep_s + self.per_item_s * batch)
        if bool((x[:, 0, 0] == FAIL_MARK).any()):
            raise ValueError("test model asked to fail")
        if bool((x[:, 0, 0] == CRASH_MARK).any()):
            os.kill(os.getpid(), signal.SIGSEGV)
        if self.hang_s and bool((x[:, 0, 0] == -FAIL_MARK).any()):
            time.sleep(self.hang_s)
        if self.ledger:  # a completed forward pass, not one killed half-way
            ids = "".join(f"{int(v)}\n" for v in x[:, 0, 1].tolist())
            with self.lock, open(self.ledger, "a") as ledger:
                ledger.write(ids)
        total = x.sum(dim=(1, 2))
        return torch.stack([total, lengths.to(x.dtype),
                            torch.full_like(total, float(batch))], dim=1)


def _log_exit(path: str) -> None:
    with open(path, "a") as log:
        log.write(f"{os.getpid()}\n")


def echo(name: str) -> SequenceModel:
    return SequenceModel(_Echo(), name, channels=8, max_length=512, output_size=3)


def echo_named_itself() -> SequenceModel:
    """An adapter built with a name of its own: served under the attribute's or the
    configured one all the same."""
    return echo("its-own-name")


def sampled(name: str) -> Any:
    """A module whose answers are draws (dropout kept on, say): it says so."""
    import torch

    class Draws(torch.nn.Module):
        vega_deterministic = False

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1) + torch.rand(x.shape[0], 8)

    return Draws()


def echo_fast(name: str) -> SequenceModel:
    """``echo`` without TEST_SLEEP_MS and its forward log: a fallback for it."""
    model = _Echo(fast=True)
    model.forward_log = ""
    return SequenceModel(model, name, channels=8, max_length=512, output_size=3)


def forwarded(path: str) -> int:
    """Items run through the model so far, from a TEST_FORWARD_LOG file."""
    try:
        with open(path) as log:
            return sum(int(line) for line in log if line.strip())
    except FileNotFoundError:
        return 0


def window(length: int, value: float = 0.5) -> list[list[float]]:
    """A valid instance for the test and sensor models."""
    rows: list[list[float]] = np.full((length, 8), value, dtype=np.float32).tolist()
    return rows


def tagged(item_id: int, length: int = 16, value: float = 0.5) -> list[list[float]]:
    """A window that carries ``item_id`` (in row 0, channel 1) into a TEST_LEDGER."""
    rows = window(length, value)
    rows[0][1] = float(item_id)
    return rows


def ledger(path: str) -> list[int]:
    """Ids of every item the model ran, once per run, from a TEST_LEDGER file."""
    try:
        with open(path) as lines:
            return [int(line) for line in lines if line.strip()]
    except FileNotFoundError:
        return []


def encoder(name: str) -> SequenceModel:
    """An ordinary eager module, as a user brings one: the PatchTST-like encoder at width
    128 (6 layers, ~0.8 M parameters), not compiled to TorchScript."""
    from vega.models.sensor import build_module

    return SequenceModel(build_module(width=128, layers=6, heads=4, seed=2), name,
                         channels=8, max_length=512, output_size=4)


def crashing_encoder(name: str) -> Any:
    """``encoder``'s eager module, bare (as a user's own), taking its process down on a
    window whose first value is CRASH_MARK, as a native bug on one input would."""
    import torch

    from vega.models.sensor import build_module

    class Crashing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = build_module(width=128, layers=6, heads=4, seed=2)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            if bool((x[:, 0, 0] == CRASH_MARK).any()):
                os.kill(os.getpid(), signal.SIGSEGV)
            out: torch.Tensor = self.inner(x, lengths)
            return out

    return Crashing()


def encoder_small(name: str) -> SequenceModel:
    """``encoder`` at width 32 and 2 layers: the same code, quick to compile (vega export)."""
    from vega.models.sensor import build_module

    return SequenceModel(build_module(width=32, layers=2, heads=2, seed=4), name,
                         channels=8, max_length=512, output_size=4)


def encoder_wide(name: str) -> SequenceModel:
    """``encoder`` at width 256 (the built-in's shape, ~3.2 M parameters), eager: a module
    whose own cost per item, not the HTTP path, bounds what a server on two cores serves."""
    from vega.models.sensor import build_module

    return SequenceModel(build_module(width=256, layers=6, heads=4, seed=3), name,
                         channels=8, max_length=512, output_size=4)



def _per_step_module(per_patch: bool = False, width: int = 3) -> Any:
    """A user's per-timestep labeller, an eager module: [B, L, 8] -> [B, L, width]. Each step's
    output reads that step and the one before, so the rows past a window's length in a
    padded batch answer only the padding. ``per_patch``: one row per 8 steps instead."""
    import torch

    class PerStep(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, width)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            before = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
            steps: torch.Tensor = self.linear(x) + self.linear(before)
            return steps[:, ::8] if per_patch else steps

    generator_state = torch.random.get_rng_state()
    torch.manual_seed(5)
    try:
        return PerStep().eval()
    finally:
        torch.random.set_rng_state(generator_state)


def wide_steps(name: str) -> SequenceModel:
    """24 values a step from 8: a full batch's answer is three times its input."""
    return SequenceModel(_per_step_module(width=24), name, channels=8, max_length=512)


def per_step(name: str) -> SequenceModel:
    return SequenceModel(_per_step_module(), name, channels=8, max_length=512)


def per_patch(name: str) -> SequenceModel:
    return SequenceModel(_per_step_module(per_patch=True), name, channels=8, max_length=512)


def window_sum(name: str) -> SequenceModel:
    """One number per window (an output of shape [B]): the sum of its valid values."""
    import torch

    class Sum(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=(1, 2))

    return SequenceModel(Sum(), name, channels=8, max_length=512)


def short_window_sum(name: str) -> SequenceModel:
    """``window_sum`` for windows of at most 100 steps."""
    return SequenceModel(window_sum(name).module, name, channels=8, max_length=100)


# Bare modules, as a user's factory returns them (no adapter): Vega fits what it can.

def no_lengths(name: str) -> Any:
    """``forward(x)`` only, as a module written for one window length is: twice the mean
    over every step, the padding's too."""
    import torch

    class Mean(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x.mean(dim=1)

    return Mean()


def patches(name: str) -> Any:
    """A patch model that needs a whole patch: patches of 8 steps, no padding, so a window
    of fewer steps fails, as its ``vega_min_length`` says; the mean over its whole patches."""
    import torch

    class Patches(torch.nn.Module):
        vega_min_length = 8
        vega_max_length = 256

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(8)
            self.patch = torch.nn.Conv1d(8, 4, kernel_size=8, stride=8)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            if x.shape[1] < 8:
                raise ValueError(f"a window of {x.shape[1]} steps holds no whole patch")
            patches = self.patch(x.transpose(1, 2))  # [B, 4, steps // 8]
            whole = lengths // 8
            mask = torch.arange(patches.shape[-1]) < whole[:, None]
            out: torch.Tensor = (patches * mask[:, None]).sum(-1) / whole[:, None]
            return out

    return Patches().eval()


def loud(name: str) -> Any:
    """Raises on a window marked FAIL_MARK with a message quoting 200 kB of it, as a
    ``ValueError(f"bad input: {x.tolist()}")`` does; else the mean of each channel."""
    import torch

    class Loud(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            if bool((x[:, 0, 0] == FAIL_MARK).any()):
                raise ValueError("bad input: " + "0.5, " * 40_000)
            return x.mean(dim=1)

    return Loud()


def positions_of_100(name: str) -> Any:
    """Learned positions for 100 steps, and no ``vega_max_length`` saying so: windows past
    100 steps fail (the load checks run shorter ones; warm-up's 128-step bucket does not)."""
    import torch

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.positions = torch.nn.Parameter(torch.zeros(100, 8))

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            placed: torch.Tensor = x + self.positions[: x.shape[1]]
            return placed.sum(dim=1)

    return Positions()


def patch_means(name: str) -> Any:
    """A fallback for ``patches``: its answer's shape ([B, 4]) for windows of any length."""
    return _linear(8, 4, mean=True)


def whole_patches_of_16(name: str) -> Any:
    """``patches`` for windows of at least 16 steps."""
    module = patches(name)
    module.vega_min_length = 16
    return module


def float64(name: str) -> Any:
    """float64 weights: the mean of each channel's valid steps, scaled by 0.5..2."""
    import torch

    class Weighted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 8, dtype=torch.float64))

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            assert x.dtype == torch.float64, x.dtype  # cast to the weights' type first
            return x.sum(dim=1) / lengths[:, None].to(x.dtype) * self.scale

    return Weighted()


def three_channels(name: str) -> Any:
    """Steps of 3 channels, without the ``vega_channels`` attribute that would say so."""
    return _linear(3, 2)


def _linear(channels: int, width: int, mean: bool = False) -> Any:
    """Each step mapped linearly to ``width`` values, summed over the window (or averaged)."""
    import torch

    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(channels, width)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            summed: torch.Tensor = self.linear(x).sum(dim=1)
            return summed / lengths[:, None] if mean else summed

    return Linear()


def spread_scaled(name: str) -> Any:
    """Each channel's largest valid step above its mean, over its spread (scaling as RevIN
    does, without an epsilon): a window constant in a channel answers NaN there."""
    import torch

    class SpreadScaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            valid = (torch.arange(x.shape[1])[None, :] < lengths[:, None])[..., None]
            n = lengths[:, None].to(x.dtype)
            mean = (x * valid).sum(dim=1) / n
            spread = (((x - mean[:, None]) * valid) ** 2).sum(dim=1).div(n).sqrt()
            top = x.masked_fill(~valid, float("-inf")).amax(dim=1)
            scaled: torch.Tensor = (top - mean) / spread
            return scaled

    return SpreadScaled()


def torch_threads(name: str) -> Any:
    """Answers, for each window, the intra-op threads torch runs it on."""
    import torch

    class Threads(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return torch.full((x.shape[0], 1), float(torch.get_num_threads()))

    return Threads()


def redeployed(name: str) -> Any:
    """The mean of each channel's valid steps, scaled by weights drawn from TEST_SEED (a
    redeploy with new weights) and named TEST_VERSION (``vega_version``) if set."""
    import torch

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            seed = torch.Generator().manual_seed(int(os.environ.get("TEST_SEED", "0")))
            self.scale = torch.nn.Parameter(torch.rand(8, generator=seed))

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1) / lengths[:, None].to(x.dtype) * self.scale

    module = Scaled()
    if "TEST_VERSION" in os.environ:
        module.vega_version = os.environ["TEST_VERSION"]  # type: ignore[assignment]
    return module


def scale_not_lengths(name: str) -> Any:
    """``forward(x, scale=1.0)``: a second parameter that is not the lengths, which Vega
    passes there all the same; it fails only on a batch of more than one window."""
    import torch

    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: Any = 1.0) -> torch.Tensor:
            scaled: torch.Tensor = x.mean(dim=1) * scale
            return scaled

    return Scaled()


def heavy(name: str) -> Any:
    """256 MB of weights (zeros, written: resident) that answer the mean of each window."""
    import torch

    class Heavy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = torch.nn.Parameter(torch.full((64, 1024, 1024), 0.0))

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=1) + self.weights[0, 0, :8]

    return Heavy()


def drawn(name: str) -> Any:
    """A linear layer drawn without a seed: other weights in every process that builds it."""
    import torch

    class Drawn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 2)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            answer: torch.Tensor = self.linear(x.mean(dim=1))
            return answer

    return Drawn()


def lazy(name: str) -> Any:
    """A linear layer whose input size is found at its first forward (``LazyLinear``):
    its parameters hold no values as built."""
    import torch

    class Lazy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.LazyLinear(2)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            answer: torch.Tensor = self.linear(x.sum(dim=1) / lengths[:, None])
            return answer

    return Lazy()


def quantized(name: str) -> Any:
    """``_linear``'s mean, drawn from TEST_SEED, its layer quantized dynamically to int8 (as
    for a CPU): packed weights and a dtype in its state, not plain tensors."""
    import warnings

    import torch

    torch.manual_seed(int(os.environ.get("TEST_SEED", "0")))
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors
        warnings.simplefilter("ignore")
        quantize = torch.ao.quantization.quantize_dynamic
        return quantize(_linear(8, 2, mean=True), {torch.nn.Linear},  # type: ignore[no-untyped-call]
                        dtype=torch.qint8)
