"""Inputs that took a model process down, kept from taking it down again.

A model process that dies, or hangs past ``VEGA_MODEL_TIMEOUT_S``, in a batch fails the
callers of the batch it was running, and every request waits out its restart (503). A
caller retries, and an input that killed it once most likely kills it again: so each
input of that batch becomes a suspect. A suspect runs in a batch of its own, so that if
it kills the process again no other caller's input goes down with it; one that runs is
cleared, one that kills the process alone is refused (500 ``model_error``) for
``HOLD_S`` without being run. Inputs are known by a digest of their bytes, so only the
same window comes back refused, not one like it; and only a window of a dtype and shape
held is hashed, so traffic of other lengths pays nothing. With Redis, the refused digests
go out in this process's heartbeat (``shared``) and peers serving the same model refuse
them too (``adopt``), so a retried input does not take each process down in turn.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vega.errors import VegaError
from vega.records import Batch, Item

HOLD_S = 600.0  # how long a suspect is remembered, and a confirmed input refused
MOST = 4096  # suspects and refusals held at most each; past it the oldest are forgotten
SHARED_MOST = 64  # refused digests a heartbeat carries per model, the latest
_HEX = re.compile(r"[0-9a-f]{32}")
_DTYPE = re.compile(r"[<>|=][a-zA-Z]\d{0,2}")
# What the callers of a batch the model process went down running are told; a peer's reply
# saying it has the origin run that batch's inputs alone too.
WENT_DOWN = "the model process went down running this batch"


class Refused(VegaError):
    """An input refused unrun, for having taken a model process down: trying it again
    soon is refused again (a job fails at once, its attempts unspent)."""


Form = tuple[str, str, tuple[int, ...]]  # model, dtype, shape: what a digest is taken of


@dataclass(frozen=True)
class _Held:
    until: float  # time.monotonic() when it is forgotten
    form: Form


def fingerprint(model: str, sample: object) -> bytes | None:
    """A digest of ``sample`` as the model sees it; None for a sample that is not an array
    (model processes take arrays only)."""
    form = _form(model, sample)
    return None if form is None else _digest(form, sample)


def _form(model: str, sample: object) -> Form | None:
    if not isinstance(sample, np.ndarray):
        return None
    return model, sample.dtype.str, sample.shape


def _digest(form: Form, sample: Any) -> bytes:
    """The digest of an array of ``form``."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{form[0]}\0{form[1]}\0{form[2]}\0".encode())
    digest.update(np.ascontiguousarray(sample).data)
    return digest.digest()


