"""Inputs that took a model process down, kept from taking it down again.

A model process that dies, or hangs past ``VEGA_MODEL_TIMEOUT_S``, in a batch fails the
callers of the batch it was running, and every request waits out its restart (503). A
caller retries, and an input that killed it once most likely kills it again: so each
input of that batch becomes a suspect. A suspect runs in a batch of its own, so that if
it kills the process again no other caller's input goes down with it; one that runs is
cleared, one that kills the process alone is refused (500 ``model_error``) for
``HOLD_S`` without being run. Inputs are known by a digest of their bytes, so only the
same window comes back refused, not one like it. With Redis, the refused digests go out
in this process's heartbeat (``shared``) and peers serving the same model refuse them
too (``adopt``), so a retried input does not take each process down in turn.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable

import numpy as np

from vega.errors import VegaError
from vega.records import Item

HOLD_S = 600.0  # how long a suspect is remembered, and a confirmed input refused
MOST = 4096  # suspects and refusals held at most each; past it the oldest are forgotten
SHARED_MOST = 64  # refused digests a heartbeat carries per model, the latest
_HEX = re.compile(r"[0-9a-f]{32}")
# What the callers of a batch the model process went down running are told; a peer's reply
# saying it has the origin run that batch's inputs alone too.
WENT_DOWN = "the model process went down running this batch"


def fingerprint(model: str, sample: object) -> bytes | None:
    """A digest of ``sample`` as the model sees it; None for a sample that is not an array
    (model processes take arrays only)."""
    if not isinstance(sample, np.ndarray):
        return None
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{model}\0{sample.dtype.str}\0{sample.shape}\0".encode())
    digest.update(np.ascontiguousarray(sample).data)
    return digest.digest()


class Quarantine:
    """The suspects and refused inputs of one process's models."""

    def __init__(self, hold_s: float = HOLD_S, most: int = MOST) -> None:
        self.hold_s = hold_s
        self.most = most
        self._suspects: dict[bytes, float] = {}  # digest -> when it is forgotten
        self._refused: dict[bytes, tuple[float, str]] = {}  # digest -> (until when, model)
        self.refusals = 0  # requests refused so far

    def __bool__(self) -> bool:
        """Whether any input is held: while none is, nothing is hashed."""
        return bool(self._suspects or self._refused)

    @property
    def refused(self) -> int:
        """Inputs refused now."""
        now = time.monotonic()
        self._expire(now)
        return sum(until > now for until, _ in self._refused.values())

    def crashed(self, model: str, items: list[Item]) -> None:
        """``items`` were in the batch the model process was running when it died or hung:
        one alone is refused; several become suspects."""
        if len(items) == 1:
            self._refuse(model, _keys(model, items))
            return
        until = time.monotonic() + self.hold_s
        for key in _keys(model, items):
            self._suspects.pop(key, None)  # held anew, at the end: the order is expiry order
            self._suspects[key] = until
            if len(self._suspects) > self.most:
                del self._suspects[next(iter(self._suspects))]

    def _refuse(self, model: str, keys: Iterable[bytes], until: float | None = None) -> None:
        until = time.monotonic() + self.hold_s if until is None else until
        for key in keys:
            self._suspects.pop(key, None)
            self._refused.pop(key, None)
            self._refused[key] = (until, model)
            if len(self._refused) > self.most:
                del self._refused[next(iter(self._refused))]

    def shared(self) -> dict[str, list[tuple[str, int]]]:
        """The inputs refused now, by model (the latest SHARED_MOST of each): each digest
        in hex and the wall-clock ms its refusal ends at. What this process's heartbeat
        tells its peers."""
        now, wall_ms = time.monotonic(), 1000 * time.time()
        self._expire(now)
        out: dict[str, list[tuple[str, int]]] = {}
        for key, (until, model) in reversed(self._refused.items()):
            held = out.setdefault(model, [])
            if len(held) < SHARED_MOST and until > now:
                held.append((key.hex(), int(wall_ms + 1000 * (until - now))))
        return out

    def adopt(self, model: str, entries: object) -> None:
        """Refuse, until the same instant, the inputs a peer serving the same ``model``
        refuses (its heartbeat's ``shared``). One held already keeps its own time: a
        refusal passed from peer to peer never outlives the first. What does not parse
        is ignored."""
        if not isinstance(entries, list):
            return
        now, wall_ms = time.monotonic(), 1000 * time.time()
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                    and _HEX.fullmatch(entry[0]) and isinstance(entry[1], int)):
                continue
            left_s = min(self.hold_s, (entry[1] - wall_ms) / 1000)
            key = bytes.fromhex(entry[0])
            if left_s > 0 and key not in self._refused:
                self._refuse(model, [key], now + left_s)

    def ran(self, model: str, items: list[Item]) -> None:
        """``items`` ran alone and the process lived: suspected no longer."""
        if self._suspects:
            for key in _keys(model, items):
                self._suspects.pop(key, None)

    def sort(self, model: str, items: list[Item]) -> tuple[list[Item], list[Item], list[Item]]:
        """``items`` as (clean, suspects, refused)."""
        now = time.monotonic()
        self._expire(now)
        clean: list[Item] = []
        suspects: list[Item] = []
        refused: list[Item] = []
        for item in items:
            key = fingerprint(model, item.sample)
            # (A peer's refusal may end before one held ahead of it: so its own time.)
            if key is not None and self._refused.get(key, (0.0, ""))[0] > now:
                refused.append(item)
            elif key is not None and key in self._suspects:
                suspects.append(item)
            else:
                clean.append(item)
        return clean, suspects, refused

    def refusal(self) -> VegaError:
        """What a refused input's caller gets."""
        self.refusals += 1
        return VegaError("model_error", f"this input took the model process down; it is "
                         f"refused for {self.hold_s:g} s")

    def _expire(self, now: float) -> None:
        # In the order they were held, the oldest first.
        while self._suspects and next(iter(self._suspects.values())) <= now:
            del self._suspects[next(iter(self._suspects))]
        while self._refused and next(iter(self._refused.values()))[0] <= now:
            del self._refused[next(iter(self._refused))]


def _keys(model: str, items: Iterable[Item]) -> list[bytes]:
    return [key for key in (fingerprint(model, item.sample) for item in items)
            if key is not None]
