"""Loop lag: refusing for the event loop's own queue, which admission cannot see.

Admission reads the model's queue. Work the loop answers without the model (cached
answers, idempotent replays) never enters it, so a flood of such work is refused by
nothing there: every connection keeps a request in the loop, a turn of the loop lasts as
long as all of them, and past some number of callers every answer comes after its
caller's deadline (docs/pressure.md has the figures). The loop's lag, how late a timer
fires, is that turn. A request waits two or three turns (read, answered, written), and
the model and a margin need the rest of its deadline, so while a turn runs past an
eighth of the default deadline (two turns in a row) a growing share of non-critical
requests is refused, cached or not, before its body is parsed where its class can be
read without parsing (vega.httpio.scanned_priority), and never turned into a job (more
work for the loop).
The share falls back as the loop keeps time again; callers honouring Retry-After thin
the flood to what the loop turns in time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vega.errors import MIN_RETRY_MS, VegaError
from vega.records import CRITICAL, SHEDDABLE

# A probe falls due this long after it is armed: short next to the limit it is compared
# with, long enough that a loop keeping time runs a few hundred a second at most.
PROBE_S = 0.005
# The refused share's change per second the loop runs late (or in time): 0 to all in about
# the Retry-After a refused caller waits, so the flood thins before the callers come back.
RATE_PER_S = 1.0


class LoopLate(VegaError):
    """A refusal for the loop's lag: the Guard answers it and turns none into a job."""


class LoopLag:
    """A probe timer's lateness, armed while requests arrive, and the share of
    non-critical requests refused for it."""

    def __init__(self, deadline_s: float) -> None:
        self.limit_s = deadline_s / 8
        self.lag_s = 0.0  # the last probe's lateness
        self.share = 0.0  # of non-critical requests refused
        self.refused = 0
        self._credit = 0.0  # refusals owed: the share, spread evenly over requests
        self._due: float | None = None  # the armed probe's due time
        self._armed_at = 0.0
        self._was_late = False
        self._touched = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def touch(self) -> None:
        """A request arrived: keep a probe armed (re-armed as it fires while they come)."""
        self._touched = True
        if self._due is None:  # after a quiet spell: its last turn was not the one before
            self._was_late = False
            self._arm()

    def _arm(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._touched = False
        self._armed_at = self._loop.time()
        self._due = self._armed_at + PROBE_S
        self._loop.call_at(self._due, self._fired)

    def _fired(self) -> None:
        assert self._loop is not None and self._due is not None
        now = self._loop.time()
        self.lag_s = max(0.0, now - self._due)
        # By the time it took: a probe fires once a turn, and a long turn is the emergency.
        # Two late turns in a row, as a flood makes them; one is a hiccup (a collection, a
        # slow callback), and refusing for it would only turn callers away.
        step = RATE_PER_S * min(1.0, now - self._armed_at)
        was_late, late = self._was_late, self.lag_s > self.limit_s
        self._was_late = late
        if not late:
            self.share = max(0.0, self.share - step)
        elif was_late:
            self.share = min(1.0, self.share + step)
        self._due = None
        if not self.share:
            self._credit = 0.0
        if self._touched or self.share:  # after a flood, until the share is back to 0
            self._arm()

    @property
    def armed(self) -> bool:
        """A probe is due (none while no request comes and nothing is refused)."""
        return self._due is not None

    def check(self, priority: int) -> None:
        """Refuse this non-critical request if it is one of the share owed."""
        if not self.share or priority == CRITICAL:
            return
        self._credit += self.share
        if self._credit < 1.0:
            return
        self._credit -= 1.0
        self.refused += 1
        code = "shed" if priority == SHEDDABLE else "queue_full"
        lag_ms = 1000 * self.lag_s
        # The share falls back over a second, so the lag may already be small: say both.
        raise LoopLate(code, f"the server's event loop has been running late (now {lag_ms:.0f} "
                       f"ms): {self.share:.0%} of non-critical requests are refused until it "
                       "keeps time", retry_after_ms=max(MIN_RETRY_MS, lag_ms))

    def status(self) -> dict[str, Any]:
        return {"lag_ms": round(1000 * self.lag_s, 1), "refused_share": round(self.share, 2),
                "refused": self.refused}
