"""Every Redis key and stream name Vega uses, in one place (DESIGN.md "Redis layout").

Keys of one model carry the model name as a hash tag, so a Redis Cluster keeps them
on one slot.
"""

from __future__ import annotations

GROUP = "workers"
NODES = "vega:nodes"  # sorted set: node -> last heartbeat (epoch ms), to list peers


def overflow_key(model: str) -> str:
    return f"vega:{{{model}}}:overflow"


def dlq_key(model: str) -> str:
    return f"vega:{{{model}}}:dlq"


def done_key(model: str, batch: str) -> str:
    return f"vega:{{{model}}}:done:{batch}"


def jobs_key(model: str) -> str:
    """The job stream of ``model`` (consumer group GROUP); entries name a job id."""
    return f"vega:{{{model}}}:jobs"


def job_key(model: str, job: str) -> str:
    """A job's record and, once finished, its result (a hash with a TTL)."""
    return f"vega:{{{model}}}:job:{job}"


def job_idem_key(model: str, digest: str) -> str:
    """An Idempotency-Key of POST /v1/jobs: the body's fingerprint and the job id."""
    return f"vega:{{{model}}}:jobs:idem:{digest}"


def job_dead_key(model: str) -> str:
    """Count of jobs copied to the dead-letter stream (``dlq_key``, kind=job)."""
    return f"vega:{{{model}}}:jobs:dead"


def cache_entry_key(model: str, digest: str) -> str:
    """A stored answer of the shared response cache (vega/pressure/cache.py)."""
    return f"vega:{{{model}}}:cache:{digest}"


def idempotency_key(model: str, digest: str) -> str:
    """An Idempotency-Key's lock or stored answer (vega/pressure/idempotency.py)."""
    return f"vega:{{{model}}}:idem:{digest}"


def reply_key(node: str) -> str:
    return f"vega:reply:{node}"


def node_key(node: str) -> str:
    return f"vega:node:{node}"


BLOCK_MS = 500  # blocking reads
# A blocked read's empty answer comes at the end of its block, when a loop busy with a
# burst may reach it late: its socket may wait this much longer than a short command's
# (the loop stalled 200 ms took Redis for gone, and every handed-off batch back).
BLOCK_LATE_MS = 250

REPLY_TTL_MS = 3_600_000  # a dead origin's reply stream goes away after an hour


def blocking_timeout_s(timeout_s: float) -> float:
    """The socket timeout of a blocking reader whose commands take ``timeout_s``."""
    return (BLOCK_MS + BLOCK_LATE_MS) / 1000 + timeout_s
