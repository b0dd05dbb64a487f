"""The durable job store: a Redis stream per model, a hash per job (DESIGN.md "Jobs").

``vega:{model}:jobs`` (consumer group ``workers``) holds one entry per job not yet
finished; ``vega:{model}:job:<id>`` holds the job's record and, once finished, its
result, with a TTL. Every step that must not be torn is one Lua script (vega/jobs/lua.py)
over the keys of one model, which share its hash tag (one Cluster slot): submit (the
Idempotency-Key, the depth bound, the record and the stream entry), start, finish (result,
dead letter, acknowledgement) and cancel. A job whose record is already final is acknowledged, never
run again. Behind Sentinel a new job's 202 waits until a replica has it. Values are
orjson, checked on the way in: nothing from Redis is trusted.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import orjson
from redis import exceptions as rexc

from vega.channel.client import connect, leave_group
from vega.channel.keys import (
    BLOCK_MS,
    GROUP,
    blocking_timeout_s,
    dlq_key,
    job_dead_key,
    job_idem_key,
    job_key,
    jobs_key,
)
from vega.channel.url import SENTINEL, parse_redis_url
from vega.jobs import lua
from vega.jobs.store import (
    DONE,
    FINAL,
    QUEUED,
    Job,
    Stats,
    Submitted,
    queue_full,
    valid_id,
    wall_ms,
)
from vega.pressure.idempotency import conflict

log = logging.getLogger("vega.jobs")

# A withdrawal that failed as well is tried again after these waits: soon, before a
# runner is likely to take the job, then for as long as a short Redis outage lasts.
WITHDRAW_RETRY_S = (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class StoreError(Exception):
    """A record in Redis that does not have the schema Vega writes."""


class RedisStore:
    durable = True

    def __init__(self, url: str, timeout_s: float, result_ttl_s: float,
                 dlq_maxlen: int) -> None:
        self.cmd = connect(url, timeout_s)
        self.reader = connect(url, blocking_timeout_s(timeout_s))  # blocking reads only
        self.result_ttl_ms = int(1000 * result_ttl_s)
        self.dlq_maxlen = dlq_maxlen
        self._withdrawing: dict[asyncio.Task[None], str] = {}  # -> the job's id
        self._scripts = {name: self.cmd.register_script(text) for name, text in (
            ("submit", lua.SUBMIT), ("start", lua.START), ("finish", lua.FINISH),
            ("retry", lua.RETRY), ("cancel", lua.CANCEL), ("forget", lua.FORGET),
            ("withdraw", lua.WITHDRAW))}
        self._groups: set[str] = set()
        # Behind Sentinel a 202 waits until a replica has the job, so that killing the
        # primary right after it cannot lose it (replication is asynchronous).
        self._replicas = 1 if parse_redis_url(url).mode == SENTINEL else 0
        self._wait_ms = max(1, int(500 * timeout_s))  # within the command's own timeout

    async def _group(self, model: str) -> None:
        if model in self._groups:
            return
        try:  # from the start of the stream: jobs may be added before any group exists
            await self.cmd.xgroup_create(jobs_key(model), GROUP, id="0", mkstream=True)
        except rexc.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._groups.add(model)

    async def submit(self, job: Job, key: str | None, print_: str,
                     max_depth: int, stale_ok: bool = True) -> Submitted:
        ttl_ms = max(1, job.expires_ms - wall_ms()) + self.result_ttl_ms
        digest = hashlib.blake2b((key or "").encode(), digest_size=16).hexdigest()
        idem_key = job_idem_key(job.model, digest)
        fields: list[Any] = ["model", job.model, "status", QUEUED, "created_ms", job.created_ms,
                  "expires_ms", job.expires_ms, "single", int(job.single),
                  "priority", job.priority, "attempts", 0, "inputs", job.instances]
        keys = [jobs_key(job.model), job_key(job.model, job.id), idem_key]
        try:
            code, value = await self._scripts["submit"](
                keys=keys,
                args=[job.id, max_depth, ttl_ms, print_ if key is not None else "", *fields],
                client=self.cmd)
        except rexc.TimeoutError:
            # Its answer came late (a large body, a loop or host busy) or not at all (Redis
            # paused). Stored already: it was taken, 202. Else Redis may run it yet, after
            # any look, while a 503 says nothing was taken (Nginx sends the job to another
            # process): the withdrawal leaves a marker that stops it.
            tag = f"{print_}|{job.id}" if key is not None else ""
            try:
                withdrawn = await self._withdraw(keys, ttl_ms, tag, keep=True)
            except (rexc.RedisError, OSError):  # still a 503
                self._unsettled(job.id, keys, ttl_ms, tag)
                raise
            if withdrawn:
                raise
            code, value = 0, job.id
        value = value.decode() if isinstance(value, bytes) else str(value)
        if code == 0:
            if self._replicas and await self.cmd.wait(self._replicas, self._wait_ms) < 1:
                log.warning("job %s: stored on the primary, no replica confirmed it in %d ms",
                            job.id, self._wait_ms)
            return Submitted(job.id, QUEUED, True)
        if code == 1:
            earlier = await self.get(job.model, value)
            if earlier is not None:
                return Submitted(value, earlier.state(wall_ms()), False)
            if stale_ok:  # the key outlived its job's result (kept from the job's finish)
                await self._scripts["forget"](keys=[idem_key], args=[f"{print_}|{value}"],
                                              client=self.cmd)
                return await self.submit(job, key, print_, max_depth, stale_ok=False)
            return Submitted(value, QUEUED, False)  # another submit took the key back
        if code == 2:
            raise conflict()
        if code == 4:  # a resend of a submit withdrawn already
            raise rexc.TimeoutError("the submit was withdrawn after its answer timed out")
        raise queue_full(int(value), max_depth)

    async def _withdraw(self, keys: list[str], ttl_ms: int, tag: str, keep: bool = False
                        ) -> bool:
        """Whether a submit whose answer timed out is withdrawn (False: a runner has it, or
        ``keep`` and it is stored)."""
        status = await self._scripts["withdraw"](keys=keys, args=[ttl_ms, tag, int(keep)],
                                                 client=self.cmd)
        return status in (b"withdrawn", "withdrawn")

    def _unsettled(self, job_id: str, keys: list[str], ttl_ms: int, tag: str) -> None:
        """A submit answered 503 whose withdrawal failed too. With an Idempotency-Key it
        stays: the retry with that key, here or on a peer, may already have been answered
        202 for it. Without one, nothing else can name it, and left in the stream it would
        run beside the retry's job: it is withdrawn in the background."""
        if tag:
            log.warning("job %s: its submit timed out and could not be withdrawn; it is "
                        "kept for a retry with the same Idempotency-Key", job_id)
            return

        async def keep_trying() -> None:
            for wait_s in WITHDRAW_RETRY_S:
                await asyncio.sleep(wait_s)
                try:
                    withdrawn = await self._withdraw(keys, ttl_ms, tag)
                except (rexc.RedisError, OSError):
                    continue
                if not withdrawn:
                    log.warning("job %s: a runner took it before its timed-out submit could "
                                "be withdrawn; it runs, though its caller got 503", job_id)
                return
            log.error("job %s: its submit timed out and Redis could not be reached to "
                      "withdraw it; it may run, though its caller got 503", job_id)

        task = asyncio.get_running_loop().create_task(keep_trying())
        self._withdrawing[task] = job_id
        task.add_done_callback(self._withdrawing.pop)

    async def get(self, model: str, job_id: str) -> Job | None:
        raw: Any = await self.cmd.hgetall(job_key(model, job_id))
        return _decode(job_id, model, raw) if raw and not _withdrawn(raw) else None

    async def cancel(self, model: str, job_id: str) -> tuple[Job | None, bool]:
        code, _ = await self._scripts["cancel"](keys=[job_key(model, job_id), jobs_key(model)],
                                                args=[wall_ms(), self.result_ttl_ms],
                                                client=self.cmd)
        return await self.get(model, job_id), int(code) == 1

    async def take(self, model: str, consumer: str, count: int) -> list[Job]:
        await self._group(model)
        try:
            got: Any = await self.reader.xreadgroup(GROUP, consumer, {jobs_key(model): ">"},
                                                    count=count, block=BLOCK_MS)
        except rexc.ResponseError as error:
            if "NOGROUP" in str(error):  # Redis restarted empty
                self._groups.discard(model)
            raise
        entries = [e for _stream, batch in got or [] for e in batch]
        return await self._records(model, entries)

    async def reclaim(self, model: str, consumer: str, count: int,
                      idle_ms: int) -> list[Job]:
        await self._group(model)
        _next, entries, *_ = await self.cmd.xautoclaim(jobs_key(model), GROUP, consumer,
                                                       idle_ms, "0-0", count=count)
        return await self._records(model, entries)

    async def _records(self, model: str, entries: list[Any]) -> list[Job]:
        """The jobs the entries name; a hostile or orphaned entry is acknowledged away."""
        wanted: list[tuple[str, str]] = []
        drop: list[str] = []
        for entry_id, fields in entries:
            entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            job_id = (fields or {}).get(b"id", b"")
            job_id = job_id.decode(errors="replace") if isinstance(job_id, bytes) else ""
            if valid_id(job_id):
                wanted.append((entry, job_id))
            else:
                log.warning("job stream %s: entry %s names no job id; dropped", model, entry)
                drop.append(entry)
        async with self.cmd.pipeline(transaction=False) as pipe:
            for _entry, job_id in wanted:
                pipe.hgetall(job_key(model, job_id))
            # One key of another type (WRONGTYPE) fails only its own record, not the lot.
            raws = await pipe.execute(raise_on_error=False) if wanted else []
        jobs = []
        for (entry, job_id), raw in zip(wanted, raws):
            try:
                if isinstance(raw, rexc.ResponseError):
                    raise StoreError(str(raw))
                job = _decode(job_id, model, raw) if raw and not _withdrawn(raw) else None
            except StoreError as error:
                log.warning("job %s: %s; dropped", job_id, error)
                job = None
            if job is None:
                drop.append(entry)  # expired out of Redis, or not ours to read
                continue
            job.entry = entry
            jobs.append(job)
        if drop:
            async with self.cmd.pipeline(transaction=True) as pipe:
                pipe.xack(jobs_key(model), GROUP, *drop)
                pipe.xdel(jobs_key(model), *drop)
                await pipe.execute()
        return jobs

    async def start(self, jobs: list[Job]) -> list[Job]:
        by_model: dict[str, list[Job]] = {}
        for job in jobs:
            by_model.setdefault(job.model, []).append(job)
        attempts: dict[str, int] = {}
        for model, group in by_model.items():
            got = await self._scripts["start"](
                keys=[job_key(model, job.id) for job in group], client=self.cmd)
            attempts.update((job.id, int(n)) for job, n in zip(group, got))
        runnable = []
        for job in jobs:
            attempt = attempts[job.id]
            if attempt < 0:
                await self.finish(job, job.status)  # finished or cancelled meanwhile: ack
                continue
            job.attempts, job.status = attempt, "running"
            runnable.append(job)
        return runnable

    async def finish(self, job: Job, status: str, outputs: bytes = b"",
                     error: dict[str, str] | None = None, dead_letter: bool = False) -> None:
        await self._scripts["finish"](
            keys=[job_key(job.model, job.id), jobs_key(job.model), dlq_key(job.model),
                  job_dead_key(job.model)],
            args=[status, wall_ms(), self.result_ttl_ms, job.entry, outputs,
                  orjson.dumps(error) if error is not None else b"", int(dead_letter),
                  self.dlq_maxlen, job.id],
            client=self.cmd)

    async def retry(self, job: Job, ran: bool = True) -> None:
        await self._scripts["retry"](keys=[job_key(job.model, job.id), jobs_key(job.model)],
                                     args=[job.entry, job.id, 0 if ran else 1], client=self.cmd)

    async def refresh(self, model: str, consumer: str, jobs: list[Job]) -> None:
        """Reset the idle time of entries held here, so no peer reclaims live work."""
        entries: list[Any] = [job.entry for job in jobs if job.entry]
        if entries:
            await self.cmd.xclaim(jobs_key(model), GROUP, consumer, 0, entries, justid=True)

    async def stats(self, model: str) -> Stats:
        await self._group(model)
        async with self.cmd.pipeline(transaction=False) as pipe:
            pipe.xlen(jobs_key(model))
            pipe.xpending(jobs_key(model), GROUP)
            pipe.xrange(jobs_key(model), count=1)
            pipe.get(job_dead_key(model))
            length, pending, first, dead = await pipe.execute()
        claimed = int(pending.get("pending", 0)) if isinstance(pending, dict) else 0
        oldest_ms = 0
        if first:
            entry = first[0][0]
            entry = entry.decode() if isinstance(entry, bytes) else str(entry)
            oldest_ms = max(0, wall_ms() - int(entry.split("-")[0]))
        return Stats(queued=max(0, int(length) - claimed), pending=claimed,
                     oldest_age_s=oldest_ms / 1000, dead_letters=int(dead or 0))

    async def leave(self, model: str, consumer: str) -> None:
        """This process stops taking: its name leaves the group, unless it holds jobs."""
        await leave_group(self.cmd, jobs_key(model), GROUP, consumer)

    async def close(self) -> None:
        if self._withdrawing:  # a moment for a withdrawal under way, not its whole backoff
            await asyncio.wait(list(self._withdrawing), timeout=1.0)
            for task, job_id in list(self._withdrawing.items()):
                if task.done():
                    continue
                log.error("job %s: stopping before its timed-out submit could be withdrawn; "
                          "it may run, though its caller got 503", job_id)
                task.cancel()
            await asyncio.gather(*self._withdrawing, return_exceptions=True)
        await self.cmd.aclose()
        await self.reader.aclose()


