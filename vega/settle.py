"""A batch's end answered: its items' futures, the batcher told first; and a failed
batch run again in parts, so that an input the model raises on fails only its own
caller, not every caller batched with it.

A batch of several that the model raised on runs again in halves. A half that fails
while the other half ran through holds the input, and is halved again, down to the input
alone. Both halves failing says the fault is not one input (a model that fails on every
input, a batch shape it cannot take): both are answered the error then, so a broken model
costs three passes a batch, not one per item. A job batch whose model process died runs
again a job at a time (the job lane would retry each job into the same company); an
inline batch does not: its callers' deadlines would not wait for the restart, and the
input may kill the process again. A peer's batch is answered whole (its reply carries
one outcome), so only batches formed here (``Batch.isolate``) run again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vega.errors import VegaError
from vega.modelproc.handle import ModelProcessError
from vega.records import JOB, Batch, Item

log = logging.getLogger("vega.executor")


@dataclass(eq=False)
class _Halves:
    """The two halves of one failed batch, as they end."""

    ended: int = 0
    ran_through: bool = False  # one half answered: a failed one holds the input
    held: tuple[Batch, BaseException] | None = None  # failed first, until the other ends


@dataclass
class After:
    """What a batch's end asks for: whether it is answered as it ended, the parts of it
    (or of its held sibling) to run again, and held batches to answer their error."""

    answered: bool = True
    again: list[Batch] = field(default_factory=list)
    failed: list[tuple[Batch, BaseException]] = field(default_factory=list)


class Settler:
    """Answers ended batches, and runs again (``run``) the parts of failed ones."""

    def __init__(self, run: Callable[[Batch], object]) -> None:
        self._run = run
        self._halves: dict[Batch, _Halves] = {}  # the halves in flight, by batch

    def ended(self, batch: Batch, outputs: list[Any] | None, error: BaseException | None,
              done: asyncio.Future[None]) -> None:
        """``batch`` ended (on the loop): ``done`` and its items settled, or parts run again."""
        after = self._after(batch, error)
        if after.answered:
            _resolve(batch, outputs, error, done)
        else:  # its end reaches the batcher; its items are answered by the parts run again
            _resolve(batch, [], None, done)
        for held, held_error in after.failed:
            _fail(held, held_error)
        for part in after.again:
            self._run(part)

    def _after(self, batch: Batch, error: BaseException | None) -> After:
        halves = self._halves.pop(batch, None)
        held = None
        if halves is not None:
            halves.ended += 1
            halves.ran_through |= error is None
            held = halves.held
        if error is None:
            if held is None:
                return After()
            parts = self._halved(held[0])  # it failed, this half ran through: it holds the input
            return After(again=parts) if parts else After(failed=[held])
        if isinstance(error, (VegaError, ModelProcessError)) or not batch.isolate:
            after = After()
            if isinstance(error, ModelProcessError) and batch.size > 1 \
                    and batch.items[0].priority == JOB:
                after = After(answered=False, again=[_part(batch, [item]) for item in batch.items
                                                     if not item.future.done()])
            after.failed += [held] if held is not None else []
            return after
        if halves is not None and not halves.ran_through:
            if held is None:  # the other half has not ended: hold this one's answers
                halves.held = (batch, error)
                return After(answered=False)
            return After(failed=[held])  # both failed: not one input's fault
        parts = self._halved(batch)
        return After(answered=False, again=parts) if parts else After()

    def _halved(self, batch: Batch) -> list[Batch]:
        """The items of ``batch`` still waiting, in two halves; none where fewer than two
        wait (the input alone)."""
        live = [item for item in batch.items if not item.future.done()]
        if len(live) < 2:
            return []
        halves = _Halves()
        middle = (len(live) + 1) // 2
        parts = [_part(batch, live[:middle]), _part(batch, live[middle:])]
        for part in parts:
            self._halves[part] = halves
        return parts


def _part(batch: Batch, items: list[Item]) -> Batch:
    return Batch(model=batch.model, bucket=batch.bucket, items=items, pad_to=batch.pad_to,
                 isolate=True)


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
    else:
        _fail(batch, error)


def _fail(batch: Batch, error: BaseException | None) -> None:
    if isinstance(error, VegaError):  # not run at all: no model process is up
        failure = error
    else:
        log.error("model %s failed on batch %d of %d: %r", batch.model, batch.id,
                  batch.size, error)
        kind = getattr(error, "kind", type(error).__name__)  # in a model process: its report
        failure = VegaError("model_error", f"model raised {kind}")
    batch.fail(failure)
