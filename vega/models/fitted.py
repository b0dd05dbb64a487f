"""A user's torch module fitted to the call Vega makes: ``module(x, lengths)``, x float32.

Most modules written for a fixed window take only ``x``, some take ``lengths`` by keyword
only, and a module may hold its weights in float16, bfloat16 or float64. Such a module is
wrapped rather than refused: its ``lengths`` are dropped or passed by name, its input cast
to its weights' type. Anything else about the call (a different argument, another number
of channels) is the module's to declare.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class Fitted(torch.nn.Module):
    """``inner`` called as Vega calls a module. ``takes_lengths``: whether it is given them
    (without them, a window padded to a longer batch mate's length is read with its zeros)."""

    def __init__(self, inner: torch.nn.Module, takes_lengths: bool,
                 dtype: torch.dtype | None, by_name: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.takes_lengths = takes_lengths
        self.dtype = dtype
        self.by_name = by_name  # ``forward(x, *, lengths)``

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> Any:
        if self.dtype is not None:
            x = x.to(self.dtype)
        if self.by_name:
            return self.inner(x, lengths=lengths)
        return self.inner(x, lengths) if self.takes_lengths else self.inner(x)


def fitted(module: Any) -> Any:
    """``module`` itself where it takes ``(x float32, lengths)``; else a ``Fitted`` around it."""
    if not isinstance(module, torch.nn.Module):
        return module
    by_name = positional_arguments(module) == 1 and lengths_by_name(module)
    takes_lengths = positional_arguments(module) != 1 or by_name
    dtype = weights_dtype(module)
    if takes_lengths and not by_name and dtype in (None, torch.float32):
        return module
    return Fitted(module, takes_lengths, None if dtype == torch.float32 else dtype, by_name)


def lengths_by_name(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward takes a keyword-only ``lengths``."""
    try:
        found = inspect.signature(_forward_of(module)).parameters.get("lengths")
    except (TypeError, ValueError):
        return False
    return found is not None and found.kind == inspect.Parameter.KEYWORD_ONLY


def positional_arguments(module: torch.nn.Module) -> int | None:
    """How many positional arguments ``module``'s forward takes (None: any number, or
    not known)."""
    if isinstance(module, torch.jit.ScriptModule):
        try:
            return len(getattr(module.forward, "schema").arguments) - 1  # less self
        except (AttributeError, RuntimeError):
            return None
    try:
        parameters = inspect.signature(_forward_of(module)).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in parameters]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(kind in (inspect.Parameter.POSITIONAL_ONLY,
                        inspect.Parameter.POSITIONAL_OR_KEYWORD) for kind in kinds)


def _forward_of(module: torch.nn.Module) -> Any:
    """The forward that ``module`` runs: a ``torch.compile``d module's own takes
    ``(*args, **kwargs)`` and hands them to its original's (``_orig_mod``)."""
    return getattr(module, "_orig_mod", module).forward


def weights_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The floating-point type of the module's first weight or buffer (None: it has none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return None