def _withdrawn(raw: dict[bytes, bytes]) -> bool:
    """The marker of a submit refused after its answer timed out: no job."""
    return raw.get(b"status") == b"withdrawn"


def _decode(job_id: str, model: str, raw: dict[bytes, bytes]) -> Job:
    """A job record as read from Redis, schema-checked."""
    try:
        fields = {k.decode(): v.decode() for k, v in raw.items() if k != b"inputs"
                  and k != b"outputs"}
        status = fields["status"]
        if status not in FINAL and status not in (QUEUED, "running"):
            raise StoreError(f"status {status!r}")
        if fields.get("model", model) != model:
            raise StoreError("record of another model")
        error = orjson.loads(fields["error"]) if fields.get("error") else None
        if error is not None and not (isinstance(error, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in error.items())):
            raise StoreError("error is not an object of strings")
        outputs = raw.get(b"outputs", b"")
        if outputs or status == DONE:
            orjson.loads(outputs)  # a fragment that is not JSON must never reach a reply
        return Job(id=job_id, model=model, instances=raw.get(b"inputs", b""),
                   single=fields.get("single") == "1",
                   priority=_count(fields.get("priority", "1"), 3),
                   created_ms=_count(fields["created_ms"]),
                   expires_ms=_count(fields["expires_ms"]), status=status,
                   attempts=_count(fields.get("attempts", "0"), 1 << 20), outputs=outputs,
                   error=error,
                   finished_ms=_count(fields["finished_ms"]) if "finished_ms" in fields else None,
                   entry=fields.get("entry", ""))
    except (KeyError, ValueError, UnicodeDecodeError, orjson.JSONDecodeError) as exc:
        raise StoreError(f"malformed record: {exc!r}") from None


def _count(text: str, most: int = 1 << 53) -> int:
    """A record's integer field: digits only (Python's int() takes " 1", which HINCRBY
    refuses mid-script), and no more than ``most`` (a time in ms, a count, a class)."""
    if not text.isascii() or not text.isdigit() or int(text) > most:
        raise ValueError(f"{text[:40]!r} is not an integer 0..{most}")
    return int(text)
