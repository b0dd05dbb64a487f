"""Arrays in a shared-memory slot: what parent and child both write and read.

A slot holds a batch's samples (or, on the way back, its outputs): arrays of one shape
as one stacked block (read back as rows of a single array), others one after another,
each aligned. The header sent over the pipe carries their dtype and shapes. Headers
are orjson, never pickle: the child and the parent trust only their own layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

ALIGN = 64


class SlotOverflow(Exception):
    """The arrays do not fit in the slot."""


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def pack(buffer: memoryview, arrays: Sequence[np.ndarray]) -> dict[str, Any]:
    """Write ``arrays`` (one dtype) into ``buffer``; return the header that reads them back."""
    if not arrays:
        return {"dtype": "float32", "shapes": []}
    dtype = arrays[0].dtype
    if dtype.kind not in "biuf":
        raise TypeError(f"only numeric arrays cross to a model process, not {dtype}")
    shape = arrays[0].shape
    if all(array.shape == shape for array in arrays):
        block = (len(arrays), *shape)
        if dtype.itemsize * math.prod(block) > len(buffer):
            raise SlotOverflow(f"{len(arrays)} arrays of {shape} do not fit in the slot")
        # One copy from C, where np.stack makes a Python-level call per array: this runs
        # between two forward passes of a model process, on caches the pass has emptied.
        np.copyto(np.ndarray(block, dtype=dtype, buffer=buffer), arrays, casting="same_kind")
        return {"dtype": dtype.str, "shape": list(shape), "count": len(arrays)}
    offset = 0
    placed = []
    for array in arrays:
        if array.dtype != dtype:
            raise TypeError(f"arrays of one batch must share a dtype: {dtype} and {array.dtype}")
        end = offset + array.nbytes
        if end > len(buffer):
            raise SlotOverflow(f"{end} bytes do not fit in a slot of {len(buffer)}")
        placed.append((offset, array))
        offset = _aligned(end)
    for start, array in placed:
        view = np.ndarray(array.shape, dtype=dtype, buffer=buffer, offset=start)
        view[...] = array
    return {"dtype": dtype.str, "shapes": [list(array.shape) for array in arrays]}


def unpack(buffer: memoryview | bytes, header: dict[str, Any], copy: bool) -> list[np.ndarray]:
    """The arrays a header describes; ``copy`` when the slot is about to be reused."""
    dtype = np.dtype(header["dtype"])
    if dtype.kind not in "biuf":
        raise TypeError(f"unexpected dtype {dtype} in a slot header")
    if "count" in header:
        block = (int(header["count"]), *(int(n) for n in header["shape"]))
        size = dtype.itemsize * math.prod(block)
        if size > len(buffer):
            raise SlotOverflow("slot header describes more than the slot holds")
        rows = np.frombuffer(buffer, dtype=dtype, count=size // dtype.itemsize).reshape(block)
        return list(rows.copy() if copy else rows)
    shapes = [tuple(int(n) for n in shape) for shape in header["shapes"]]
    if not shapes:
        return []
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]  # not np.prod: µs a call
    starts = []
    offset = 0
    for size in sizes:
        starts.append(offset)
        offset = _aligned(offset + size)
    if starts[-1] + sizes[-1] > len(buffer):
        raise SlotOverflow("slot header describes more than the slot holds")
    if copy:  # one copy of the used span, then views into it
        span = np.frombuffer(buffer, dtype=np.uint8, count=starts[-1] + sizes[-1]).copy()
        return [span[start: start + size].view(dtype).reshape(shape)
                for start, size, shape in zip(starts, sizes, shapes)]
    return [np.ndarray(shape, dtype=dtype, buffer=buffer, offset=start)
            for start, shape in zip(starts, shapes)]


def nbytes(header: dict[str, Any]) -> int:
    """Bytes the arrays of ``header`` take in a slot."""
    dtype = np.dtype(header["dtype"])
    if "count" in header:
        shape = [int(n) for n in header["shape"]]
        return int(dtype.itemsize) * int(header["count"]) * math.prod(shape)
    offset = 0
    for shape in header["shapes"]:
        offset = _aligned(offset + math.prod(int(n) for n in shape) * dtype.itemsize)
    return offset
