"""Benchmark of the async lane: a burst well over capacity, 30% of it able to wait.

    scripts/bench-jobs [--rounds 1] [--rate 1000] [--seconds 6] [--async-share 0.3]

The server runs the echo test model at a fixed cost per item (``TEST_PER_ITEM_MS``, 5 ms:
one executor thread, about 200 items/s), so capacity is small and known and the burst
(open loop, Poisson, 1000 requests/s of one item each for 6 s, the default priority mix,
1-s deadlines) is really several times over it on a 2-core machine. The load comes
from Vega's own engine (``vega.lab.engine``, raw keep-alive connections, latency from
each request's scheduled send) and its job poller (``vega.lab.jobs``), in this process.

Each round, on fresh processes:

1. one process (jobs in memory): the burst with no request able to wait, then, once it
   is quiet, the same burst (same seed) with ``--async-share`` sent with
   ``Prefer: respond-async``; each 202's job is followed until it ends. While the jobs
   drain, a light probe load (``--probe-rate``, none can wait) measures inline latency;
   once every job has ended the same probe runs again on the idle server.
2. two processes sharing a redis-server started here on a free port: the same pair of
   bursts, split between the two; jobs are polled through the second, and the first is
   SIGKILLed mid-drain (the job backlog between 0 and ``--kill-at`` of what it was at
   the burst's end, while the first holds claimed jobs); the survivor must finish them.

Predicted drain at the burst's end: the inline backlog (``backlog_ms``) plus the job
backlog (the largest ``jobs.depth`` in /v1/status over the second after the burst, as
items) over the measured service rate (``service_rate_items_per_s``, summed over the
processes), less what the probe takes. After the kill it is predicted again from the
backlog then, the survivor's rate and ``VEGA_CLAIM_IDLE_MS``. Exit 1 when a job is
lost or ended other than ``done``. Ratios come from one run; the load shares the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.infra import RedisServer  # noqa: E402
from tests.servers import VegaProcess  # noqa: E402
from vega.lab import report as rep  # noqa: E402
from vega.lab import traffic  # noqa: E402
from vega.lab.client import Target, encode_kinds, http_get  # noqa: E402
from vega.lab.engine import Engine, offer, settle  # noqa: E402
from vega.lab.hdr import Histogram  # noqa: E402
from vega.lab.jobs import JobPoller  # noqa: E402

MODEL = "echo"
ENV = {"VEGA_MODEL": f"python:tests.models:{MODEL}", "VEGA_CAPACITY_SAMPLE_S": "0.2"}
MIX = "sheddable=70,normal=25,critical=5"
LENGTH = 16
DEADLINE_MS = "1000"
CLAIM_IDLE_MS = 1000
SAMPLE_S = 0.2
JOB_WINDOW_S = 120.0  # the poller's patience: a job not ended by then is lost


# --- watching /v1/status --------------------------------------------------------------

class Watch:
    """Samples each live process's /v1/status every SAMPLE_S: job backlog, rates."""

    def __init__(self, urls: list[str]) -> None:
        self.live = {url: Target.parse(url, "/v1/infer", None) for url in urls}
        self.samples: list[dict[str, Any]] = []
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            for url, target in list(self.live.items()):
                try:
                    status, body = await http_get(target, "/v1/status", 2.0)
                except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
                    continue
                if status == 200:
                    model = orjson.loads(body)["models"][MODEL]
                    jobs = model["jobs"]
                    self.samples.append({
                        "t": time.perf_counter(), "url": url, "depth": jobs["depth"],
                        "held": jobs["held_here"], "rate": jobs["drain_rate_items_per_s"],
                        "backlog_ms": model["backlog_ms"],
                        "server_predicted_s": jobs["predicted_drain_s"]})
            await asyncio.sleep(SAMPLE_S)

    def latest(self, url: str) -> dict[str, Any] | None:
        return next((s for s in reversed(self.samples) if s["url"] == url), None)

    def backlog(self) -> int:
        """The job backlog now: the largest figure a live process reports (with Redis
        each reports the shared one)."""
        latest = [self.latest(url) for url in self.live]
        return max((int(s["depth"]) for s in latest if s is not None), default=0)

    async def predict(self, since: float, within_s: float, spare_s: float
                      ) -> dict[str, Any]:
        """Drain predicted from the samples in [since, since+within_s]: inline backlog plus
        the largest job backlog, over the processes' summed job drain rate (the service
        rate at job batches' size) less ``spare_s`` (items/s taken by other load)."""
        await until(since + within_s)
        for _ in range(100):  # a server too busy to answer in that second: its next sample
            if any(s["t"] >= since for s in self.samples):
                break
            await asyncio.sleep(0.05)
        window = [s for s in self.samples if since <= s["t"] <= since + within_s]
        if not window:
            window = [s for s in self.samples if s["t"] >= since][:len(self.live)]
        depth = max((int(s["depth"]) for s in window), default=0)
        rates: dict[str, float] = {}
        inline: dict[str, float] = {}
        for s in window:
            rates[s["url"]] = float(s["rate"])
            inline[s["url"]] = max(inline.get(s["url"], 0.0), float(s["backlog_ms"]) / 1000)
        rate = sum(rates.values())
        jobs_s = depth / max(1e-9, rate - spare_s)
        server = [s["server_predicted_s"] for s in window if s["depth"] == depth]
        return {"job_backlog": depth, "service_rate": round(rate, 1),
                "inline_backlog_s": round(max(inline.values(), default=0.0), 3),
                "jobs_s": round(jobs_s, 3),
                "predicted_s": round(max(inline.values(), default=0.0) + jobs_s, 3),
                "server_predicted_s": server[0] if server else None}


