"""The capacity signal: how far this process is from its limit, and how many to run.

Sampled periodically from values the runtime exposes (executor busy time, queue
depth and age per class, refusals by reason), the signal keeps per-interval figures
for ``/v1/status`` and metrics, and a suggested number of processes for the observed
load. Vega starts and stops nothing: an operator or an external scheduler reads it.

The suggestion is the load this process sees, in executor-time per second, spread
over the processes it knows of (itself and the live peers it sees through Redis) at
the target utilisation:

    demand = utilisation + refused work + standing backlog / grow window
             + job backlog / job drain target / processes
    raw    = ceil(processes * demand / target)

(the job backlog is shared by all processes through Redis, so each counts its share);

with hysteresis, so it does not flap: it grows only after backlog or refusals have
lasted ``grow_after_s`` with ``raw`` above the suggestion all along (to the smallest
``raw`` of that stretch), and shrinks only after ``shrink_after_s`` with nothing
queued, nothing refused, and the load fitting in fewer processes even at
``SHRINK_MARGIN`` of the target (to the largest ``raw`` of that stretch).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

SHRINK_MARGIN = 0.8  # shrink only when the load fits at 80% of the target: a dead band
BACKLOG_AGE_S = 0.05  # a queue whose oldest item is younger than this is not a backlog
NOT_LOAD = frozenset({"not_ready", "draining"})  # refusals more processes would not help


@dataclass(frozen=True)
class CapacityConfig:
    target: float = 0.75  # executor utilisation to plan for
    grow_after_s: float = 5.0
    shrink_after_s: float = 60.0
    max_processes: int = 10_000
    job_drain_s: float = 300.0  # the job backlog should drain within this


@dataclass(frozen=True)
class Sample:
    """What the runtime reports at one moment; counters are cumulative."""

    at: float  # monotonic seconds
    busy_s: float  # executor thread-seconds spent in batches so far
    threads: int
    depth: Mapping[str, int]  # queued items per class
    oldest_age_s: Mapping[str, float]  # age of the oldest queued item per class (0: none)
    refusals: Mapping[str, float]  # refusals so far, by reason
    item_s: float  # executor seconds one item costs at full batches
    processes: int = 1  # this process and the live peers it sees
    overflow: Mapping[str, float] = field(default_factory=dict)  # batches offered, taken, ...
    job_items: float = 0.0  # job items queued or running (the async lane's backlog)
    # Executor seconds (per thread) to serve what is queued, as the batchers predict it
    # (every length and model); None: the queued items at ``item_s``.
    backlog_s: float | None = None


@dataclass
class Capacity:
    """The state machine; ``observe`` each sample, read ``view()``."""

    config: CapacityConfig = field(default_factory=CapacityConfig)
    suggested: int = 0  # the processes seen, until it first grows or shrinks
    utilisation: float = 0.0
    demand: float = 0.0
    refusal_rate: dict[str, float] = field(default_factory=dict)
    overflow_rate: dict[str, float] = field(default_factory=dict)
    last: Sample | None = None
    state: str = "steady"  # steady, growing (pressure held), shrinking (idle held)
    _since: float | None = None
    _toward: int = 0
    _decided: bool = False  # grown or shrunk once: the suggestion is the load's, not the fleet's

    def observe(self, sample: Sample) -> None:
        previous, self.last = self.last, sample
        if not self._decided:  # peers are heard a beat after the start
            self.suggested = max(1, sample.processes)
        if previous is None or sample.at <= previous.at:
            return
        dt = sample.at - previous.at
        threads = max(1, sample.threads)
        self.utilisation = min(1.0, max(0.0, (sample.busy_s - previous.busy_s) / (dt * threads)))
        self.refusal_rate = {reason: max(0.0, (count - previous.refusals.get(reason, 0.0)) / dt)
                             for reason, count in sample.refusals.items()}
        self.overflow_rate = {event: max(0.0, (count - previous.overflow.get(event, 0.0)) / dt)
                              for event, count in sample.overflow.items()}
        refused = sum(rate for reason, rate in self.refusal_rate.items()
                      if reason not in NOT_LOAD)
        queued = sum(sample.depth.values())
        queued_s = queued * sample.item_s / threads if sample.backlog_s is None \
            else sample.backlog_s
        horizon = max(self.config.grow_after_s, dt)
        jobs = sample.job_items * sample.item_s / threads / self.config.job_drain_s
        self.demand = (self.utilisation + refused * sample.item_s / threads
                       + queued_s / horizon + jobs / max(1, sample.processes))
        self._step(sample, refused > 0 or jobs > 0, queued + int(sample.job_items))

    def _step(self, sample: Sample, refusing: bool, queued: int) -> None:
        processes = max(1, sample.processes)
        backlog = max(sample.oldest_age_s.values(), default=0.0) > BACKLOG_AGE_S
        grow_to = self._raw(processes, self.config.target)
        shrink_to = self._raw(processes, self.config.target * SHRINK_MARGIN)
        if (backlog or refusing) and grow_to > self.suggested:
            self._hold("growing", sample.at, grow_to, min)
            if sample.at - (self._since or sample.at) >= self.config.grow_after_s:
                self._settle(self._toward)
        elif not (backlog or refusing or queued) and shrink_to < self.suggested:
            self._hold("shrinking", sample.at, shrink_to, max)
            if sample.at - (self._since or sample.at) >= self.config.shrink_after_s:
                self._settle(self._toward)
        else:
            self.state, self._since = "steady", None

    def _raw(self, processes: int, target: float) -> int:
        wanted = math.ceil(round(processes * self.demand / target, 6))
        return min(self.config.max_processes, max(1, wanted))

    def _hold(self, state: str, at: float, raw: int, keep: Callable[[int, int], int]) -> None:
        if self.state != state or self._since is None:
            self.state, self._since, self._toward = state, at, raw
        else:
            self._toward = keep(self._toward, raw)

    def _settle(self, suggested: int) -> None:
        self.suggested, self._decided = suggested, True
        self.state, self._since = "steady", None

    def view(self) -> dict[str, Any]:
        sample = self.last
        return {
            "suggested_processes": self.suggested or 1,
            "processes_seen": sample.processes if sample else 1,
            "state": self.state,
            "utilisation": round(self.utilisation, 3),
            "demand": round(self.demand, 3),
            "depth": dict(sample.depth) if sample else {},
            "queue_age_ms": {k: round(1000 * v, 1) for k, v in sample.oldest_age_s.items()}
            if sample else {},
            "refusals_per_s": {k: round(v, 2) for k, v in self.refusal_rate.items() if v},
            "overflow_batches_per_s": {k: round(v, 2) for k, v in self.overflow_rate.items()},
        }


async def sample_forever(capacity: Capacity, read: Callable[[], Sample], every_s: float) -> None:
    """Feed ``capacity`` a sample every ``every_s`` until cancelled."""
    while True:
        capacity.observe(read())
        await asyncio.sleep(every_s)
