"""The model adapter contract, and the adapter for torch modules over sensor windows.

An adapter has two halves. ``decode`` runs on the event loop for every instance, so
it only validates and converts (cheap, no torch). ``run`` runs in an executor
thread for a whole batch: collate and pad, forward, split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from vega.errors import VegaError, invalid_input
from vega.models.digest import code_of, identity, state_bytes
from vega.models.values import all_finite, finite_float32, kind_name

log = logging.getLogger("vega.models")


@dataclass(frozen=True)
class TensorSpec:
    """Metadata of one input or output, per instance (no batch dimension)."""

    name: str
    datatype: str  # Open Inference Protocol name: FP32, INT64, BYTES, ...
    shape: tuple[int, ...]  # -1 where the size varies
    accepts: tuple[str, ...] = ()  # further datatypes decode() converts from

    def takes(self, datatype: str) -> bool:
        return datatype == self.datatype or datatype in self.accepts


@runtime_checkable
class ModelAdapter(Protocol):
    name: str
    version: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_length: int
    deterministic: bool

    def load(self, device: str) -> None:
        """Move weights to ``device``; called once, in the executor thread."""

    def decode(self, instance: Any) -> tuple[Any, int]:
        """Validate one instance; return (sample, length). Raise VegaError(invalid_input).

        An instance is what a /v1 JSON body holds, or, from the v2 routes, a
        numpy array (one input) or a dict of numpy arrays by input name (several).
        """

    def run(self, samples: list[Any], pad_to: int) -> list[Any]:
        """Forward a batch padded to ``pad_to``; one output per sample, in order."""

    def example(self, length: int) -> Any:
        """A decoded sample of ``length`` for warm-up and profiling."""


def min_length(adapter: ModelAdapter) -> int:
    """The fewest steps a window may have: an adapter's optional ``min_length``, else 1."""
    return int(getattr(adapter, "min_length", 1))


def decode_all(adapter: ModelAdapter, instances: list[Any]) -> list[tuple[Any, int]]:
    """Each instance decoded, in order; one of several refused says which (from 0)."""
    decoded = []
    try:
        for instance in instances:
            decoded.append(adapter.decode(instance))
    except VegaError as error:
        if len(instances) == 1:
            raise
        raise VegaError(error.code, f"instance {len(decoded)}: {error.message}") from None
    return decoded