# --- open-loop load through Vega's engine -----------------------------------------------

async def open_loop(urls: list[str], rate: float, seconds: float, share: float, seed: int,
                    poll_url: str | None = None, during: Any = None,
                    pids: tuple[int, ...] = ()) -> dict[str, Any]:
    """``rate``/s for ``seconds`` (Poisson), arrivals dealt round-robin over ``urls``;
    ``share`` of them can wait, their jobs polled through ``poll_url``. ``during(start,
    load_end)`` (a coroutine function, times on perf_counter) runs from the last send
    until every job has ended; its result is returned under "during". ``pids``: the
    servers, whose CPU use over the burst is reported (as cores)."""
    rng = np.random.default_rng(seed)
    times = traffic.arrival_times(traffic.steady(rate, seconds), "poisson", rng)
    n = len(times)
    pri, lens = traffic.draw(n, traffic.parse_mix(MIX), {LENGTH: 1.0}, rng)
    waits = traffic.can_wait(n, share, seed)
    shapes = list(zip(lens.tolist(), pri.tolist(), waits.tolist()))
    deadlines = traffic.parse_deadlines(DEADLINE_MS)
    engines, plans = [], []
    for k, url in enumerate(urls):
        target = Target.parse(url, "/v1/infer", None)
        kinds = encode_kinds(target, set(shapes), deadlines, np.random.default_rng(seed))
        mine = range(k, n, len(urls))
        plans.append(([float(times[i]) for i in mine], [kinds[shapes[i]] for i in mine]))
        engines.append(Engine(target, rep.Tally(rep.auto_bin_s(seconds + 1.0)),
                              max_connections=2048, timeout_s=10.0))
    cpu = [cpu_s(pid) for pid in pids], time.process_time()
    start = time.perf_counter()
    poller = None
    if share > 0:
        poller = JobPoller(Target.parse(poll_url or urls[-1], "/v1/infer", None), start,
                           share, JOB_WINDOW_S, 10.0, 10.0)
    for engine in engines:
        engine.start = start
        if poller is not None:
            engine.on_accepted = poller.accepted
        for _ in range(128):
            engine.open()

    async def expire() -> None:
        while True:
            await asyncio.sleep(0.25)
            for engine in engines:
                engine.expire()

    ticker = asyncio.ensure_future(expire())
    try:
        await asyncio.gather(*(offer(e, t, k) for e, (t, k) in zip(engines, plans)))
        load_end = start + float(times[-1])
        wall = time.perf_counter() - start
        cores = [round((cpu_s(pid) - was) / wall, 2) for pid, was in zip(pids, cpu[0])]
        cores.append(round((time.process_time() - cpu[1]) / wall, 2))
        side = asyncio.ensure_future(during(start, load_end)) if during else None
        await asyncio.gather(*(settle(e, 15.0) for e in engines))
        if poller is not None:
            await poller.wait(asyncio.Event())
        extra = await side if side is not None else None
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
    ok, counts = Histogram(), dict[str, int]()
    late, lag = 0, 0.0
    for engine in engines:
        for h in engine.tally.latency_ok.values():
            ok.merge(h)
        for by_outcome in engine.tally.by_class.values():
            for label, count in by_outcome.items():
                counts[label] = counts.get(label, 0) + count
        late += engine.stats.late_sends
        lag = max(lag, engine.stats.max_send_lag_ms)
    out: dict[str, Any] = {"sent": n, "ok": ok.count, "outcomes": counts,
                           "p99_ms": round(ok.summary_ms().get("p99", float("nan"))),
                           "late_sends": late, "max_send_lag_ms": round(lag, 1),
                           "cores_servers_then_client": cores}
    if poller is not None:
        out["jobs"] = poller.summary(load_end - start)
        out["jobs"]["done_in_burst"] = sum(
            1 for job in poller.jobs if job.state == "done" and job.finished_s is not None
            and job.finished_s <= load_end - start)
    if extra is not None:
        out["during"] = extra
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used by process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def probe(url: str, rate: float, seconds: float, seed: int) -> dict[str, Any]:
    result = await open_loop([url], rate, seconds, 0.0, seed)
    return {"sent": result["sent"], "ok": result["ok"], "p99_ms": result["p99_ms"]}


