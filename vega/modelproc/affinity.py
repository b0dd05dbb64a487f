"""Keeping the model processes and the event loop on CPUs of their own (VEGA_MODEL_CPUS).

On a busy machine the scheduler moves the loop onto the model's CPU and back, and each
preemption stalls a batch; pinned, the model process keeps its CPU to itself. Linux
pins threads, not processes, and a new thread takes its creator's CPUs, so both sides
pin every thread they have when they start, before the threads that matter exist.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

log = logging.getLogger("vega.modelproc")


def pin_process(cpus: Collection[int]) -> None:
    """Run every thread of this process, and those it starts later, on ``cpus`` only."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that has just ended
            pass


def keep_off(cpus: Collection[int]) -> frozenset[int]:
    """Move this process off ``cpus`` (the model processes'); the CPUs it keeps.

    Nothing moves when no CPU this process may use would remain.
    """
    mine = frozenset(os.sched_getaffinity(0)) - frozenset(cpus)
    if not mine:
        log.warning("VEGA_MODEL_CPUS=%s leaves this process no CPU; it is not pinned",
                    ",".join(map(str, sorted(cpus))))
        return frozenset(os.sched_getaffinity(0))
    pin_process(mine)
    return mine
