"""``vega bench`` / ``scripts/bench``: the command that drives a server and reports on it.

It turns the options (``vega.lab.traffic``: flags, spec file, defaults) into arrivals
and pre-encoded requests, runs them through the engine (``vega.lab.engine``: open or
closed loop over keep-alive connections), polls GET /v1/status for queue depth and
reads /metrics before and after for the batch histograms meanwhile, follows the jobs
that requests which can wait (``--can-wait``) became (``vega.lab.jobs``) until they end,
and at the end writes report.json (``vega.lab.report``) and PNG plots
(``vega.lab.plots``) and prints a summary. ``configure(parser)`` adds the options,
``run(args)`` runs one bench (exit 0; 1 when nothing was answered; 2 for bad options);
``python -m vega.lab.loadgen --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from vega.lab import report as rep
from vega.lab import traffic
from vega.lab.client import Target, encode_kinds, http_get
from vega.lab.engine import Engine, offer, run_loop, settle
from vega.lab.jobs import JobPoller
from vega.lab.plots import write_plots
from vega.lab.traffic import (
    OPTIONS,
    PRIORITIES,
    TrafficError,
    parse_bool,
    parse_deadlines,
    resolve,
)
from vega.outpath import unwritable

EXIT_NO_ANSWER = 1
EXIT_USAGE = 2


# --- command line -------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the bench options to ``parser`` (defaults are applied by ``run``)."""
    for o in OPTIONS:
        text = o.help + ("" if o.default is None else f" (default {o.default})")
        if o.name == "url":
            parser.add_argument("url", nargs="?", default=None, help=text)
        elif o.type is parse_bool:
            parser.add_argument("--" + o.name.replace("_", "-"), dest=o.name, default=None,
                                action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument("--" + o.name.replace("_", "-"), dest=o.name, default=None,
                                type=o.type, choices=o.choices, help=text)
    from vega.lab import callers  # --callers N: closed-loop callers on vega.client
    callers.configure(parser)


# --- side channels: /v1/status and /metrics ----------------------------------------

def depth_snapshot(t: float, status: dict[str, Any]) -> dict[str, Any]:
    depth = dict.fromkeys(PRIORITIES, 0)
    inflight = 0
    for model in status.get("models", {}).values():
        for p, n in model.get("depth", {}).items():
            depth[p] = depth.get(p, 0) + int(n)
        inflight += int(model.get("inflight_batches", 0))
    return {"t": t, "depth": depth, "inflight_batches": inflight}


async def poll_status(engine: Engine, every_s: float, out: list[dict[str, Any]]) -> None:
    """Queue depth per class from /v1/status until the run stops; stops on a 404."""
    # Checks ``stopping`` as well as being cancelled: Python 3.11's wait_for (in
    # http_get) can swallow a cancel that lands as its call completes, and this loop
    # then polled on for ever while the run waited for it (seen once in bench_core).
    while not engine.stopping:
        t = time.perf_counter() - engine.start
        try:
            status, body = await http_get(engine.target, "/v1/status", max(1.0, every_s))
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
            status, body = 0, b""
        if status == 200:
            out.append(depth_snapshot(t, orjson.loads(body)))
        elif status == 404:
            return
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - engine.start - t)))


async def read_metrics(target: Target) -> str | None:
    try:
        status, body = await http_get(target, "/metrics")
    except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
        return None
    text = body.decode(errors="replace")
    # A target that is not Vega (a proxy's page) gets a report without the metrics parts.
    return text if status == 200 and rep.prometheus_text(text) else None


def batch_distributions(before: str | None, after: str | None
                        ) -> dict[str, rep.Distribution] | None:
    if before and after and any(created(after).get(series, t) != t
                                for series, t in created(before).items()):
        return None  # two processes (behind a proxy) or a restart: no difference is the run's
    out = {}
    for key, name in (("size", "vega_batch_size"), ("padding", "vega_batch_padding_ratio")):
        delta = rep.distribution_delta(
            rep.prometheus_histogram(before, name) if before else None,
            rep.prometheus_histogram(after, name) if after else None)
        if delta is not None:
            out[key] = delta
    return out or None


def created(text: str) -> dict[str, str]:
    """When the process that wrote ``text`` made each batch histogram: which life it is."""
    return dict(re.findall(r"^vega_batch_size_created(\S*) (\S+)$", text, re.M))


# --- progress ----------------------------------------------------------------------

async def ticker(engine: Engine, total_s: float, show: bool,
                 poller: JobPoller | None = None) -> None:
    """Every 0.25 s: expire timed-out requests; redraw the progress bar when shown."""
    while True:
        await asyncio.sleep(0.25)
        engine.expire()
        if show:
            sys.stderr.write("\r" + progress_line(engine, total_s, poller))
            sys.stderr.flush()


def progress_line(engine: Engine, total_s: float, poller: JobPoller | None = None) -> str:
    elapsed = time.perf_counter() - engine.start
    frac = min(1.0, elapsed / total_s) if total_s > 0 else 1.0
    bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
    return (f"[{bar}] {elapsed:5.1f}/{total_s:.0f}s sent {engine.sent} "
            f"answered {engine.done} inflight {engine.inflight} backlog {len(engine.backlog)} "
            f"conns {len(engine.conns)}"
            + (f" jobs {len(poller.jobs)} open {poller.open}" if poller else "") + "   ")


# --- one run -----------------------------------------------------------------------

