"""Tensor codec of the Open Inference Protocol: JSON ``data`` and the binary extension.

A tensor arrives either as JSON ``data`` (flat or nested, row-major) or as raw
little-endian bytes after the JSON header of the body (the binary tensor data
extension), ``binary_data_size`` bytes per input, in input order. BYTES elements
are each a 4-byte little-endian length and that many bytes, in both forms of the
binary encoding. Everything here turns bytes or lists into numpy arrays and back;
it knows nothing of models, HTTP or the runtime.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from vega.errors import VegaError, invalid_input

# Datatype name -> numpy dtype (little-endian, as the wire carries it).
DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
# What numpy kinds JSON ``data`` may hold for each family of datatypes.
_JSON_KINDS = {"BOOL": "b", "UINT": "iu", "INT": "iu", "FP": "iuf"}
_LENGTH = struct.Struct("<I")


def element_count(shape: list[int]) -> int:
    return math.prod(shape)


def check_datatype(datatype: Any, what: str) -> str:
    if not isinstance(datatype, str) or datatype not in DTYPES:
        raise invalid_input(f"{what}: datatype {datatype!r} is not supported; expected one of "
                            f"{', '.join(DTYPES)}")
    return datatype


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """(JSON header, binary part) by ``Inference-Header-Content-Length``."""
    if header_length is None:
        return body, memoryview(b"")
    digits = header_length.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) > len(body):
        raise VegaError("invalid_json", f"Inference-Header-Content-Length {header_length!r} "
                        f"is not a length within the {len(body)}-byte body")
    size = int(digits)
    return body[:size], memoryview(body)[size:]


def from_binary(datatype: str, shape: list[int], raw: memoryview, what: str) -> np.ndarray:
    """An array of ``shape`` over ``raw`` (no copy for numbers; read-only)."""
    count = element_count(shape)
    if datatype == "BYTES":
        return _bytes_elements(raw, count, what).reshape(shape)
    dtype = DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise invalid_input(f"{what}: {len(raw)} bytes of {datatype} data, shape {shape} "
                            f"needs {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _bytes_elements(raw: memoryview, count: int, what: str) -> np.ndarray:
    if 4 * count > len(raw):  # before allocating: the shape alone may be huge
        raise invalid_input(f"{what}: {len(raw)} bytes cannot hold {count} BYTES elements")
    out = np.empty(count, dtype=object)
    offset = 0
    for index in range(count):
        if offset + 4 > len(raw):
            raise invalid_input(f"{what}: BYTES data ends inside element {index}'s length")
        (size,) = _LENGTH.unpack_from(raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise invalid_input(f"{what}: BYTES element {index} runs past the data")
        out[index] = bytes(raw[offset:offset + size])
        offset += size
    if offset != len(raw):
        raise invalid_input(f"{what}: {len(raw) - offset} bytes left after {count} BYTES "
                            "elements")
    return out


def from_json(datatype: str, shape: list[int], data: Any, what: str) -> np.ndarray:
    """An array of ``shape`` from JSON ``data``, flat or nested; kinds checked, not coerced."""
    count = element_count(shape)
    try:
        array = np.asarray(data)
    except (ValueError, TypeError, OverflowError):
        raise invalid_input(f"{what}: data is ragged or holds mixed values") from None
    if array.size != count:
        raise invalid_input(f"{what}: data has {array.size} elements, shape {shape} "
                            f"needs {count}")
    if datatype == "BYTES":
        if count and array.dtype.kind != "U":
            raise invalid_input(f"{what}: BYTES data must be strings")
        out = np.empty(count, dtype=object)
        out[:] = [text.encode() for text in array.ravel().tolist()]
        return out.reshape(shape)
    family = datatype.rstrip("0123456789")
    if count and array.dtype.kind not in _JSON_KINDS[family]:
        raise invalid_input(f"{what}: data holds {_kind(array)}, not {datatype} values")
    dtype = DTYPES[datatype]
    if family in ("INT", "UINT") and count:
        info = np.iinfo(dtype)
        if array.min() < info.min or array.max() > info.max:
            raise invalid_input(f"{what}: a value is out of range for {datatype}")
    with np.errstate(over="ignore"):
        return array.astype(dtype, copy=False).reshape(shape)


def _kind(array: np.ndarray) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "fractional numbers",
            "U": "strings"}.get(array.dtype.kind, "mixed values")


def to_binary(array: np.ndarray, datatype: str) -> bytes:
    """Raw little-endian bytes of ``array`` as ``datatype`` (BYTES: length-prefixed)."""
    if datatype == "BYTES":
        parts = []
        for element in array.ravel().tolist():
            value = element if isinstance(element, bytes) else str(element).encode()
            parts.append(_LENGTH.pack(len(value)))
            parts.append(value)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=DTYPES[datatype]).tobytes()


def to_json(array: np.ndarray, datatype: str) -> Any:
    """Flat row-major ``data`` for a JSON response (orjson writes numpy arrays itself)."""
    if datatype == "BYTES":
        return [e.decode(errors="replace") if isinstance(e, bytes) else str(e)
                for e in array.ravel().tolist()]
    if datatype == "FP16":  # orjson has no float16: widen, the values are the same
        return np.ascontiguousarray(array, dtype=np.float32).ravel()
    return np.ascontiguousarray(array, dtype=DTYPES[datatype]).ravel()


def as_datatype(value: Any, datatype: str) -> np.ndarray:
    """A model's output as ``datatype``."""
    if datatype == "BYTES":
        return np.asarray(value, dtype=object)
    return np.asarray(value, dtype=DTYPES[datatype])
