"""``vega simulate``: the real admission and batcher on a virtual clock.

One simulated process is Vega's own ``Batcher`` and ``Admission``, built from the
same settings as ``Runtime`` builds them, running on ``simclock.VirtualEventLoop``.
Only the executor is replaced: a batch "runs" for the time the profiled latency
model gives for its (padded length, size) and then has its futures resolved as
``executor._resolve`` does, with ``batch.infer_s`` set so the batcher's measured
batch times and service rate move as they do in a real process. Requests follow
``Runtime.infer``: admit, build the item, enqueue, wait until answered or until
the deadline, then give the item up. Arrivals are the load generator's own
(``vega.lab.traffic``), and the report and plots are ``vega.lab.report``'s.

Several processes (``--processes N``) share arrivals as Nginx ``least_conn`` would
(fewest open requests, ties in turn), or all go to the first (``--to-first``). With
``--overflow-ms`` the processes overflow to each other by the rule Vega's does (rule 11):
admission shares the work ahead with the threads peers with no work of their own can
lend, and a formed batch goes to such a peer once the wait here passes
``--steal-rtt-ms`` plus the threshold, two waiting at most per lent thread. That is a
model of the Redis Streams overflow, not its code.

What is not modelled: HTTP parsing and JSON decoding (requests carry lengths
only), the CPU the event loop itself takes from the model, network time, and
model failures. Requests have one instance each.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vega.admission import Admission, AdmissionConfig
from vega.batcher import Batcher, BatcherConfig
from vega.config import ConfigError, Settings, load_settings
from vega.errors import STATUS_BY_CODE, VegaError
from vega.lab import simclock
from vega.lab.profile import LatencyModel
from vega.records import PRIORITY_NAMES, Batch, Item
from vega.streams import PENDING_PER_SPARE
from vega.warmup import planned, seed_batch_times

EXIT_CONFIG = 2

# Outcome codes of simulated requests, stored as small ints per request.
OUTCOMES = ("ok", "rate_limited", "queue_full", "shed", "deadline_unmeetable",
            "deadline_exceeded", "model_error")
_OUTCOME_INDEX = {name: index for index, name in enumerate(OUTCOMES)}
PENDING = -1


# -- one simulated process -----------------------------------------------------------

class Requests:
    """Per-request results, one slot per arrival: outcome, process, and finish time."""

    def __init__(self, t_s: Sequence[float]) -> None:
        self.t_s = t_s
        n = len(t_s)
        self.outcome = [PENDING] * n
        self.process = [0] * n
        self.done_s = [0.0] * n
        self.open = 0
        self.all_sent = False
        self.quiet: asyncio.Future[None] | None = None

    def opened(self) -> None:
        self.open += 1

    def closed(self) -> None:
        self.open -= 1
        self.check_quiet()

    def check_quiet(self) -> None:
        """Resolve ``quiet`` once every arrival was sent and every admitted one answered."""
        if self.all_sent and self.open == 0 and self.quiet is not None \
                and not self.quiet.done():
            self.quiet.set_result(None)

    def finish(self, index: int, outcome: str, now: float) -> None:
        self.outcome[index] = _OUTCOME_INDEX[outcome]
        self.done_s[index] = now


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
                                              hands_off=overflow is not None), self._sink)
        self.admission = Admission(AdmissionConfig.from_settings(settings), self.batcher, loop.time())
        self.free_at = [loop.time()] * settings.executor_threads  # per executor thread
        self.open = 0  # admitted requests not yet answered (least_conn counts these)
        self.batches = 0
        self.sizes: list[int] = []
        self.padding: list[float] = []
        self.overflow_out = 0
        self.overflow_in = 0
        self._handed: list[float] = []  # when each batch handed to a peer starts there
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
        seed_batch_times(self.batcher, self.settings.warmup_batches, self._draw)

    def _draw(self, length: int, size: int) -> float:
        seconds = self.latency.seconds(length, size)
        if self.noise:
            sigma = self.latency.sigma(length, size)
            if sigma > 0:
                seconds *= math.exp(self.rng.gauss(0.0, sigma))
        return seconds

    # -- the request side: Runtime.infer and _await_items, for one instance --------

    def arrive(self, index: int, priority: int, length: int, deadline_s: float) -> None:
        loop, batcher = self.loop, self.batcher
        now = loop.time()
        deadline = now + deadline_s
        bucket = batcher.bucket_of(length)
        try:
            costs = self.admission.admit(priority, (bucket,), deadline, now)
        except VegaError as error:
            self.requests.finish(index, error.code, now)
            return
        item = Item(model=batcher.config.model, sample=None, length=length, priority=priority,
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
        if error is None:
            outcome = "ok"
        else:
            outcome = error.code if isinstance(error, VegaError) else "model_error"
        self._close(entry, outcome)

    def _expired(self, entry: _Open) -> None:
        entry.timer = None
        if entry.item.future.cancel():  # as _await_items does once the deadline passes
            self._close(entry, "deadline_exceeded")

    def _close(self, entry: _Open, outcome: str) -> None:
        self.open -= 1
        self.requests.finish(entry.index, outcome, self.loop.time())
        self.requests.process[entry.index] = self.index
        self.requests.closed()

    # -- the executor stand-in ------------------------------------------------------

    def booked_s(self, now: float) -> float:
        """How long until one of this process's executor threads is free."""
        return max(0.0, min(self.free_at) - now)

    async def _sink(self, batch: Batch) -> None:
        loop = self.loop
        now = loop.time()
        runner, delay = self, 0.0
        peer = self._thief(now)
        if peer is not None:
            runner, delay = peer, self.overflow.transport_s if self.overflow else 0.0
            self.overflow_out += 1
            peer.overflow_in += 1
        seconds = self._draw(batch.pad_to, batch.size)
        finish = runner.book(now + delay / 2, seconds) + delay / 2
        if runner is not self:
            self._handed.append(finish - delay / 2 - seconds)
        batch.infer_s = seconds
        self.batches += 1
        self.sizes.append(batch.size)
        self.padding.append(batch.padding_ratio)
        done: asyncio.Future[None] = loop.create_future()
        loop.call_at(finish, _resolve, batch, done)
        await done

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