async def bench(options: dict[str, Any]) -> dict[str, Any]:
    """Run one bench from resolved options; returns the report."""
    rng = np.random.default_rng(options["seed"])
    target = Target.parse(options["url"], options["path"], options["uds"], options["token"])
    deadlines = parse_deadlines(str(options["deadline_ms"]))
    closed = options["mode"] == "closed"
    if closed:
        mix = traffic.parse_mix(options["mix"])
        lengths = traffic.parse_lengths(options["lengths"])
        pri, lens = traffic.draw(65536, mix, lengths, rng)
        total_s = float(options["duration_s"])
    else:
        arrivals = traffic.plan(options, rng)
        pri, lens = arrivals.priority, arrivals.length
        total_s = float(arrivals.t_s[-1]) if len(arrivals) else 0.0
    share = float(options["can_wait"])
    waits = traffic.can_wait(len(pri), share, options["seed"])
    shapes = list(zip(lens.tolist(), pri.tolist(), waits.tolist()))
    kinds = encode_kinds(target, set(shapes), deadlines, rng)
    sequence = [kinds[shape] for shape in shapes]
    engine = Engine(target, rep.Tally(rep.auto_bin_s(total_s + 1.0)),
                    options["max_connections"], options["timeout_s"], closed=closed,
                    limit=options["requests"] if closed else None,
                    honor_retry_after=bool(options["honor_retry_after"]))
    if closed:
        cycle = itertools.cycle(sequence)
        engine.next_kind = lambda: next(cycle)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def interrupted() -> None:
        engine.stopping = True
        stop.set()

    with contextlib.suppress(RuntimeError, NotImplementedError, ValueError):
        loop.add_signal_handler(signal.SIGINT, interrupted)
    before = await read_metrics(target) if options["metrics"] else None
    snapshots: list[dict[str, Any]] = []
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    engine.start = time.perf_counter()
    poller = None
    if share > 0:
        poller = JobPoller(target, engine.start, share, options["job_ttl_s"],
                           options["drain_s"], options["timeout_s"])
        engine.on_accepted = poller.accepted
    show = options["progress"] if options["progress"] is not None else sys.stderr.isatty()
    side = [asyncio.ensure_future(ticker(engine, total_s, show, poller))]
    if options["poll_s"] > 0:
        side.append(asyncio.ensure_future(poll_status(engine, options["poll_s"], snapshots)))
    for _ in range(options["connections"]):
        engine.open()
    try:
        if closed:
            while (time.perf_counter() - engine.start < total_s and not engine.stopping
                   and (engine.limit is None or engine.sent < engine.limit)):
                await asyncio.sleep(0.05)
        else:
            await offer(engine, arrivals.t_s.tolist(), sequence)
        await settle(engine, options["drain_s"], stop)
        if poller is not None:
            await poller.wait(stop)
    finally:
        engine.stopping = True
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        loop.remove_signal_handler(signal.SIGINT)
        if show:
            sys.stderr.write("\r" + progress_line(engine, total_s, poller) + "\n")
    elapsed = time.perf_counter() - engine.start
    after = await read_metrics(target) if options["metrics"] else None
    meta = {k: v for k, v in options.items() if k != "token"} | {  # a secret stays out
        "started_at": started_at, "elapsed_s": round(elapsed, 3), "load_s": round(total_s, 3)}
    if closed:
        for k in ("profile", "process", "rate", "ramp_to", "steps", "burst_factor",
                  "burst_at_s", "burst_s", "trace", "trace_speed", "max_connections"):
            meta.pop(k, None)
    report = rep.build_report(engine.tally, snapshots=snapshots, meta=meta,
                              batches=batch_distributions(before, after))
    report["client"] = vars(engine.stats) | {"timeout_s": options["timeout_s"]}
    if poller is not None:
        report["jobs"] = poller.summary(total_s)
    return report


def run(args: argparse.Namespace) -> int:
    """Run one bench from parsed ``args``; writes report.json and plots, prints a summary."""
    if getattr(args, "callers", None) is not None:
        from vega.lab import callers
        return callers.run(args)
    try:
        options = resolve(vars(args))
        Target.parse(options["url"], options["path"], options["uds"])
    except (TrafficError, OSError, ValueError) as exc:
        print(f"vega bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(options["out"] or "out/bench-" + datetime.datetime.now().strftime(
        "%Y%m%d-%H%M%S"))
    problem = unwritable(out, directory=True)
    if problem is not None:
        print(f"vega bench: --out: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report = run_loop(bench(options))
    except (TrafficError, OSError) as exc:
        print(f"vega bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    files = [rep.write_json(report, out / "report.json")]
    if options["plots"]:
        files += write_plots(report, out)
    print(rep.format_summary(report))
    client = report["client"]
    if client["late_sends"] > 0.01 * max(1, report["summary"]["sent"]):
        print(f"warning: the generator fell behind: {client['late_sends']} sends over 10 ms "
              f"late (worst {client['max_send_lag_ms']:.0f} ms, client backlog up to "
              f"{client['max_backlog']}); latencies include that wait", file=sys.stderr)
    print("wrote " + ", ".join(str(f) for f in files))
    summary = report["summary"]
    if summary["counts_by_status"].get("401"):
        print("warning: answered 401: the server wants a bearer token (--token, or the "
              "VEGA_BENCH_TOKEN environment variable)", file=sys.stderr)
    return EXIT_NO_ANSWER if summary["sent"] and not summary["answered"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vega bench", description="Open- and closed-loop load generator for Vega "
        "(see docs/bench.md)")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