async def until(when: float) -> None:
    await asyncio.sleep(max(0.0, when - time.perf_counter()))


# --- the scenarios ----------------------------------------------------------------------

async def one_process(proc: VegaProcess, args: argparse.Namespace, seed: int
                      ) -> dict[str, Any]:
    url, pids = proc.url, (pid(proc),)
    plain = await open_loop([url], args.rate, args.seconds, 0.0, seed, pids=pids)
    await asyncio.sleep(args.quiet_s)
    watch = Watch([url])
    watch.start()

    async def during(start: float, load_end: float) -> dict[str, Any]:
        predicted = await watch.predict(load_end, 1.0, args.probe_rate)
        # The probe starts once the inline queue of the burst has gone (its deadline).
        before = watch.backlog()
        light = await probe(url, args.probe_rate, args.probe_s, seed + 1)
        return {"predicted": predicted, "probe": light, "backlog_at_probe_start": before,
                "backlog_at_probe_end": watch.backlog()}

    try:
        jobs = await open_loop([url], args.rate, args.seconds, args.async_share, seed,
                               poll_url=url, during=during, pids=pids)
    finally:
        await watch.stop()
    await asyncio.sleep(1.0)
    idle = await probe(url, args.probe_rate, args.probe_s, seed + 1)
    return summarize(plain, jobs) | {
        "probe_p99_ms_draining": jobs["during"]["probe"]["p99_ms"],
        "probe_p99_ms_idle": idle["p99_ms"],
        "probe_sent": idle["sent"],
        "backlog_at_probe_start": jobs["during"]["backlog_at_probe_start"],
        "backlog_at_probe_end": jobs["during"]["backlog_at_probe_end"]}


