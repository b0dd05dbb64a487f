"""A batch of ours handed to peers: what the origin keeps while it waits on them.

The origin (vega.streams) keeps one ``Handoff`` per batch out, with the times its
take-back timer works to (DESIGN.md rule 7), and asks Redis whether a peer has read
the entry with ``DELETE_UNLESS_DELIVERED``: read, it waits for the answer; unread, the
entry is gone in the same step, so no thief can read it after the check.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from vega.records import Batch

# KEYS[1] the overflow stream, ARGV group and entry id: -1 if a consumer has read the entry,
# else the entries deleted (1: it was still waiting; 0: it had left the stream already).
DELETE_UNLESS_DELIVERED = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) > 0 then return -1 end
return redis.call('XDEL', KEYS[1], ARGV[2])
"""


@dataclass
class Handoff:
    """A batch of ours waiting on peers."""

    batch: Batch
    entry_id: Any = None
    sent_at: float = 0.0  # loop clock
    timer: asyncio.TimerHandle | None = None
    last_call: float = 0.0  # loop clock: past it, running it here could not make the deadline
    check_at: float = 0.0  # loop clock: when it would have started here (the unclaimed check)
    read: bool = False  # a peer has read it: it runs there, or is declined
