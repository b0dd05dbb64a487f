"""The overflow wire format: stream entries for stolen batches and their replies.

An entry is three stream fields: ``v`` (format version), ``meta`` (orjson: who, what,
until when, and each array's dtype and shape) and ``data`` (the arrays' raw bytes,
concatenated in order). Nothing is ever unpickled; ``decode_*`` check every field
against the schema and raise ``WireError`` on anything unexpected, so a malformed or
hostile entry is refused before it reaches a model.

Deadlines cross hosts as wall-clock epoch milliseconds, because loop clocks differ
between processes. The origin converts its loop-clock deadline at send time; a thief
subtracts a clock-skew allowance (``VEGA_CLOCK_SKEW_MS``) before trusting it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import reprlib
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

VERSION = b"2"  # 2: an overflow entry names its model's identity
FIELDS = frozenset({b"v", b"meta", b"data"})
# Array dtypes allowed on the wire: numbers only, never objects.
DTYPES = frozenset({"float32", "float64", "float16", "int64", "int32", "int16", "int8",
                    "uint8", "bool"})
MAX_ITEMS = 4096
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 28  # one array's numbers: a shape past it is no batch of ours
MAX_ATTEMPTS = 100
_NODE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_BATCH = re.compile(r"[A-Za-z0-9_.:-]{1,160}")
_MODEL = re.compile(r"[^\x00-\x1f{}]{1,128}")
_IDENTITY = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
_SHOWN = reprlib.Repr()  # strings and lists cut short, nesting shown to a few levels


def wall_ms() -> int:
    """Wall-clock epoch milliseconds: how deadlines cross hosts."""
    return int(time.time() * 1000)


def default_node() -> str:
    """This process's name when VEGA_NODE_ID is unset: host-pid, in the form entries carry.
    A host's name may not fit it (a 63-character pod name and a pid are past 64
    characters): then cut, and a digest of the whole keeps two such hosts apart."""
    host, pid = socket.gethostname(), os.getpid()
    if _NODE.fullmatch(name := f"{host}-{pid}"):
        return name
    tail = f"-{hashlib.blake2b(host.encode(), digest_size=4).hexdigest()}-{pid}"
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", host)[:64 - len(tail)] + tail


class WireError(ValueError):
    """An entry does not match the schema; the message says which part."""


@dataclass(frozen=True)
class Overflow:
    """A batch handed to peers: its identity, deadline and samples."""

    origin: str  # node id of the process that holds the callers
    batch: str  # unique batch key, origin-scoped
    model: str
    identity: str  # its version and weights (vega.models.identity): a thief runs only its own
    deadline_ms: int  # absolute, wall-clock epoch milliseconds
    sent_ms: int  # wall clock at the origin's XADD
    attempt: int  # 1 on first hand-off, +1 per reclaim
    pad_to: int  # the longest length; a thief pads it as its batcher does (the same model's)
    lengths: tuple[int, ...]
    samples: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class Reply:
    """A thief's answer for a batch: outputs in item order, or one error for all."""

    batch: str
    node: str  # who ran it
    infer_ms: float
    outputs: tuple[Any, ...] = ()
    error_code: str = ""
    error_message: str = ""


# -- arrays --------------------------------------------------------------------------