# -- the run -----------------------------------------------------------------------

@dataclass
class SimOptions:
    settings: Settings
    latency: LatencyModel
    processes: int = 1
    deadlines_s: dict[str, float] | None = None  # by class; None: VEGA_DEFAULT_DEADLINE_MS
    seed: int = 0
    noise: bool = True
    snapshot_s: float = 0.1
    overflow_after_ms: float | None = None
    steal_rtt_ms: float = 2.0
    to_first: bool = False  # every arrival to the first process (skewed, no balancer)
    transport_ms: float = 2.0  # Redis's part of the round trip


@dataclass
class SimResult:
    t_s: Sequence[float]
    priority: Sequence[int]
    length: Sequence[int]
    requests: Requests
    snapshots: list[dict[str, Any]]
    processes: list[dict[str, Any]]
    virtual_s: float
    wall_s: float
    process_objects: list[SimProcess]


def simulate(options: SimOptions, t_s: Sequence[float], priority: Sequence[int],
             length: Sequence[int]) -> SimResult:
    """Run the arrivals through the simulated process(es); return every request's fate."""
    started = time.perf_counter()
    result = simclock.run(_main(options, t_s, priority, length))
    result.wall_s = time.perf_counter() - started
    return result


async def _main(options: SimOptions, t_s: Sequence[float], priority: Sequence[int],
                length: Sequence[int]) -> SimResult:
    loop = asyncio.get_running_loop()
    requests = Requests(t_s)
    rng = random.Random(options.seed)
    settings = options.settings
    overflow = None
    if options.overflow_after_ms is not None and options.processes > 1:
        overflow = Overflow(options.overflow_after_ms / 1000, options.steal_rtt_ms / 1000,
                            min(options.steal_rtt_ms, options.transport_ms) / 1000)
    procs = [SimProcess(i, settings, options.latency, requests, rng, options.noise, overflow)
             for i in range(options.processes)]
    if overflow is not None:
        overflow.peers.extend(procs)
    for proc in procs:
        proc.start()
    deadlines = deadlines_by_class(options)
    snapshots: list[dict[str, Any]] = []
    sampler = _Sampler(loop, procs, snapshots, options.snapshot_s)
    sampler.tick()
    try:
        await _drive(loop, procs[:1] if options.to_first else procs, requests, priority,
                     length, deadlines)
    finally:
        sampler.stop()
        for proc in procs:
            await proc.stop()
    return SimResult(t_s, priority, length, requests, snapshots,
                     [_process_summary(p) for p in procs], loop.time(), 0.0, procs)


async def _drive(loop: asyncio.AbstractEventLoop, procs: list[SimProcess], requests: Requests,
                 priority: Sequence[int], length: Sequence[int], deadlines: list[float]) -> None:
    """Hand each arrival to a process at its time (least_conn), then wait for every answer."""
    t_s = requests.t_s
    n = len(t_s)
    requests.quiet = loop.create_future()
    position = 0
    turn = 0

    def pick() -> SimProcess:
        nonlocal turn
        if len(procs) == 1:
            return procs[0]
        least = min(p.open for p in procs)
        for step in range(len(procs)):
            proc = procs[(turn + step) % len(procs)]
            if proc.open == least:
                turn = (proc.index + 1) % len(procs)
                return proc
        raise AssertionError("unreachable")

    def arrivals() -> None:
        nonlocal position
        now = loop.time()
        while position < n and t_s[position] <= now:
            p = priority[position]
            pick().arrive(position, p, length[position], deadlines[p])
            position += 1
        if position < n:
            loop.call_at(t_s[position], arrivals)
        else:
            requests.all_sent = True
            requests.check_quiet()

    if n == 0:
        return
    loop.call_at(t_s[0], arrivals)
    await requests.quiet


