"""Refusal pacing: a flood of callers that ignore Retry-After cannot starve admitted work.

A 429 is cheap but not free: the request was read, parsed and counted on the same
event loop that answers admitted work. Callers that resend at once turn every
refusal into another request, so past some rate the loop spends itself refusing
and goodput collapses. Refusals are therefore answered evenly spaced at ``rate`` per
second, each held until its slot (at most ``max_hold_s``): a caller that ignores
Retry-After is slowed to the pace the process can afford, while a polite fleet, whose
refusals come spread out below that rate, never waits (a burst of them at once is
spread too).
"""

from __future__ import annotations

from vega.errors import STATUS_BY_CODE

# Refusals of work the process had no room for; 503s (draining, not ready) are
# answered at once so a balancer moves on without delay.
PACED = frozenset(code for code, status in STATUS_BY_CODE.items() if status == 429)


class RefusalPacer:
    def __init__(self, rate: float, max_hold_s: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self.max_hold_s = max_hold_s
        self._next = 0.0  # loop time of the next free answer slot

    def hold(self, code: str, now: float) -> float:
        """Seconds to hold a refusal with ``code`` before answering it (0: at once)."""
        if not self.interval or code not in PACED:
            return 0.0
        slot = max(self._next, now)
        if slot - now >= self.max_hold_s:
            # Past the cap the slot stays put: each caller still waits the cap, so a
            # larger flood costs at most its size over max_hold_s refusals per second.
            return self.max_hold_s
        self._next = slot + self.interval
        return slot - now
