"""An asyncio event loop on a virtual clock: time jumps instead of passing.

``VirtualEventLoop`` is a stock selector event loop whose ``time()`` is a number it
owns and whose selector never sleeps. When a real loop would block in
``select(timeout)`` until its next timer is due, this one moves its clock to that
timer and returns at once, so ``asyncio.sleep``, ``call_at``, ``wait_for`` and
every timer in the batcher and admission run unchanged, only as fast as the CPU
allows. Nothing else is patched: tasks, futures and events are asyncio's own.

Work handed to threads (``run_in_executor``) still works: with nothing ready and
no timer pending the loop blocks for real until a thread wakes it, with virtual
time standing still meanwhile.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.BaseSelector):
    """Keeps the loop's registrations (its self-pipe) but never waits for a timer."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.loop: VirtualEventLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # nothing ready, no timer: only a thread can wake us
            return self._real.select(None)
        if timeout > 0 and self.loop is not None:
            self.loop.advance_to_next_timer()
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock starts at ``start`` and only jumps."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = start
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance_to_next_timer(self) -> None:
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            self._now = max(self._now, scheduled[0].when())

    def advance(self, seconds: float) -> None:
        """Move the clock forward by hand (tests); timers now due run on the next pass."""
        if seconds < 0:
            raise ValueError("the virtual clock only moves forward")
        self._now += seconds


def run(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Like ``asyncio.run``, on a fresh ``VirtualEventLoop``."""
    with asyncio.Runner(loop_factory=lambda: VirtualEventLoop(start)) as runner:
        return runner.run(main)
