"""A batch's end answered: its items' futures, the batcher told first; and a failed
batch run again in parts, so that an input the model raises on fails only its own
caller, not every caller batched with it.

A batch of several that the model raised on runs again in halves, and each half that
fails again is halved again, down to the inputs alone: the callers whose inputs the
model takes get their answers, a few passes later. A failed batch of N costs at most
2N - 1 passes (a model that fails on every input), and rarely fails (an input the model
raises on is the caller's doing). A job batch whose model process died runs again a job
at a time (the job lane would retry each job into the same company); an inline batch
does not: its callers' deadlines would not wait for the restart, and the input may kill
the process again. A peer's batch is answered whole (its reply carries one outcome), so
only batches formed here (``Batch.isolate``) run again; its origin runs it again
(vega.streams), where it is halved.

Before a batch runs, ``held_back`` looks for inputs that took a model process down
(vega.quarantine): those refused fail, each suspect runs alone, the rest together; a
peer's batch that holds one is declined, to run at its origin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from vega.errors import VegaError
from vega.modelproc.child import said
from vega.modelproc.handle import ModelProcessError
from vega.quarantine import WENT_DOWN, Quarantine
from vega.records import JOB, Batch, Item

log = logging.getLogger("vega.executor")
LOG_EVERY_S = 1.0  # a model's failures are logged once a second at most, with a count


class Settler:
    """Answers ended batches, and runs again (``run``) the parts of failed ones."""

    def __init__(self, run: Callable[[Batch], object], quarantine: Quarantine) -> None:
        self._run = run
        self.quarantine = quarantine
        self._logged_at: dict[str, float] = {}  # by model: when its last failure was logged
        self._unlogged: dict[str, int] = {}  # by model: failed batches since then

    def ended(self, batch: Batch, outputs: list[Any] | None, error: BaseException | None,
              done: asyncio.Future[None]) -> None:
        """``batch`` ended (on the loop): ``done`` and its items settled, or parts run again."""
        if isinstance(error, ModelProcessError) and error.suspect:
            self.quarantine.crashed(batch.model, batch.items)
        elif batch.size == 1 and not isinstance(error, (VegaError, ModelProcessError)):
            self.quarantine.ran(batch.model, batch.items)  # it ran, and the process lived
        parts = _parts(batch, error)
        if not parts:
            if error is not None and not isinstance(error, VegaError):
                self._log(batch, error)
            _resolve(batch, outputs, error, done)
            return
        try:  # its end reaches the batcher; its items are answered by the parts
            _resolve(batch, [], None, done)
        finally:
            for part in parts:
                self._run(part)

    def held_back(self, batch: Batch, done: asyncio.Future[None]) -> bool:
        """Whether ``batch`` ended here, unrun, for holding inputs that took a model process
        down: its refused inputs failed, its suspects each run alone, the rest together."""
        clean, suspects, refused = self.quarantine.sort(batch.model, batch.items)
        if not refused and (not suspects or batch.size == 1):
            batch.alone = bool(suspects)
            return False
        if not batch.isolate:  # a peer's, answered whole: declined, its origin runs it
            _resolve(batch, None, VegaError("not_ready", "holds an input that took a model "
                                            "process down here"), done)
            return True
        for item in refused:
            if not item.future.done():
                item.future.set_exception(self.quarantine.refusal())
        # A suspect whose caller left is not run: it might take the process down for nobody.
        parts = [_part(batch, [item], alone=True) for item in suspects if item.live]
        if clean:
            parts.insert(0, _part(batch, clean))
        try:  # its end reaches the batcher; its items are answered by the parts
            _resolve(batch, [], None, done)
        finally:
            for part in parts:
                self._run(part)
        return True

    def _log(self, batch: Batch, error: BaseException) -> None:
        """One line a second at most per model: a flood of inputs it raises on must not
        become a flood of log lines."""
        now = time.monotonic()
        if now - self._logged_at.get(batch.model, -LOG_EVERY_S) < LOG_EVERY_S:
            self._unlogged[batch.model] = self._unlogged.get(batch.model, 0) + 1
            return
        self._logged_at[batch.model] = now
        more = self._unlogged.pop(batch.model, 0)
        text = str(error) if hasattr(error, "kind") else said(error)  # a child's report is cut
        what = "failed" if isinstance(error, ModelProcessError) else "raised"
        log.error("model %s %s on a batch of %d: %s%s", batch.model, what, batch.size, text,
                  f" (and on {more} more batch(es) since the last line)" if more else "")


def _parts(batch: Batch, error: BaseException | None) -> list[Batch]:
    """The parts of ``batch`` to run again: none unless it failed, was formed here, and
    held more than one item (one still waiting whose batch mate's caller left, alone)."""
    if error is None or isinstance(error, VegaError) or not batch.isolate or batch.size < 2:
        return []
    live = [item for item in batch.items if not item.future.done()]
    if isinstance(error, ModelProcessError):
        return [_part(batch, [item]) for item in live] if batch.items[0].priority == JOB else []
    middle = (len(live) + 1) // 2
    return [_part(batch, part) for part in (live[:middle], live[middle:]) if part]


def _part(batch: Batch, items: list[Item], alone: bool = False) -> Batch:
    # Padded to its own longest window (a compiled package rounds that up itself): a
    # failure that follows the length stays with the long window.
    return Batch(model=batch.model, bucket=batch.bucket, items=items,
                 pad_to=max(item.length for item in items), isolate=True, alone=alone)


def _resolve(batch: Batch, outputs: list[Any] | None, error: BaseException | None,
             done: asyncio.Future[None]) -> None:
    # The batcher hears of the end first, here and not from ``done``'s callback, which
    # runs behind every handler the loop has queued: so the next batch reaches the free
    # thread or lane before this one's answers are written.
    try:
        if batch.on_end is not None:
            batch.on_end(batch)
    finally:
        _settle(batch, outputs, error, done)


def _settle(batch: Batch, outputs: list[Any] | None, error: BaseException | None,
            done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
    if error is None and outputs is not None:
        for item, output in zip(batch.items, outputs):
            if not item.future.done():
                item.infer_s = batch.infer_s
                item.future.set_result(output)
        return
    if isinstance(error, VegaError):  # not run at all: no model process is up
        failure = error
    elif isinstance(error, ModelProcessError):
        failure = VegaError("model_error", WENT_DOWN if error.suspect else str(error))
    else:
        kind = getattr(error, "kind", type(error).__name__)  # in a model process: its report
        failure = VegaError("model_error", f"model raised {kind}")
    batch.fail(failure)
