"""A window's values, cast to float32 and checked finite on the event loop, in row blocks
small enough that numpy keeps the GIL."""

from __future__ import annotations

import math

import numpy as np

from vega.errors import invalid_input

# numpy lets go of the GIL for a loop over more than 500 elements. On the event loop each
# release hands the GIL to the executor thread and back: a window's cast and check done
# in one piece cost the loop up to a third of its CPU per request (docs/bench.md).
HELD_ELEMENTS = 500
_sum = np.add.reduce


def finite_float32(array: np.ndarray) -> np.ndarray:
    """A 2-D numeric ``array`` as float32, refused if any value is NaN, Inf or too large
    for float32; converted in row blocks small enough that numpy keeps the GIL."""
    out = array
    if array.dtype != np.float32:
        out = np.empty(array.shape, dtype=np.float32)
        with np.errstate(over="ignore"):  # a value too large becomes Inf, refused below
            for rows in _held_blocks(array):
                out[rows] = array[rows]
    if not all_finite(out):
        raise invalid_input("instance holds NaN, Inf or a number too large for float32")
    return out


def all_finite(array: np.ndarray) -> bool:
    """Whether a 2-D float32 ``array`` holds no NaN or Inf, summed in blocks that numpy
    keeps the GIL for: a float64 sum of float32 values is finite exactly when each is.

    The ufunc is called itself, in a plain loop: ``ndarray.sum``'s Python wrapper and a
    generator cost more than the sums.
    """
    if not array.flags.c_contiguous:  # flattening would copy it
        return all(math.isfinite(_sum(array[rows], axis=None, dtype=np.float64))
                   for rows in _held_blocks(array))
    flat = array.ravel()
    for start in range(0, flat.size, HELD_ELEMENTS):
        if not math.isfinite(_sum(flat[start:start + HELD_ELEMENTS], dtype=np.float64)):
            return False
    return True


def _held_blocks(array: np.ndarray) -> list[slice]:
    """Row slices of a 2-D ``array``, each of at most HELD_ELEMENTS values (one row at least)."""
    step = max(1, HELD_ELEMENTS // max(1, array.shape[1]))
    return [slice(start, start + step) for start in range(0, array.shape[0], step)]


def kind_name(array: np.ndarray) -> str:
    return {"b": "booleans", "U": "strings", "S": "bytes", "O": "mixed values"}.get(
        array.dtype.kind, str(array.dtype))
