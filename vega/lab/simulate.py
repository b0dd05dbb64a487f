"""``vega simulate``: a traffic profile replayed through the real policy code, in virtual time.

The arrivals are the load generator's own (``vega.lab.traffic``: the same spec file or
flags and seed give ``vega bench`` and ``vega simulate`` the same requests); each goes,
as Nginx ``least_conn`` would send it (fewest open requests, ties in turn) or all to
the first (``--to-first``), to one of ``--processes`` simulated processes
(``vega.lab.simproc``) on ``simclock``'s virtual loop, so a minute of load takes
seconds; the report and plots are the load generator's (``vega.lab.report``,
``vega.lab.plots``). Not modelled: HTTP parsing and JSON decoding (requests carry
lengths only), the CPU the event loop takes from the model, network time, and model
failures; requests have one instance each.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vega.config import ConfigError, Settings, load_settings
from vega.errors import STATUS_BY_CODE
from vega.lab import simclock
from vega.lab.profile import LatencyModel
from vega.lab.report import jobs_section
from vega.lab.simdrive import Closed, drive, drive_closed
from vega.lab.simjobs import SimJobs
from vega.lab.simproc import OUTCOMES, Overflow, Requests, SimProcess
from vega.lab.traffic import can_wait
from vega.outpath import unwritable
from vega.records import PRIORITY_NAMES

EXIT_CONFIG = 2


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
    # Share of arrivals that may become jobs (drawn as vega bench does); the job lane's
    # bound and a job's ttl are the settings' VEGA_JOBS_MAX_DEPTH and VEGA_JOBS_DEFAULT_TTL_S.
    can_wait: float = 0.0
    closed: Closed | None = None  # a closed loop instead of the arrivals given


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
    jobs: SimJobs | None  # the job lanes, with work that can wait


def simulate(options: SimOptions, t_s: list[float], priority: list[int],
             length: list[int]) -> SimResult:
    """Run the arrivals through the simulated process(es); return every request's fate.

    With ``options.closed`` the lists start empty and the callers fill them."""
    started = time.perf_counter()
    result = simclock.run(_main(options, t_s, priority, length))
    result.wall_s = time.perf_counter() - started
    return result


async def _main(options: SimOptions, t_s: list[float], priority: list[int],
                length: list[int]) -> SimResult:
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
    # With overflow, one job store for all (through Redis, any process runs any job).
    jobs = SimJobs(procs, requests, settings, shared=overflow is not None) \
        if options.can_wait > 0 else None
    waits = can_wait(len(t_s), options.can_wait, options.seed).tolist()
    deadlines = deadlines_by_class(options)
    snapshots: list[dict[str, Any]] = []
    sampler = _Sampler(loop, procs, snapshots, options.snapshot_s, jobs)
    sampler.tick()
    targets = procs[:1] if options.to_first else procs
    try:
        if options.closed is not None:
            await drive_closed(loop, options.closed, targets, requests, priority, length,
                                deadlines)
        else:
            await drive(loop, targets, requests, priority, length, deadlines, waits)
    finally:
        sampler.stop()
        if jobs is not None:
            jobs.stop()
        for proc in procs:
            await proc.stop()
    return SimResult(t_s, priority, length, requests, snapshots,
                     [_process_summary(p) for p in procs], loop.time(), 0.0, procs, jobs)


class _Sampler:
    """Queue depth per class, in-flight batches and service rate (and jobs waiting and
    done, with work that can wait), every ``every_s``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, procs: list[SimProcess],
                 out: list[dict[str, Any]], every_s: float, jobs: SimJobs | None) -> None:
        self.loop, self.procs, self.out, self.every_s = loop, procs, out, every_s
        self.jobs = jobs
        self._timer: asyncio.TimerHandle | None = None

    def tick(self) -> None:
        now = self.loop.time()
        depth = {name: sum(p.batcher.depth(i) for p in self.procs)
                 for i, name in enumerate(PRIORITY_NAMES)}
        self.out.append({"t": now, "depth": depth,
                         "inflight_batches": sum(p.batcher.inflight for p in self.procs),
                         "service_rate": sum(p.batcher.rate.items_per_s for p in self.procs),
                         "backlog_ms": max(1000 * p.batcher.backlog_s() for p in self.procs)})
        if self.jobs is not None:
            self.out[-1]["jobs_queued"] = self.jobs.waiting
            self.out[-1]["jobs_done"] = self.jobs.ends["done"]
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
    # The inline requests' span: a job lane draining after the load is reported apart.
    inline_s = requests.inline_done_s if result.jobs is not None else None
    duration_s = max(result.virtual_s if inline_s is None else inline_s, 1e-9)
    tally = Tally(auto_bin_s(duration_s))
    deadlines = deadlines_by_class(options)
    statuses = [202 if name == "accepted" else STATUS_BY_CODE.get(name, 200)
                for name in OUTCOMES]
    reasons = [("" if name in ("ok", "accepted") else name) for name in OUTCOMES]
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
    if result.jobs is not None:
        report["jobs"] = _jobs(result.jobs, result, options)
    return report