class _Sampler:
    """Queue depth per class, in-flight batches and service rate, every ``every_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, procs: list[SimProcess],
                 out: list[dict[str, Any]], every_s: float) -> None:
        self.loop, self.procs, self.out, self.every_s = loop, procs, out, every_s
        self._timer: asyncio.TimerHandle | None = None

    def tick(self) -> None:
        now = self.loop.time()
        depth = {name: sum(p.batcher.depth(i) for p in self.procs)
                 for i, name in enumerate(PRIORITY_NAMES)}
        self.out.append({"t": now, "depth": depth,
                         "inflight_batches": sum(p.batcher.inflight for p in self.procs),
                         "service_rate": sum(p.batcher.rate.items_per_s for p in self.procs),
                         "backlog_ms": max(1000 * p.batcher.backlog_s() for p in self.procs)})
        self._timer = self.loop.call_later(self.every_s, self.tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


def _process_summary(proc: SimProcess) -> dict[str, Any]:
    return {"process": proc.index, "batches": proc.batches,
            "overflow_out": proc.overflow_out, "overflow_in": proc.overflow_in,
            "service_rate_items_per_s": round(proc.batcher.rate.items_per_s, 1)}


# -- the report: vega.lab.report's, as the load generator writes it ---------------------

def build(result: SimResult, options: SimOptions,
          meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The load generator's report (``vega.lab.report.build_report``) for a simulated run."""
    from vega.lab.report import Record, Tally, auto_bin_s, build_report, distribution
    from vega.metrics import RATIO_BUCKETS, SIZE_BUCKETS

    requests = result.requests
    duration_s = max(result.virtual_s, 1e-9)
    tally = Tally(auto_bin_s(duration_s))
    deadlines = deadlines_by_class(options)
    statuses = [STATUS_BY_CODE.get(name, 200) for name in OUTCOMES]
    reasons = [("" if name == "ok" else name) for name in OUTCOMES]
    for t, outcome, done, prio in zip(requests.t_s, requests.outcome, requests.done_s,
                                      result.priority):
        tally.add(Record(t, done - t, statuses[outcome], reasons[outcome],
                         PRIORITY_NAMES[prio], deadlines[prio]))
    procs = result.process_objects
    batches = {"size": distribution((n for p in procs for n in p.sizes), SIZE_BUCKETS),
               "padding": distribution((r for p in procs for r in p.padding), RATIO_BUCKETS)}
    s = options.settings
    settings = {spec: getattr(s, spec) for spec in TUNED}
    report = build_report(tally, snapshots=result.snapshots, batches=batches,
                          duration_s=duration_s, meta={
                              "mode": "simulate", "model": options.latency.model,
                              "processes": options.processes, "seed": options.seed,
                              "noise": options.noise,
                              "overflow_after_ms": options.overflow_after_ms,
                              "steal_rtt_ms": options.steal_rtt_ms,
                              "settings": {k: list(v) if isinstance(v, tuple) else v
                                           for k, v in settings.items()},
                              "wall_s": round(result.wall_s, 3),
                              "virtual_s": round(result.virtual_s, 3),
                              "per_process": result.processes, **(meta or {})})
    return report


# Settings that change what the simulator does; copied into the report's meta.
TUNED = ("max_batch_size", "max_wait_ms", "length_buckets", "max_inflight_batches",
         "executor_threads", "queue_capacity", "shed_watermark", "normal_watermark",
         "rate_limit", "burst", "default_deadline_ms", "max_deadline_ms",
         "deadline_margin_ms", "codel_interval_ms", "warmup_batches")


# -- the command ---------------------------------------------------------------------

# The load generator's options that mean the same here: the same spec file or flags
# give the same arrivals (same seed) to ``vega bench`` and ``vega simulate``.
TRAFFIC_OPTIONS = ("spec", "profile", "process", "rate", "duration_s", "requests", "ramp_to",
                   "steps", "burst_factor", "burst_at_s", "burst_s", "trace", "trace_speed",
                   "mix", "lengths", "deadline_ms", "seed", "out", "plots")


