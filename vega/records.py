"""Records shared along the request path: an item waiting for a model, a batch of them.

Leaf module: the batcher, executor, streams and server all read these; none of
them is imported here.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CRITICAL, NORMAL, SHEDDABLE = 0, 1, 2
PRIORITY_NAMES = ("critical", "normal", "sheddable")
PRIORITY_BY_NAME = {name: index for index, name in enumerate(PRIORITY_NAMES)}
# The async lane's class, below sheddable: never admitted inline, batched only while no
# inline item waits, and never in a batch with inline items (vega/jobs/).
JOB = len(PRIORITY_NAMES)
CLASS_NAMES = (*PRIORITY_NAMES, "job")

_ids = itertools.count(1)


def deadline_at(deadline_ms: float, now: float, arrived: float | None) -> float:
    """The loop time a request's deadline falls at: ``deadline_ms`` after it arrived
    (DESIGN.md), or after ``now`` where its arrival is unknown."""
    return (now if arrived is None else arrived) + deadline_ms / 1000


@dataclass(eq=False)
class Item:
    """One instance to run through the model, and the future its caller awaits.

    Times are the event loop's monotonic clock, in seconds.
    """

    sample: Any  # what the model adapter's decode() returned
    length: int
    priority: int
    deadline: float
    future: asyncio.Future[Any]
    enqueued_at: float = 0.0
    # Its queue wait, by time.perf_counter(): the loop's clock is whole ms on uvloop.
    queued_pc: float = 0.0
    queue_s: float = 0.0
    counted: bool = False  # in its batcher's queue counts (a clock may read 0.0)
    infer_s: float = 0.0  # forward time of the batch that answered it
    bucket: int = 0  # index into the model's length buckets
    cost: float = 1.0  # admission cost units
    id: int = field(default_factory=lambda: next(_ids))
    gone: Callable[[], bool] | None = None  # true once the caller hung up; cheap to ask

    @property
    def live(self) -> bool:
        """False once answered, timed out or cancelled, or once its caller hung up.

        A hung-up caller's item is cancelled here, where the batcher looks before
        dispatch, rather than watched by a task per request all along.
        """
        if self.future.done():
            return False
        if self.gone is not None and self.gone():
            self.future.cancel()  # nobody is left to read the answer
            return False
        return True


@dataclass(eq=False)
class Batch:
    """Items of one model and one length bucket, run in one forward pass."""

    model: str
    bucket: int
    items: list[Item]
    pad_to: int  # what it pads to: its longest item's length, or the model's rounding up of it
    infer_s: float = 0.0  # measured by whoever ran it; 0 if it failed (nothing to predict)
    ended_at: float | None = None  # time.monotonic() when it ended, by whoever ran it
    # Set by the batcher; whoever runs the batch calls it on the loop as soon as the batch
    # has ended, before its items are answered (so the next batch goes first).
    on_end: Callable[[Batch], None] | None = field(default=None, repr=False)
    # Formed here: failed, it runs again in parts, so that only the input the model raised
    # on fails (vega.settle); a peer's batch is answered whole.
    isolate: bool = False
    # An input suspected of taking a model process down (vega.quarantine): it runs with
    # no other batch in its model process, so none goes down with it.
    alone: bool = False
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def size(self) -> int:
        return len(self.items)

    @property
    def steps(self) -> int:
        """Timesteps run through the model, padding included."""
        return self.pad_to * len(self.items)

    @property
    def padded_steps(self) -> int:
        return self.steps - sum(item.length for item in self.items)

    @property
    def padding_ratio(self) -> float:
        """Share of the padded tensor that is padding (0 = none)."""
        return self.padded_steps / self.steps if self.steps else 0.0

    @property
    def deadline(self) -> float:
        return min(item.deadline for item in self.items)

    def fail_due_by(self, finish: float, error: Callable[[Item], BaseException]) -> None:
        """Answer ``error(item)`` to the items whose deadline comes by ``finish``; keep the rest."""
        kept = []
        for item in self.items:
            if item.deadline > finish:
                kept.append(item)
            elif not item.future.done():
                item.future.set_exception(error(item))
        self.items = kept

    def fail(self, error: BaseException) -> None:
        """Answer each item still waiting with ``error``."""
        fail_items(self.items, error)


def fail_items(items: list[Item], error: BaseException) -> None:
    """Answer each of ``items`` still waiting with ``error``."""
    for item in items:
        if not item.future.done():
            item.future.set_exception(error)
