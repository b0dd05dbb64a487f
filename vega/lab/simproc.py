"""One simulated Vega process: the real ``Batcher`` and ``Admission``, a timeline for an executor.

``SimProcess`` builds the batcher and admission from the same settings as ``Runtime``
builds them (on ``simclock``'s virtual loop, which the caller runs); only the executor
is replaced: a batch "runs" for the time the profiled latency model gives for its
(padded length, size) on the first free thread, then has its futures resolved as
``executor._resolve`` does, with ``batch.infer_s`` set so the batcher's measured batch
times and service rate move as they do in a real process. A request follows
``Runtime.infer``: admit, build the item, enqueue, wait until answered or until the
deadline, then give the item up; its fate goes into ``Requests``. With an ``Overflow``
the processes hand formed batches to each other by the rule Vega's do (rule 11):
admission shares the work ahead with the threads idle peers can lend, and a batch goes
to such a peer once the wait here passes the round trip plus the threshold, two waiting
at most per lent thread; that is a model of the Redis Streams overflow, not its code.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field

from vega.admission import Admission, AdmissionConfig
from vega.batcher import Batcher, BatcherConfig
from vega.channel.peers import PENDING_PER_SPARE
from vega.config import Settings
from vega.errors import VegaError
from vega.lab.profile import LatencyModel
from vega.lab.simjobs import SimJobs
from vega.records import JOB, Batch, Item
from vega.stack import LOAD_REFUSALS
from vega.warmup import planned, seed_batch_times

# Outcome codes of simulated requests, stored as small ints per request.
OUTCOMES = ("ok", "rate_limited", "queue_full", "shed", "deadline_unmeetable",
            "deadline_exceeded", "model_error", "accepted")  # accepted: became a job (202)
OUTCOME_INDEX = {name: index for index, name in enumerate(OUTCOMES)}
PENDING = -1


# Called with a request's index, outcome and Retry-After (seconds; 0: none) once it ends.
Finished = Callable[[int, str, float], None]


class Requests:
    """Per-request results, one slot per arrival: outcome, process, and finish time; and
    how many admitted requests and jobs are still open. A closed loop adds its requests
    as it sends them (``add``) and hears of each end (``on_finish``)."""

    def __init__(self, t_s: MutableSequence[float]) -> None:
        self.t_s = t_s
        n = len(t_s)
        self.outcome = [PENDING] * n
        self.process = [0] * n
        self.done_s = [0.0] * n
        self.on_finish: Finished | None = None
        self.open = 0
        self.jobs = 0
        self.all_sent = False
        self.quiet: asyncio.Future[None] | None = None
        self.inline_done_s: float | None = None  # when the last admitted request was answered

    def opened(self, job: bool = False) -> None:
        if job:
            self.jobs += 1
        else:
            self.open += 1

    def closed(self, job: bool = False) -> None:
        if job:
            self.jobs -= 1
        else:
            self.open -= 1
        self.check_quiet()

    def check_quiet(self) -> None:
        """Resolve ``quiet`` once every arrival was sent, every admitted one answered and
        every job ended."""
        if not self.all_sent or self.open:
            return
        if self.inline_done_s is None:
            self.inline_done_s = asyncio.get_running_loop().time()
        if self.jobs == 0 and self.quiet is not None and not self.quiet.done():
            self.quiet.set_result(None)

    def add(self, t: float) -> int:
        """A request sent at ``t``; returns its index."""
        self.t_s.append(t)
        self.outcome.append(PENDING)
        self.process.append(0)
        self.done_s.append(0.0)
        return len(self.t_s) - 1

    def finish(self, index: int, outcome: str, now: float,
               error: VegaError | None = None) -> None:
        self.outcome[index] = OUTCOME_INDEX[outcome]
        self.done_s[index] = now
        if self.on_finish is not None:
            wait = error.headers().get("Retry-After", "0") if error is not None else "0"
            self.on_finish(index, outcome, float(wait))


@dataclass
class _Open:
    index: int
    item: Item
    timer: asyncio.TimerHandle | None = None


@dataclass
class Overflow:
    """The model of batch overflow between processes (see the module docstring)."""

    after_s: float  # VEGA_OVERFLOW_THRESHOLD_MS: the wait past the round trip to hand off
    rtt_s: float  # the round trip the origin measures and decides by (waits at the thief too)
    transport_s: float  # the time a handed-over batch spends in Redis, there and back
    peers: list[SimProcess] = field(default_factory=list)


class SimReach:
    """What a process's admission reads of its peers, as Runtime/Streams give it."""

    def __init__(self, proc: SimProcess, overflow: Overflow) -> None:
        self.proc = proc
        self.overflow = overflow

    def lent(self, model: str) -> float:
        return float(sum(p.batcher.spare_threads for p in self.overflow.peers
                         if p is not self.proc))

    def room(self, model: str) -> bool:
        return self.proc.handed_waiting() < PENDING_PER_SPARE * self.lent(model)