def configure(parser: argparse.ArgumentParser) -> None:
    from vega.lab.traffic import BY_NAME, parse_bool

    parser.add_argument("--latency", required=True, metavar="FILE",
                        help="latency profile written by `vega profile`")
    parser.add_argument("--env-file", help="systemd EnvironmentFile with VEGA_* settings")
    parser.add_argument("--set", action="append", default=[], metavar="VEGA_X=VALUE",
                        help="override a setting for this run (repeatable)")
    traffic = parser.add_argument_group("traffic (the load generator's options)")
    for name in TRAFFIC_OPTIONS:
        o = BY_NAME[name]
        text = o.help + ("" if o.default is None else f" (default {o.default})")
        flag = "--" + name.replace("_", "-")
        if o.type is parse_bool:
            traffic.add_argument(flag, dest=name, default=None,
                                 action=argparse.BooleanOptionalAction, help=text)
        else:
            traffic.add_argument(flag, dest=name, default=None, type=o.type, choices=o.choices,
                                 help=text)
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--processes", type=int, default=1, help="Vega processes behind least_conn")
    sim.add_argument("--overflow-ms", type=float,
                     help="overflow between the processes on, with this VEGA_OVERFLOW_THRESHOLD_MS: "
                          "a batch goes to an idle peer once the wait here passes the round "
                          "trip by this much (0 is the default setting)")
    sim.add_argument("--steal-rtt-ms", type=float, default=2.0,
                     help="round trip of a batch handed to a peer as the origin measures it, "
                          "waits at the thief included (vega_steal_rtt_seconds; default 2)")
    sim.add_argument("--steal-transport-ms", type=float, default=2.0,
                     help="Redis's part of that round trip (default 2)")
    sim.add_argument("--to-first", action="store_true",
                     help="send every request to the first process (the others only steal)")
    sim.add_argument("--no-noise", action="store_true",
                     help="every batch takes its profiled p50 (default: log-normal p50/p90)")
    sim.add_argument("--snapshot-ms", type=float, default=100.0,
                     help="queue depth sampled this often, in virtual time (default 100)")


def run(args: argparse.Namespace) -> int:
    from vega.lab import traffic
    from vega.lab.report import format_summary, write_json, write_plots
    from vega.lab.traffic import parse_deadlines, resolve

    try:
        traffic_options = resolve(vars(args))
        overrides = dict(_pair(raw) for raw in args.set)
        settings = load_settings(env_file=args.env_file, overrides=overrides)
        latency = LatencyModel.from_file(args.latency)
        if args.processes < 1:
            raise ValueError(f"--processes={args.processes}: expected >= 1")
        seed = traffic_options["seed"] if traffic_options["seed"] is not None else 0
        options = SimOptions(settings, latency, processes=args.processes,
                             deadlines_s=parse_deadlines(str(traffic_options["deadline_ms"])),
                             seed=seed, noise=not args.no_noise,
                             snapshot_s=args.snapshot_ms / 1000,
                             overflow_after_ms=args.overflow_ms, steal_rtt_ms=args.steal_rtt_ms,
                             to_first=args.to_first, transport_ms=args.steal_transport_ms)
        arrivals = traffic.plan(traffic_options, np.random.default_rng(seed))
    except (ConfigError, ValueError, OSError, KeyError) as error:
        print(f"vega simulate: {error}", file=sys.stderr)
        return EXIT_CONFIG
    result = simulate(options, arrivals.t_s.tolist(), arrivals.priority.tolist(),
                      arrivals.length.tolist())
    report = build(result, options, meta={k: traffic_options[k] for k in TRAFFIC_OPTIONS
                                          if k not in ("out", "plots", "spec")})
    out = Path(traffic_options["out"] or "out/simulate")
    write_json(report, out / "report.json")
    if traffic_options["plots"]:
        write_plots(report, out)
    print(format_summary(report))
    print(f"simulated {len(arrivals)} requests, {result.virtual_s:.1f} s of virtual time, "
          f"in {result.wall_s:.1f} s of wall time; report in {out}/")
    return 0


def deadlines_by_class(options: SimOptions) -> list[float]:
    """Each class's deadline in seconds, capped at VEGA_MAX_DEADLINE_MS as the server caps it."""
    s = options.settings
    given = options.deadlines_s or {}
    return [min(given.get(name, s.default_deadline_ms / 1000), s.max_deadline_ms / 1000)
            for name in PRIORITY_NAMES]


def _pair(raw: str) -> tuple[str, str]:
    key, sep, value = raw.partition("=")
    if not sep or not key.startswith("VEGA_"):
        raise ValueError(f"--set {raw!r}: expected VEGA_NAME=VALUE")
    return key.strip(), value.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vega simulate",
                                     description="Vega's admission and batcher on a virtual clock")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