class Quarantine:
    """The suspects and refused inputs of one process's models."""

    def __init__(self, hold_s: float = HOLD_S, most: int = MOST) -> None:
        self.hold_s = hold_s
        self.most = most
        self._suspects: dict[bytes, _Held] = {}  # by digest, in the order held
        self._refused: dict[bytes, _Held] = {}
        self._forms: set[Form] | None = set()  # the forms held; None: to be counted again
        self.refusals = 0  # instances refused so far (each of a request's on its own)

    def __bool__(self) -> bool:
        """Whether any input is held: while none is, nothing is looked at."""
        return bool(self._suspects or self._refused)

    @property
    def refused(self) -> int:
        """Inputs refused now."""
        now = time.monotonic()
        self._expire(now)
        return sum(held.until > now for held in self._refused.values())

    def crashed(self, model: str, items: list[Item]) -> None:
        """``items`` were in the batch the model process was running when it died or hung:
        one alone is refused; several become suspects."""
        held = self._refused if len(items) == 1 else self._suspects
        now = time.monotonic()
        for item in items:
            form = _form(model, item.sample)
            if form is None:
                continue
            key = _digest(form, item.sample)
            refused = self._refused.get(key)
            if refused is None or refused.until <= now:  # a refusal is not made a suspect
                self._hold(held, key, _Held(now + self.hold_s, form))

    def _hold(self, held: dict[bytes, _Held], key: bytes, entry: _Held) -> None:
        self._suspects.pop(key, None)  # held anew, at the end: mostly in expiry order
        self._refused.pop(key, None)
        held[key] = entry
        if len(held) > self.most:
            del held[next(iter(held))]
        self._forms = None

    def ran(self, model: str, items: list[Item]) -> None:
        """``items`` ran alone and the process lived: suspected no longer."""
        if self._suspects:
            for _, key in self._digests(model, items):
                if self._suspects.pop(key, None) is not None:
                    self._forms = None

    def holds(self, batch: Batch) -> bool:
        """Whether ``batch`` holds a suspect or refused input (then it runs here)."""
        if not self:
            return False
        _, suspects, refused = self.sort(batch.model, batch.items)
        return bool(suspects or refused)

    def sort(self, model: str, items: list[Item]) -> tuple[list[Item], list[Item], list[Item]]:
        """``items`` as (clean, suspects, refused)."""
        now = time.monotonic()
        self._expire(now)
        suspects: list[Item] = []
        refused: list[Item] = []
        for item, key in self._digests(model, items):
            # (A peer's refusal may end before one held ahead of it: so its own time.)
            entry = self._refused.get(key)
            if entry is not None and entry.until > now:
                refused.append(item)
            elif key in self._suspects:
                suspects.append(item)
        if not suspects and not refused:
            return items, [], []
        marked = set(suspects + refused)
        return [item for item in items if item not in marked], suspects, refused

    def refusal(self) -> Refused:
        """What a refused input's caller gets."""
        self.refusals += 1
        return Refused("model_error", f"this input took the model process down; it is "
                       f"refused for {self.hold_s:g} s")

    # -- shared with peers -------------------------------------------------------------

    def shared(self) -> dict[str, list[list[Any]]]:
        """The inputs refused now, by model (the latest SHARED_MOST of each): each as its
        digest in hex, the wall-clock ms its refusal ends at, its dtype and shape. What
        this process's heartbeat tells its peers."""
        now, wall_ms = time.monotonic(), 1000 * time.time()
        self._expire(now)
        out: dict[str, list[list[Any]]] = {}
        for key, entry in reversed(self._refused.items()):
            model, dtype, shape = entry.form
            held = out.setdefault(model, [])
            if len(held) < SHARED_MOST and entry.until > now:
                held.append([key.hex(), int(wall_ms + 1000 * (entry.until - now)), dtype,
                             list(shape)])
        return out

    def adopt(self, model: str, entries: object) -> None:
        """Refuse, until the same instant, the inputs a peer serving the same ``model``
        refuses (its heartbeat's ``shared``). One refused here already keeps its own time:
        a refusal passed from peer to peer never outlives the first. What does not parse
        is ignored."""
        if not isinstance(entries, list):
            return
        now, wall_ms = time.monotonic(), 1000 * time.time()
        for entry in entries[:SHARED_MOST]:
            if not _entry(entry):
                continue
            left_s = min(self.hold_s, (entry[1] - wall_ms) / 1000)
            key = bytes.fromhex(entry[0])
            mine = self._refused.get(key)
            if left_s > 0 and (mine is None or mine.until <= now):
                self._hold(self._refused, key, _Held(now + left_s,
                                                     (model, entry[2], tuple(entry[3]))))

    # -- upkeep ----------------------------------------------------------------------------

    def _digests(self, model: str, items: list[Item]) -> list[tuple[Item, bytes]]:
        """The items of a form held, with their digests: only those are hashed."""
        if self._forms is None:
            self._forms = {held.form for held in self._suspects.values()} | \
                {held.form for held in self._refused.values()}
        out = []
        for item in items:
            form = _form(model, item.sample)
            if form is not None and form in self._forms:
                out.append((item, _digest(form, item.sample)))
        return out

    def _expire(self, now: float) -> None:
        # In the order they were held, the oldest first (an adopted one may wait behind).
        for held in (self._suspects, self._refused):
            while held and next(iter(held.values())).until <= now:
                del held[next(iter(held))]
                self._forms = None


def _entry(entry: object) -> bool:
    """Whether a peer's shared entry parses: [digest hex, end ms, dtype, shape]."""
    return (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
            and _HEX.fullmatch(entry[0]) is not None and type(entry[1]) is int
            and isinstance(entry[2], str) and _DTYPE.fullmatch(entry[2]) is not None
            and isinstance(entry[3], list) and len(entry[3]) <= 8
            and all(type(n) is int and 0 <= n < 1 << 31 for n in entry[3]))