def _jobs(jobs: SimJobs, result: SimResult, options: SimOptions) -> dict[str, Any]:
    t_s = result.requests.t_s
    load_s = t_s[-1] if len(t_s) else 0.0
    return jobs_section(options.can_wait, jobs.accepted, jobs.ends, jobs.last_finished_s,
                        load_s, jobs.latency,
                        done_during_load=sum(1 for t in jobs.done_by if t <= load_s),
                        batches=sum(p.job_batches for p in result.process_objects),
                        lanes=jobs.stores, max_depth=options.settings.jobs_max_depth,
                        ttl_s=options.settings.jobs_default_ttl_s)


# Settings that change what the simulator does; copied into the report's meta.
TUNED = ("max_batch_size", "max_wait_ms", "length_buckets", "max_inflight_batches",
         "executor_threads", "queue_capacity", "shed_watermark", "normal_watermark",
         "rate_limit", "burst", "default_deadline_ms", "max_deadline_ms",
         "deadline_margin_ms", "codel_interval_ms", "warmup_batches")


# -- the command ---------------------------------------------------------------------

# The load generator's options that mean the same here: the same spec file or flags
# give the same arrivals (same seed) to ``vega bench`` and ``vega simulate``.
TRAFFIC_OPTIONS = ("spec", "mode", "profile", "process", "rate", "duration_s", "requests",
                   "ramp_to", "steps", "burst_factor", "burst_at_s", "burst_s", "trace",
                   "trace_speed", "connections", "honor_retry_after", "mix", "lengths",
                   "deadline_ms", "can_wait", "seed", "out", "plots")
DEFAULT_OUT = "out/simulate"  # one folder, overwritten: not the bench's dated ones


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
        if name == "out":
            text = f"output directory (default {DEFAULT_OUT})"
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
                     help="overflow between the processes on, with this "
                          "VEGA_OVERFLOW_THRESHOLD_MS: "
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
    sim.add_argument("--jobs-max-depth", type=int,
                     help="most jobs waiting, VEGA_JOBS_MAX_DEPTH for this run; past it a "
                          "request that can wait keeps its refusal (default: the setting)")
    sim.add_argument("--job-ttl-s", type=float,
                     help="how long a job waits to run before it expires, "
                          "VEGA_JOBS_DEFAULT_TTL_S for this run (default: the setting)")
    sim.add_argument("--round-trip-ms", type=float, default=1.0,
                     help="closed loop: from an answer to the caller's next request, HTTP "
                          "included (default 1)")
    sim.add_argument("--snapshot-ms", type=float, default=100.0,
                     help="queue depth sampled this often, in virtual time (default 100)")