class SequenceModel:
    """A torch module ``forward(x[B, L, C] float32, lengths[B] int64) -> [B, ...]``: one
    output per window, or one row per timestep (``[B, L, ...]``, found at ``load``), which
    is cut back to each window's own length.

    Instances are windows of L timesteps by C channels (min_length <= L <= max_length),
    given as nested lists of finite numbers.
    """

    deterministic = True
    # Where the inputs' shape comes from, for a module that cannot take them.
    inputs_hint = " (a module's `vega_channels` attribute sets the channels a step)"

    def __init__(self, module: Any, name: str, *, channels: int, max_length: int,
                 min_length: int = 1, version: str = "1", output_size: int = -1,
                 script: bool = False) -> None:
        self.module = module
        self.script = script
        self.name = name
        self.version = version
        self.channels = channels
        self.max_length = max_length
        self.min_length = min_length
        self.inputs: tuple[TensorSpec, ...] = (
            TensorSpec("INPUT__0", "FP32", (-1, channels), accepts=("FP16", "FP64")),)
        self.outputs: tuple[TensorSpec, ...] = (
            TensorSpec("OUTPUT__0", "FP32", (output_size,)),)
        self._device = "cpu"
        self.per_step = False  # one output row per timestep ([B, L, ...]), cut to each length

    def load(self, device: str) -> None:
        import torch

        self._device = device
        self.module = self.module.to(torch.device(device)).eval()
        if self.script:
            identity(self)  # of the module as built: scripted, its code hashes otherwise
            self.module = _scripted(self.module, self.name)
        if isinstance(self.module, torch.jit.ScriptModule):
            # TorchScript's profiling executor records the first call and compiles on the
            # second: ~300 ms each here, 0.5 ms after. Paid now, no timed pass counts it
            # (warm-up seeding the batch-time predictor, vega profile, bench ceilings).
            length = max(self.min_length, min(16, self.max_length))
            for _ in range(2):
                self.try_window(self.example(length))
        self.inspect_outputs()

    def try_window(self, window: np.ndarray) -> np.ndarray:
        """``window`` alone through the module at load: a module that cannot take what
        Vega gives it says so, with what it was given."""
        return self.try_batch([window])

    def try_batch(self, windows: list[np.ndarray]) -> np.ndarray:
        """``windows`` as one batch, padded to the longest, through the module at load."""
        length = max(window.shape[0] for window in windows)
        try:
            return self._forward(windows, length)
        except NotATensor:
            raise
        except Exception as error:
            lengths = ", ".join(str(window.shape[0]) for window in windows)
            raise RuntimeError(
                f"model {self.name!r} failed on an example batch: x [{len(windows)}, "
                f"{length}, {self.channels}] float32, lengths [{len(windows)}] int64 "
                f"({lengths}){self.inputs_hint}: {type(error).__name__}: {error}") from error

    def inspect_outputs(self) -> None:
        """Once loaded, from a window run alone and then batched with a longer one: whether
        the module answers one row per step (and the output's shape, for the metadata),
        and whether batching moves a window's answer."""
        lengths = self.probe_lengths()
        if lengths is None:  # windows of one length only: nothing is padded, nothing to tell
            shape = tuple(int(n) for n in self.try_window(self.example(self.max_length)).shape)
            self.outputs = tuple(dataclasses.replace(spec, shape=shape[1:])
                                 for spec in self.outputs)
            return
        short, long_ = lengths
        window = self.example(short)
        alone = self.try_window(window)[0]
        batched = self.try_batch([window, self.example(long_)])[0]
        self.per_step = self._layout(lengths, alone.shape, batched.shape)
        self._check_batching(window, alone, batched[:short] if self.per_step else batched,
                             lengths)
        self._check_shortest()

    def _check_shortest(self) -> None:
        """Warn when the shortest window accepted fails alone: its callers get 500s, and
        batched with longer windows it is run on their padding instead."""
        shortest = self.min_length
        try:
            self.run([self.example(shortest)], shortest)  # as served: a package pads it
        except Exception as error:
            log.warning("model %r: a %d-step window fails alone (%s: %s), though windows of "
                        "%d..%d steps are accepted: such requests get 500 model_error, or an "
                        "answer read off the padding when batched with longer windows. Set "
                        "the module's vega_min_length to the fewest steps it takes (windows "
                        "shorter are then refused 422; in __init__ for TorchScript), or take "
                        "them",
                        self.name, shortest, type(error).__name__, error, shortest,
                        self.max_length)

    def decode(self, instance: Any) -> tuple[Any, int]:
        if isinstance(instance, np.ndarray):
            return self.check_array(instance)
        packed = self._packed(instance)
        if packed is not None:
            return packed, packed.shape[0]
        if not isinstance(instance, list) or not instance:
            raise invalid_input(f"expected a list of {self.lengths_taken} timesteps, "
                                f"each a list of {self.channels} numbers")
        try:
            array = np.asarray(instance)
        except (ValueError, TypeError, OverflowError):
            raise invalid_input("instance is ragged or holds non-numbers") from None
        return self.check_array(array)

    def _packed(self, instance: Any) -> np.ndarray | None:
        """A valid window of lists as float32, packed from its numbers in one C pass; None
        where this cannot tell, and ``np.asarray`` then decides and words the refusal.

        ``np.asarray`` walks the nested lists twice (shape and type, then values): twice
        the loop's time of a ``struct`` pack, which itself refuses anything but numbers
        (strings, nulls, lists, values past float32). Both read a boolean among numbers
        as a number; an all-boolean window, which numpy refuses, starts with one, so
        such a window goes numpy's way.
        """
        if type(instance) is not list or not self.min_length <= len(instance) <= self.max_length:
            return None
        first = instance[0]
        if type(first) is not list or not first or type(first[0]) is bool:
            return None
        try:
            if set(map(len, instance)) != {self.channels}:
                return None
            values: list[Any] = []
            for row in instance:  # extending a list costs less than chain's item by item
                values += row
            window = np.empty((len(instance), self.channels), dtype=np.float32)
            struct.pack_into(f"{window.size}f", window.data, 0, *values)
        except (TypeError, struct.error, OverflowError):
            return None
        return window if all_finite(window) else None

    @property
    def lengths_taken(self) -> str:
        """The window lengths accepted, as refusals word them."""
        return f"{self.min_length}..{self.max_length}"

    def check_array(self, array: np.ndarray) -> tuple[np.ndarray, int]:
        """Validate an already-built array (the binary tensor path skips JSON)."""
        if array.dtype.kind not in "iuf":
            raise invalid_input(f"expected numbers, got {kind_name(array)}")
        if array.ndim == 1 and self.channels == 1:  # a univariate series, sent flat
            array = array[:, None]
        if array.ndim != 2 or array.shape[1] != self.channels:
            raise invalid_input(f"expected shape [L, {self.channels}], got {list(array.shape)}")
        length = array.shape[0]
        if not self.min_length <= length <= self.max_length:
            raise invalid_input(f"window length {length} outside {self.lengths_taken}")
        return finite_float32(array), length

    def weights_digest(self) -> str:
        """A digest of the module's parameters, buffers and code: new weights, or a new
        forward, under the same version are new answers (the response cache and the
        overflow channel key on it); "" for a callable that is not a torch module."""
        state = getattr(self.module, "state_dict", None)
        if state is None:
            return ""
        digest = hashlib.blake2b(digest_size=16)
        for name, value in state().items():
            for part in state_bytes(name, value):
                digest.update(part)
        for code in code_of(self.module):
            digest.update(code)
        return digest.hexdigest()

    def example(self, length: int) -> Any:
        rng = np.random.default_rng(length)
        return rng.standard_normal((length, self.channels)).astype(np.float32)

    def run(self, samples: list[Any], pad_to: int) -> list[Any]:
        result = self._forward(samples, pad_to)
        if result.shape[0] != len(samples):
            raise RuntimeError(f"model returned {result.shape[0]} rows for {len(samples)} inputs")
        if not self.per_step:
            return list(result)
        if result.ndim < 2 or result.shape[1] != pad_to:
            raise RuntimeError(f"model returned {result.shape[1:2]} steps for windows padded "
                               f"to {pad_to}")
        # A window's rows past its own length answer the padding, not the caller.
        return [result[row, : sample.shape[0]] for row, sample in enumerate(samples)]

    def _forward(self, samples: list[Any], pad_to: int) -> np.ndarray:
        """The module's output for ``samples`` padded to ``pad_to``, as one array."""
        import torch

        batch = np.zeros((len(samples), pad_to, self.channels), dtype=np.float32)
        lengths = np.empty(len(samples), dtype=np.int64)
        for row, sample in enumerate(samples):
            batch[row, : sample.shape[0]] = sample
            lengths[row] = sample.shape[0]
        # Each torch call from Python lets the event loop take the GIL, and this thread
        # then waits for it back; so on the CPU no call is made that would do nothing
        # (.to, .detach, .float, .cpu).
        x, lengths_t = torch.from_numpy(batch), torch.from_numpy(lengths)
        if self._device != "cpu":
            x, lengths_t = x.to(self._device), lengths_t.to(self._device)
        with torch.inference_mode():
            out = self.module(x, lengths_t)
        if not isinstance(out, torch.Tensor):
            raise NotATensor(f"model {self.name!r} returned a {type(out).__name__}, not a tensor: "
                            "a module answers one tensor [B, ...]; a model with several "
                            "outputs is a vega.models.ModelAdapter")
        if out.dim() == 0:  # `.squeeze()` of a [1, 1] answer, say: whose number is it?
            raise NotATensor(f"model {self.name!r} returned one number for a batch of "
                             f"{len(samples)}, not a tensor [B, ...] with a row per window "
                             "(`.squeeze()` drops the batch of one: squeeze(-1))")
        if out.requires_grad:  # a user module may hand back a parameter itself
            out = out.detach()
        if out.device.type != "cpu" or out.dtype != torch.float32:
            out = out.float().cpu()
        result: np.ndarray = out.numpy()
        return result

    def probe_lengths(self) -> tuple[int, int] | None:
        """Two window lengths a lone window can be run at, to tell how the output's shape
        follows the length (None: windows of one length only, nothing to tell)."""
        longer = min(max(32, self.min_length + 1), self.max_length)
        shorter = max(self.min_length, min(16, longer - 1))
        return (shorter, longer) if shorter < longer else None

    def _layout(self, lengths: tuple[int, int], short_shape: tuple[int, ...],
                long_shape: tuple[int, ...]) -> bool:
        """Whether a window's output is one row per step, from its shape at two lengths
        (setting the outputs' shape): padded to batch it, such an output holds rows for the
        padding, which ``run`` cuts off. One whose shape follows the length in any other
        way cannot be cut back, so it is refused."""
        shapes = [tuple(int(n) for n in shape) for shape in (short_shape, long_shape)]
        per_step = shapes[0] != shapes[1]
        if not per_step or (all(shape[:1] == (n,) for shape, n in zip(shapes, lengths))
                            and shapes[0][1:] == shapes[1][1:]):
            # The metadata says what the module answers (-1: the window's length).
            shape = (-1, *shapes[0][1:]) if per_step else shapes[0]
            self.outputs = tuple(dataclasses.replace(spec, shape=shape) for spec in self.outputs)
            return per_step
        raise ValueError(
            f"model {self.name!r}: its output's shape changes with the window's length "
            f"({list(shapes[0])} at {lengths[0]} steps, {list(shapes[1])} at {lengths[1]}) but "
            "is not one row per step; windows are padded to be batched, and which rows of such "
            "an output answer the padding cannot be told. Return one output per window "
            "([B, ...]) or one row per step ([B, L, ...]).")

    def _check_batching(self, window: np.ndarray, alone: np.ndarray, batched: np.ndarray,
                        lengths: tuple[int, int]) -> None:
        """Warn when ``window``'s answer moves once it shares a batch: padded to a longer
        window's length, the module reads the steps past ``lengths``; or it mixes the
        windows of a batch. Either way, what a caller gets depends on its batch mates."""
        short, long_ = lengths
        if not np.isfinite(alone).all():  # nothing to compare, and the padding is not why
            log.warning("model %r answers NaN or infinity for a plain %d-step window at "
                        "load: every request it answers so gets 500 model_error",
                        self.name, short)
            return
        scale = float(np.max(np.abs(alone), initial=0.0))
        allowed = self._rounding() * max(1.0, scale)
        moved = _moved(alone, batched)
        if moved <= allowed:
            return
        padded = self._forward([window], long_)[0]  # alone, but padded: which moved it?
        if _moved(alone, padded[:short] if self.per_step else padded) <= allowed:
            why = "it mixes the windows of a batch (statistics over the batch?)"
        elif getattr(self.module, "takes_lengths", True):
            why = "it reads the padding past `lengths` (mask those steps)"
        else:
            why = ("its forward takes no `lengths`, so it reads the padding: take them and "
                   "mask the steps past each, or send windows of one length")
        if not np.isfinite(batched).all():  # moved by "nan" would say nothing
            log.warning("model %r answers a %d-step window with NaN or infinity (500 "
                        "model_error) when batched with a %d-step window, finite values "
                        "alone, so what a caller gets depends on its batch mates: %s",
                        self.name, short, long_, why)
            return
        log.warning("model %r: a %d-step window's answer moved by up to %.2g (its largest "
                    "value: %.2g) when batched with a %d-step window, so what a caller gets "
                    "depends on its batch mates: %s", self.name, short, moved, scale, long_, why)

    def _rounding(self) -> float:
        """How far a window's answer may move with its batch's shape from rounding alone: a
        module computing in float16 or bfloat16 (3 and 2 significant digits) rounds its
        sums differently at another batch shape, in float32 by ~1e-7."""
        import torch

        from vega.models.fitted import weights_dtype

        module = self.module
        dtype = weights_dtype(module) if isinstance(module, torch.nn.Module) else None
        return 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5