async def two_processes(pair: list[VegaProcess], args: argparse.Namespace, seed: int
                        ) -> dict[str, Any]:
    urls = [p.url for p in pair]
    victim, survivor = pair
    pids = tuple(pid(p) for p in pair)
    plain = await open_loop(urls, args.rate, args.seconds, 0.0, seed, pids=pids)
    await asyncio.sleep(args.quiet_s)
    watch = Watch(urls)
    watch.start()

    async def during(start: float, load_end: float) -> dict[str, Any]:
        predicted = await watch.predict(load_end, 1.0, 0.0)
        peak = max(1, predicted["job_backlog"])
        while True:
            depth, held = watch.backlog(), (watch.latest(victim.url) or {}).get("held", 0)
            if depth == 0 or (held > 0 and depth <= args.kill_at * peak):
                break
            await asyncio.sleep(0.05)
        if depth == 0:
            return {"predicted": predicted, "killed": False}
        victim.signal(signal.SIGKILL)
        killed_at = time.perf_counter()
        del watch.live[victim.url]
        await asyncio.sleep(2 * SAMPLE_S)  # a sample of the survivor alone
        rate = float((watch.latest(survivor.url) or {}).get("rate", 0.0))
        again = (killed_at - load_end + CLAIM_IDLE_MS / 1000 + depth / max(1e-9, rate))
        return {"predicted": predicted, "killed": True, "backlog_at_kill": depth,
                "victim_held_at_kill": held, "killed_after_load_s": round(
                    killed_at - load_end, 3), "predicted_after_kill_s": round(again, 3)}

    try:
        jobs = await open_loop(urls, args.rate, args.seconds, args.async_share, seed,
                               poll_url=survivor.url, during=during, pids=pids)
    finally:
        await watch.stop()
    during_ = jobs["during"]
    return summarize(plain, jobs) | {k: v for k, v in during_.items() if k != "predicted"}


def summarize(plain: dict[str, Any], jobs: dict[str, Any]) -> dict[str, Any]:
    job = jobs["jobs"]
    predicted = jobs["during"]["predicted"]
    return {
        "inline_200_no_jobs": plain["ok"], "inline_200_with_jobs": jobs["ok"],
        "ratio": round(jobs["ok"] / max(1, plain["ok"]), 3),
        "refused_no_jobs": plain["sent"] - plain["ok"],
        "refused_with_jobs": sum(n for label, n in jobs["outcomes"].items()
                                 if not label.startswith(("200", "202"))),
        "accepted": job["accepted"], "done": job["done"], "lost": job["lost"],
        "done_in_burst": job["done_in_burst"],
        "not_done": job["accepted"] - job["done"],
        "last_done_after_burst_s": job["last_finished_after_load_s"],
        "predicted_drain_s": predicted["predicted_s"], "prediction": predicted,
        "burst_p99_ms_no_jobs": plain["p99_ms"], "burst_p99_ms_with_jobs": jobs["p99_ms"],
        "late_sends": [plain["late_sends"], jobs["late_sends"]],
        "max_send_lag_ms": max(plain["max_send_lag_ms"], jobs["max_send_lag_ms"]),
        "cores_no_jobs": plain["cores_servers_then_client"],
        "cores_with_jobs": jobs["cores_servers_then_client"]}


def serve(count: int, logs: Path, env: dict[str, str]) -> list[VegaProcess]:
    procs = [VegaProcess(env, log_path=logs / f"vega-{time.monotonic_ns()}-{i}.log")
             for i in range(count)]
    for proc in procs:
        proc.start(wait_ready=False)
    for proc in procs:
        proc.wait_ready()
    return procs


def pid(proc: VegaProcess) -> int:
    assert proc.proc is not None
    return proc.proc.pid


def stop(procs: list[VegaProcess]) -> None:
    for proc in procs:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.signal(signal.SIGKILL)
            proc.proc.wait()