def run(args: argparse.Namespace) -> int:
    from vega.lab import traffic
    from vega.lab.plots import write_plots
    from vega.lab.report import format_summary, write_json
    from vega.lab.traffic import parse_deadlines, resolve

    try:
        traffic_options = resolve(vars(args))
        overrides = dict(_pair(raw) for raw in args.set)
        for flag, name in (("jobs_max_depth", "VEGA_JOBS_MAX_DEPTH"),
                           ("job_ttl_s", "VEGA_JOBS_DEFAULT_TTL_S")):
            if getattr(args, flag) is not None:
                overrides[name] = str(getattr(args, flag))
        settings = load_settings(env_file=args.env_file, overrides=overrides)
        latency = LatencyModel.from_file(args.latency)
        if args.processes < 1:
            raise ValueError(f"--processes={args.processes}: expected >= 1")
        if not args.snapshot_ms > 0:  # the sampler would never move past its first instant
            raise ValueError(f"--snapshot-ms={args.snapshot_ms:g}: expected > 0")
        out = Path(traffic_options["out"] or DEFAULT_OUT)
        problem = unwritable(out, directory=True)
        if problem is not None:
            raise ValueError(f"--out: {problem}")
        seed = traffic_options["seed"] if traffic_options["seed"] is not None else 0
        options = SimOptions(settings, latency, processes=args.processes,
                             deadlines_s=parse_deadlines(str(traffic_options["deadline_ms"])),
                             seed=seed, noise=not args.no_noise,
                             snapshot_s=args.snapshot_ms / 1000,
                             overflow_after_ms=args.overflow_ms, steal_rtt_ms=args.steal_rtt_ms,
                             to_first=args.to_first, transport_ms=args.steal_transport_ms,
                             can_wait=traffic_options["can_wait"])
        options.closed = _closed(traffic_options, args.round_trip_ms, seed)
        t_s: list[float] = []  # a closed loop's callers fill these lists as they send
        priority: list[int] = []
        length: list[int] = []
        if options.closed is None:
            arrivals = traffic.plan(traffic_options, np.random.default_rng(seed))
            t_s, priority = arrivals.t_s.tolist(), arrivals.priority.tolist()
            length = arrivals.length.tolist()
        sent = options.closed.length if options.closed is not None else length
        if sent and not latency.min_length <= min(sent) <= max(sent) <= latency.max_length:
            raise ValueError(f"windows of {min(sent)}..{max(sent)} steps: the profile's model "
                             f"takes {latency.min_length}..{latency.max_length} (a server "
                             "answers 422); give --lengths within it")
    except (ConfigError, ValueError, OSError, KeyError) as error:
        print(f"vega simulate: {error}", file=sys.stderr)
        return EXIT_CONFIG
    result = simulate(options, t_s, priority, length)
    meta = {k: traffic_options[k] for k in TRAFFIC_OPTIONS
            if k not in ("out", "plots", "spec", "mode")}
    report = build(result, options, meta=meta | {"loop": traffic_options["mode"]})
    write_json(report, out / "report.json")
    if traffic_options["plots"]:
        write_plots(report, out)
    print(format_summary(report))
    print(f"simulated {len(result.t_s)} requests, {result.virtual_s:.1f} s of virtual time, "
          f"in {result.wall_s:.1f} s of wall time; report in {out}/")
    return 0


def _closed(options: dict[str, Any], round_trip_ms: float, seed: int) -> Closed | None:
    """The closed loop ``--mode closed`` asks for; None for an open loop."""
    from vega.lab import traffic

    if options["mode"] != "closed":
        return None
    if options["can_wait"] > 0:
        raise ValueError("--can-wait: the simulator's closed loop sends no work that can wait")
    if options["connections"] < 1 or round_trip_ms < 0:
        raise ValueError("--mode closed: expected --connections >= 1, --round-trip-ms >= 0")
    # The load generator's own draw, so the same seed sends the same classes and lengths.
    pool = traffic.draw(65536, traffic.parse_mix(str(options["mix"])),
                        traffic.parse_lengths(str(options["lengths"])),
                        np.random.default_rng(seed))
    return Closed(int(options["connections"]), float(options["duration_s"]),
                  pool[0].tolist(), pool[1].tolist(), bool(options["honor_retry_after"]),
                  round_trip_ms / 1000, int(options.get("requests") or 0))


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