class NotATensor(TypeError):
    """A module answered something other than one tensor."""


def _moved(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b), initial=0.0))


def holds_the_gil(adapter: Any) -> bool:
    """True for a model whose forward pass would hold the GIL against the event loop: a
    torch module that runs as Python (not TorchScript) once loaded, or an adapter that
    says so (``holds_gil``: a compiled package runs a whole pass in one call)."""
    import torch

    if getattr(adapter, "holds_gil", False):
        return True
    module = getattr(adapter, "module", None)
    return (isinstance(adapter, SequenceModel) and not adapter.script
            and isinstance(module, torch.nn.Module)
            and not isinstance(module, torch.jit.ScriptModule))


def _scripted(module: Any, name: str) -> Any:
    """The module compiled to TorchScript, or as it was if it cannot be.

    An eager forward pass is hundreds of small Python-level calls, each taking the GIL
    back from the event loop thread: measured here, a 7 ms batch took 140 ms while the
    loop was busy. TorchScript runs the forward in C++ without the GIL (24 ms under the
    same load). It is deprecated as of torch 2.13, hence the silenced warning; torch.compile
    needs a compiler toolchain at run time, which a serving host may not have.
    """
    import torch

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            return torch.jit.script(module)
    except Exception as error:  # torch raises many types for code it cannot compile
        log.warning("model %s runs eagerly; TorchScript failed: %s", name, error)
        return module


def release(adapter: ModelAdapter) -> None:
    """Let go of the weights of a model that model processes run (each builds its own):
    the serving process keeps its metadata, and its identity, hashed first."""
    identity(adapter)
    if isinstance(adapter, SequenceModel):
        adapter.module = None