async def round_(args: argparse.Namespace, number: int, logs: Path) -> dict[str, Any]:
    env = ENV | {"TEST_PER_ITEM_MS": str(args.per_item_ms)}
    seed = args.seed + number
    procs = serve(1, logs, env)
    try:
        one = await one_process(procs[0], args, seed)
    finally:
        stop(procs)
    redis = RedisServer(logs).start()
    pair = []
    try:
        pair = serve(2, logs, env | {"VEGA_REDIS_URL": redis.url,
                                     "VEGA_CLAIM_IDLE_MS": str(CLAIM_IDLE_MS)})
        two = await two_processes(pair, args, seed)
    finally:
        stop(pair)
        redis.stop()
    return {"one_process": one, "two_processes_one_killed": two}


ROWS = (("inline 200s, no jobs", "inline_200_no_jobs"),
        ("inline 200s, 30% can wait", "inline_200_with_jobs"),
        ("ratio", "ratio"),
        ("jobs accepted / done / lost", ("accepted", "done", "lost")),
        ("jobs done before the burst ended", "done_in_burst"),
        ("last job done after the burst (s)", "last_done_after_burst_s"),
        ("predicted drain at the burst's end (s)", "predicted_drain_s"),
        ("... predicted again at the kill (s)", "predicted_after_kill_s"),
        ("killed after the burst (s), backlog then", ("killed_after_load_s",
                                                      "backlog_at_kill")),
        ("inline p99 in the burst, no jobs (ms)", "burst_p99_ms_no_jobs"),
        ("inline p99 in the burst, with jobs (ms)", "burst_p99_ms_with_jobs"),
        ("probe p99 while jobs drain (ms)", "probe_p99_ms_draining"),
        ("probe p99 idle (ms)", "probe_p99_ms_idle"),
        ("cores used in the burst, no jobs (servers, client)", "cores_no_jobs"),
        ("cores used in the burst, with jobs (servers, client)", "cores_with_jobs"))


def table(rounds: list[dict[str, Any]]) -> str:
    heads = [f"r{i + 1} {name}" for i in range(len(rounds))
             for name in ("1 proc", "2 procs, 1 killed")]
    cols = [r[k] for r in rounds for k in ("one_process", "two_processes_one_killed")]
    lines = ["| | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for label, key in ROWS:
        keys = key if isinstance(key, tuple) else (key,)
        cells = [" / ".join("–" if c.get(k) is None else str(c[k]) for k in keys)
                 for c in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", type=float, default=1000.0, help="burst requests/s")
    parser.add_argument("--seconds", type=float, default=6.0, help="burst length")
    parser.add_argument("--async-share", type=float, default=0.3)
    parser.add_argument("--per-item-ms", type=float, default=5.0,
                        help="the model's cost per item: capacity about 1000/this items/s")
    parser.add_argument("--probe-rate", type=float, default=25.0)
    parser.add_argument("--probe-s", type=float, default=4.0)
    parser.add_argument("--quiet-s", type=float, default=3.0, help="pause between bursts")
    parser.add_argument("--kill-at", type=float, default=0.6,
                        help="SIGKILL once the job backlog is below this share of its peak")
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="vega-bench-jobs-"))
    rounds = []
    for number in range(1, args.rounds + 1):
        result = await round_(args, number, logs)
        print(f"round {number}: " + json.dumps(result), flush=True)
        rounds.append(result)
    print(table(rounds))
    (logs / "results.json").write_text(json.dumps({"args": vars(args), "rounds": rounds},
                                                  indent=1))
    print(f"wrote {logs / 'results.json'}")
    bad = [c for r in rounds for c in r.values()
           if c["lost"] or c["not_done"] or c.get("killed") is False]
    if any(c["lost"] or c["not_done"] for c in bad):
        print("bench-jobs: a job was lost or never ended", file=sys.stderr)
    if any(c.get("killed") is False for c in bad):
        print("bench-jobs: no job backlog to kill a process in (the burst fit the two "
              "processes' capacity: raise --rate)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    raise SystemExit(asyncio.run(main()))