def _pack(arrays: list[np.ndarray]) -> tuple[list[dict[str, Any]], bytes]:
    specs = []
    for array in arrays:
        if array.dtype.name not in DTYPES:
            raise WireError(f"dtype {array.dtype.name} cannot go on the wire")
        specs.append({"dtype": array.dtype.name, "shape": list(array.shape)})
    return specs, b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def _unpack(specs: Any, data: bytes, count: int) -> tuple[np.ndarray, ...]:
    if not isinstance(specs, list) or len(specs) != count:
        raise WireError(f"expected {count} array specs")
    arrays = []
    offset = 0
    for spec in specs:
        _keys(spec, {"dtype", "shape"}, "array spec")
        dtype, shape = spec["dtype"], spec["shape"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise WireError(f"dtype {_brief(dtype)} not allowed")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or \
                not all(_is_int(n) and 0 <= n <= 1 << 24 for n in shape):
            raise WireError(f"bad shape {_brief(shape)}")
        # Python ints: numpy's int64 product of [65536] * 4 wraps to 0.
        elements = math.prod(shape)
        if elements > MAX_ELEMENTS:
            raise WireError(f"shape {shape!r} too large")
        size = elements * np.dtype(dtype).itemsize
        if offset + size > len(data):
            raise WireError("data shorter than the shapes say")
        arrays.append(np.frombuffer(data, dtype=dtype, count=elements,
                                    offset=offset).reshape(shape))
        offset += size
    if offset != len(data):
        raise WireError("data longer than the shapes say")
    return tuple(arrays)


# -- overflow entries ----------------------------------------------------------------


def encode_overflow(entry: Overflow) -> dict[bytes, bytes]:
    if not all(isinstance(s, np.ndarray) for s in entry.samples):
        raise WireError("only array samples can go on the wire")
    specs, data = _pack(list(entry.samples))
    meta = {"origin": entry.origin, "batch": entry.batch, "model": entry.model,
            "identity": entry.identity, "deadline_ms": entry.deadline_ms, "sent_ms": entry.sent_ms,
            "attempt": entry.attempt, "pad_to": entry.pad_to,
            "lengths": list(entry.lengths), "arrays": specs}
    return {b"v": VERSION, b"meta": orjson.dumps(meta), b"data": data}


OVERFLOW_KEYS = {"origin", "batch", "model", "identity", "deadline_ms", "sent_ms", "attempt",
                 "pad_to", "lengths", "arrays"}


def decode_overflow(fields: Any) -> Overflow:
    """Check and decode one overflow stream entry; raise WireError if it is not one."""
    meta, data = _envelope(fields)
    _keys(meta, OVERFLOW_KEYS, "overflow meta")
    origin, batch, model = meta["origin"], meta["batch"], meta["model"]
    if not isinstance(origin, str) or not _NODE.fullmatch(origin):
        raise WireError("bad origin")
    if not isinstance(batch, str) or not _BATCH.fullmatch(batch):
        raise WireError("bad batch id")
    if not isinstance(model, str) or not _MODEL.fullmatch(model):
        raise WireError("bad model name")
    if not isinstance(meta["identity"], str) or not _IDENTITY.fullmatch(meta["identity"]):
        raise WireError("bad model identity")
    for name in ("deadline_ms", "sent_ms"):
        if not _is_int(meta[name]) or not 0 < meta[name] < 1 << 53:
            raise WireError(f"bad {name}")
    if not _is_int(meta["attempt"]) or not 1 <= meta["attempt"] <= MAX_ATTEMPTS:
        raise WireError("bad attempt")
    lengths = meta["lengths"]
    if not isinstance(lengths, list) or not 1 <= len(lengths) <= MAX_ITEMS or \
            not all(_is_int(n) and n >= 1 for n in lengths):
        raise WireError("bad lengths")
    if meta["pad_to"] != max(lengths):
        raise WireError("pad_to is not the longest length")
    samples = _unpack(meta["arrays"], data, len(lengths))
    for sample, length in zip(samples, lengths):
        if sample.ndim < 1 or sample.shape[0] != length:
            raise WireError("a sample's first dimension is not its length")
    return Overflow(origin=origin, batch=batch, model=model, identity=meta["identity"],
                    deadline_ms=meta["deadline_ms"],
                    sent_ms=meta["sent_ms"], attempt=meta["attempt"], pad_to=meta["pad_to"],
                    lengths=tuple(lengths), samples=samples)


# -- replies -------------------------------------------------------------------------


def encode_reply(reply: Reply) -> dict[bytes, bytes]:
    meta: dict[str, Any] = {"batch": reply.batch, "node": reply.node,
                            "infer_ms": round(reply.infer_ms, 3)}
    data = b""
    if reply.error_code:
        meta["error"] = {"code": reply.error_code, "message": reply.error_message[:500]}
    elif all(isinstance(o, np.ndarray) and o.dtype.name in DTYPES for o in reply.outputs):
        meta["arrays"], data = _pack(list(reply.outputs))
    else:  # outputs that are not arrays travel as JSON
        meta["json"] = orjson.loads(orjson.dumps(list(reply.outputs),
                                                 option=orjson.OPT_SERIALIZE_NUMPY))
    return {b"v": VERSION, b"meta": orjson.dumps(meta), b"data": data}


def decode_reply(fields: Any, size: int, codes: frozenset[str]) -> Reply:
    """Check a reply for a batch of ``size`` items; error codes must be in ``codes``.

    Anything malformed raises WireError, never another exception: the origin's one
    reply reader must outlive any entry a peer writes."""
    try:
        return _decode_reply(fields, size, codes)
    except WireError:
        raise
    except (TypeError, ValueError, ArithmeticError) as error:
        raise WireError(f"reply does not parse: {type(error).__name__}: {error}") from None


def _decode_reply(fields: Any, size: int, codes: frozenset[str]) -> Reply:
    meta, data = _envelope(fields)
    if not isinstance(meta, dict):
        raise WireError("reply meta is not an object")
    kinds = {"error", "arrays", "json"} & set(meta)
    if len(kinds) != 1:
        raise WireError("a reply holds exactly one of error, arrays, json")
    _keys(meta, {"batch", "node", "infer_ms"} | kinds, "reply meta")
    if not isinstance(meta["node"], str) or not _NODE.fullmatch(meta["node"]):
        raise WireError("bad node")
    infer_ms = meta["infer_ms"]
    if isinstance(infer_ms, bool) or not isinstance(infer_ms, (int, float)) or infer_ms < 0:
        raise WireError("bad infer_ms")
    reply = Reply(batch=str(meta["batch"]), node=meta["node"], infer_ms=float(infer_ms))
    if "error" in meta:
        error = meta["error"]
        _keys(error, {"code", "message"}, "reply error")
        if not isinstance(error["code"], str) or error["code"] not in codes or \
                not isinstance(error["message"], str):
            raise WireError(f"bad error code {_brief(error['code'])}")
        return Reply(reply.batch, reply.node, reply.infer_ms, (), error["code"],
                     error["message"])
    if "arrays" in meta:
        outputs: tuple[Any, ...] = _unpack(meta["arrays"], data, size)
    elif not isinstance(meta["json"], list) or len(meta["json"]) != size:
        raise WireError(f"expected {size} outputs")
    else:
        outputs = tuple(meta["json"])
    return Reply(reply.batch, reply.node, reply.infer_ms, outputs)


def batch_of(fields: Any) -> str:
    """The batch id of a reply, before its full check (which needs the batch size)."""
    meta, _ = _envelope(fields)
    if not isinstance(meta, dict) or not isinstance(meta.get("batch"), str):
        raise WireError("reply without a batch id")
    return str(meta["batch"])


# -- helpers -------------------------------------------------------------------------


def _envelope(fields: Any) -> tuple[Any, bytes]:
    if not isinstance(fields, dict) or set(fields) != FIELDS:
        raise WireError("entry fields are not v, meta, data")
    if fields[b"v"] != VERSION:
        raise WireError(f"unknown version {_brief(fields[b'v'])}")
    data = fields[b"data"]
    if not isinstance(data, bytes):
        raise WireError("data is not bytes")
    try:
        return orjson.loads(fields[b"meta"]), data
    except orjson.JSONDecodeError:
        raise WireError("meta is not JSON") from None


def _keys(value: Any, keys: set[str], what: str) -> None:
    if not isinstance(value, dict) or set(value) != keys:
        raise WireError(f"{what} must have exactly the keys {sorted(keys)}")


def _brief(value: Any) -> str:
    """A field of a refused entry as its message shows it, cut short: a peer's 100-MB
    string or list would otherwise be copied whole into a log line and the dead-letter
    entry."""
    return _SHOWN.repr(value[:40] if isinstance(value, bytes) else value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
