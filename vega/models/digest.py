"""What a model's answers depend on besides their input, as one string: its identity.

Peers run each other's batches, and the response cache answers, only for the same
identity (docs/cluster.md, docs/pressure.md).
"""

from __future__ import annotations

import inspect
import os
import re
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vega.models.base import ModelAdapter

_IDENTITIES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # in a default repr: differs per process


def identity(adapter: ModelAdapter) -> str:
    """Its version and, where the adapter can tell (``weights_digest()``), its weights and
    code. Hashed once per adapter: the response cache and the overflow channel both ask,
    and the weights may be gigabytes."""
    known = _IDENTITIES.get(adapter)
    if known is None:
        weights = getattr(adapter, "weights_digest", None)
        digest = weights() if weights is not None else ""
        known = _IDENTITIES[adapter] = f"{adapter.version}:{digest}" if digest \
            else adapter.version
    return known


def adopt(adapter: ModelAdapter, known: str) -> None:
    """Take ``known`` as the model's identity: that of the copy a model process built."""
    _IDENTITIES[adapter] = known


def state_bytes(name: str, value: Any) -> Iterator[bytes]:
    """What one ``state_dict`` entry holds, as bytes: a tensor's type, shape and values.
    Not every entry is a plain tensor: a lazy module's parameters have no values until its
    first forward, a dynamically quantized layer holds a dtype and a tuple of tensors, some
    of them quantized, and extra state may be any value (its repr)."""
    import torch

    if isinstance(value, (tuple, list)):
        for index, part in enumerate(value):
            yield from state_bytes(f"{name}.{index}", part)
        return
    # Extra state the same in two processes must hash the same: a set's or a dict's order
    # may differ between them (string hashes are salted per process), as may an address.
    if isinstance(value, dict):
        for key in sorted(value, key=repr):
            yield from state_bytes(f"{name}[{key!r}]", value[key])
        return
    if isinstance(value, (set, frozenset)):
        yield f"{name}={sorted(map(repr, value))!r};".encode()
        return
    if not isinstance(value, torch.Tensor):
        yield f"{name}={_ADDRESS.sub('', repr(value))};".encode()
        return
    if torch.nn.parameter.is_lazy(value):
        yield f"{name}:uninitialized;".encode()
        return
    if value.is_quantized:  # its stored integers, scaled: the values it computes with
        value = value.dequantize()
    data = value.detach().cpu().contiguous().reshape(-1)
    yield f"{name}:{data.dtype}:{tuple(value.shape)};".encode()
    yield data.view(torch.uint8).numpy().data


def code_of(module: Any) -> list[bytes]:
    """What a module's forward passes run besides torch itself: the source file of each
    of its modules' classes, or a TorchScript module's own code (no file to read)."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    codes: list[bytes] = []
    read: set[str] = set()
    for part in module.modules():
        if isinstance(part, torch.jit.ScriptModule):
            try:
                codes.append(str(part.code).encode())
            except (AttributeError, RuntimeError):  # a module with no forward of its own
                pass
            continue
        try:
            path = inspect.getsourcefile(type(part))
        except (TypeError, OSError):  # defined where no file tells (built at run time, a REPL)
            continue
        if path and path not in read and not path.startswith(torch_dir + os.sep):
            read.add(path)
            try:
                with open(path, "rb") as source:
                    codes.append(source.read())
            except OSError:
                pass
    return codes