class SimProcess:
    """A Vega process: the real Batcher and Admission, the executor replaced by a timeline."""

    def __init__(self, index: int, settings: Settings, latency: LatencyModel,
                 requests: Requests, rng: random.Random, noise: bool,
                 overflow: Overflow | None = None) -> None:
        self.index = index
        self.settings = settings
        self.latency = latency
        self.requests = requests
        self.rng = rng
        self.noise = noise
        self.overflow = overflow
        loop = asyncio.get_running_loop()
        self.loop = loop
        model = latency.model or "model"
        self.batcher = Batcher(BatcherConfig.from_settings(settings, model, latency.max_length,
                                                           hands_off=overflow is not None,
                                                           min_length=latency.min_length),
                               self._sink)
        self.admission = Admission(AdmissionConfig.from_settings(settings), self.batcher,
                                   loop.time())
        self.free_at = [loop.time()] * settings.executor_threads  # per executor thread
        self.open = 0  # admitted requests not yet answered (least_conn counts these)
        self.batches = 0
        self.sizes: list[int] = []
        self.padding: list[float] = []
        self.overflow_out = 0
        self.overflow_in = 0
        self.job_batches = 0
        self._handed: list[float] = []  # when each batch handed to a peer starts there
        self.jobs: SimJobs | None = None  # where refused requests that can wait go
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._warm_up()
        self.batcher = planned(self.batcher, self.settings)
        reach = SimReach(self, self.overflow) if self.overflow is not None else None
        self.admission = Admission(AdmissionConfig.from_settings(self.settings), self.batcher,
                                   self.loop.time(), reach=reach)
        self.task = asyncio.create_task(self.batcher.run(), name=f"sim-batcher-{self.index}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def _warm_up(self) -> None:
        """Seed the batch-time predictor exactly as the runtime does, with profiled times."""
        seed_batch_times(self.batcher, self.settings.warmup_batches, self.draw)

    def draw(self, length: int, size: int) -> float:
        """Seconds a batch of ``size`` padded to ``length`` runs for (profiled, noised)."""
        seconds = self.latency.seconds(length, size)
        if self.noise:
            sigma = self.latency.sigma(length, size)
            if sigma > 0:
                seconds *= math.exp(self.rng.gauss(0.0, sigma))
        return seconds

    # -- the request side: Runtime.infer and _await_items, for one instance --------

    def arrive(self, index: int, priority: int, length: int, deadline_s: float,
               can_wait: bool = False) -> None:
        loop, batcher = self.loop, self.batcher
        now = loop.time()
        deadline = now + deadline_s
        bucket = batcher.bucket_of(length)
        try:
            costs = self.admission.admit(priority, (bucket,), deadline, now)
        except VegaError as error:
            if can_wait and self.jobs is not None and error.code in LOAD_REFUSALS:
                self.jobs.submit(self.index, index, priority, length, error.code, now)
            else:
                self.requests.finish(index, error.code, now, error)
            return
        item = Item(sample=None, length=length, priority=priority,
                    deadline=deadline, future=loop.create_future(), bucket=bucket, cost=costs[0])
        entry = _Open(index, item)
        self.open += 1
        self.requests.opened()
        batcher.enqueue(item)
        item.future.add_done_callback(lambda _f: self._answered(entry))
        entry.timer = loop.call_at(deadline, self._expired, entry)

    def _answered(self, entry: _Open) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        future = entry.item.future
        if future.cancelled():
            return  # given up at its deadline: _expired recorded it
        error = future.exception()
        refusal = error if isinstance(error, VegaError) else None
        if error is None:
            outcome = "ok"
        else:
            outcome = refusal.code if refusal is not None else "model_error"
        self._close(entry, outcome, refusal)

    def _expired(self, entry: _Open) -> None:
        entry.timer = None
        if entry.item.future.cancel():  # as _await_items does once the deadline passes
            self._close(entry, "deadline_exceeded")

    def _close(self, entry: _Open, outcome: str, error: VegaError | None = None) -> None:
        self.open -= 1
        self.requests.process[entry.index] = self.index
        self.requests.finish(entry.index, outcome, self.loop.time(), error)
        self.requests.closed()

    # -- the executor stand-in ------------------------------------------------------

    def booked_s(self, now: float) -> float:
        """How long until one of this process's executor threads is free."""
        return max(0.0, min(self.free_at) - now)

    async def _sink(self, batch: Batch) -> None:
        loop = self.loop
        now = loop.time()
        runner, delay = self, 0.0
        job = batch.items[0].priority == JOB
        self.job_batches += job
        peer = None if job else self._thief(now)  # jobs move as jobs, not as batches
        if peer is not None:
            runner, delay = peer, self.overflow.transport_s if self.overflow else 0.0
            self.overflow_out += 1
            peer.overflow_in += 1
        seconds = self.draw(batch.pad_to, batch.size)
        finish = runner.book(now + delay / 2, seconds) + delay / 2
        if runner is not self:
            self._handed.append(finish - delay / 2 - seconds)
        batch.infer_s = seconds
        self.ran_batch(batch.size, batch.padding_ratio)
        done: asyncio.Future[None] = loop.create_future()
        loop.call_at(finish, _resolve, batch, done)
        await done

    def ran_batch(self, size: int, padding_ratio: float) -> None:
        self.batches += 1
        self.sizes.append(size)
        self.padding.append(padding_ratio)

    def _thief(self, now: float) -> SimProcess | None:
        """The peer a formed batch goes to, as Streams.worth_handing_off and the thieves
        decide: the wait here passes the round trip (and the threshold), a peer with no
        work of its own is there to steal, and fewer batches wait than peers lend."""
        overflow = self.overflow
        if overflow is None or self.booked_s(now) <= overflow.rtt_s + overflow.after_s:
            return None
        idle = [p for p in overflow.peers if p is not self and p.batcher.depth() == 0]
        if not idle or self.handed_waiting() >= PENDING_PER_SPARE * sum(
                p.batcher.spare_threads for p in idle):
            return None
        peer = min(idle, key=lambda p: p.booked_s(now))
        return peer if peer.booked_s(now) + overflow.transport_s < self.booked_s(now) else None

    def handed_waiting(self) -> int:
        """Batches handed to peers that have not started there yet."""
        now = self.loop.time()
        self._handed = [start for start in self._handed if start > now]
        return len(self._handed)

    def book(self, ready_at: float, seconds: float) -> float:
        """Queue ``seconds`` of work on the first free thread (FIFO pool); return its end."""
        thread = min(range(len(self.free_at)), key=self.free_at.__getitem__)
        end = max(ready_at, self.free_at[thread]) + seconds
        self.free_at[thread] = end
        return end


def _resolve(batch: Batch, done: asyncio.Future[None]) -> None:
    # executor._resolve for a batch that succeeded; outputs are not simulated.
    for item in batch.items:
        if not item.future.done():
            item.infer_s = batch.infer_s
            item.future.set_result(None)
    if not done.done():
        done.set_result(None)
