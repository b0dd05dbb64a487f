"""A user's own eager module, served at default settings: fixed and mixed window lengths.

``scripts/bench_eager [SECONDS] [--rounds=N]`` (defaults 10, 1). The model is the eager
test module ``python:tests.models:encoder`` (PatchTST-like, width 128, 6 layers; not the
built-in model, not TorchScript). Every server runs with VEGA_TORCH_THREADS=1 and
otherwise default settings: priority ``normal``, the default 1-s deadline. Each phase
runs on a fresh server, and each round takes them in turn:

1. the module alone, no HTTP, one thread, batch sizes 8..64 at 64 steps: the ceiling,
   measured again after the round's last phase; ratios use the mean of the two;
2. 64 connections, 64 steps, the model in a thread (VEGA_EXECUTOR=thread);
3. the same at the default executor (a model process for an eager module), paired with
   1024 connections that honour Retry-After, the module alone measured after each
   64-connection slice (``default_64_vs_module_beside``: each slice against the module
   a few seconds later, where the round's ceiling is minutes away from most slices),
   also at the slice's mean batch size, which splits that ratio in two:
   ``default_64_vs_module_at_served_batch`` (what serving costs over the module running
   the same batches) and ``served_batch_vs_best_batch`` (what the batches that 64
   callers leave allow, against the module's best);
4. 64 connections, lengths uniform in 16..256, default length buckets (cut from the
   measured costs), paired with the same on one bucket (VEGA_LENGTH_BUCKETS=512);
5. the same lengths with the configured bounds as given (VEGA_BUCKET_PADDING=0), and
   64 against 1024 connections that honour Retry-After at those lengths;
6. phases 2 and 3 with the module at width 256 (``encoder_wide``), against its own ceiling;
7. the HTTP path alone: a model that costs nothing (``echo_fast``, in a thread), 64
   connections: what one process's loop answers at most on this machine;
8. phase 4's pair with the module compiled ahead of time (``vega export``, served as
   ``aoti:PATH``; compiled once per run, before the first round);
9. two processes on this machine, every request sent to the first, mixed lengths: with
   Redis (overflow on at its defaults; one ``redis-server`` per run) against without, the
   second process up and idle in both (``overflow_on_vs_off``): what overflow costs or
   gains where the pair shares the machine's cores.

A pair's two servers are up at once and loaded in turn, A B B A A B B A, each for half
of SECONDS at a time: the two sides of a target's ratio then see the same machine,
where phases run one after the other on a VM whose speed drifts within minutes can
differ by a third.

Ratios come from one run; the load generator shares the machine's cores. Each phase also
reports the CPU it took per answer and the cores it kept busy (``cores``): the loop (the
server's main thread), the model (its process, or its thread) and the load generator;
``model_busy`` is the share of the phase's time the model was running a batch;
``machine`` the shares of the VM's CPU time left idle and stolen by its host. The sum
of the CPU per answer bounds what the machine's cores can serve
(``cpu_bound_64_vs_ceiling``: that bound over the module's ceiling), so a ratio short of
a target says whether the cores or the serving fell short. For the mixed-length pair,
the round also profiles the module (``vega profile``) and runs the same 64 callers
through the real batcher in virtual time at those costs (``vega simulate``):
``mixed_simulated_buckets_vs_one_bucket`` is what the batcher would give on this
machine at this minute's costs, with no loop, load generator or drift.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_core import (  # noqa: E402
    batch_seconds,
    ceiling,
    device,
    free_ports,
    machine_seconds,
    machine_shares,
    serve,
    summary,
    thread_seconds,
    thread_split,
)

MODEL = "python:tests.models:encoder"
WIDE = "python:tests.models:encoder_wide"
MIXED = "uniform:16:256"
COMPILED = "aoti:"  # + the package main() compiles, once per run (compile_module)
REDIS = "unix://"  # + the socket of the redis-server main() starts, once per run (start_redis)
PHASES: tuple[tuple[str, dict[str, str], int, str], ...] = (
    ("fixed_thread_64", {"VEGA_EXECUTOR": "thread"}, 64, "64"),
    ("fixed_default_64", {}, 64, "64"),
    ("mixed_buckets_64", {}, 64, MIXED),
    ("mixed_fixed_buckets_64", {"VEGA_BUCKET_PADDING": "0"}, 64, MIXED),
    ("mixed_one_bucket_64", {"VEGA_LENGTH_BUCKETS": "512", "VEGA_BUCKET_PADDING": "0"}, 64,
     MIXED),
    ("fixed_default_1024", {}, 1024, "64"),
    # The flood at mixed lengths, paired with the same server settings at 64 connections.
    ("mixed_default_64", {}, 64, MIXED),
    ("mixed_default_1024", {}, 1024, MIXED),
    # The same module at width 256: its own cost, not the HTTP path, bounds the server.
    ("wide_thread_64", {"VEGA_MODEL": WIDE, "VEGA_EXECUTOR": "thread"}, 64, "64"),
    ("wide_default_64", {"VEGA_MODEL": WIDE}, 64, "64"),
    ("http_path_64", {"VEGA_MODEL": "python:tests.models:echo_fast", "VEGA_EXECUTOR": "thread"},
     64, "64"),
    ("compiled_buckets_64", {"VEGA_MODEL": COMPILED}, 64, MIXED),
    ("compiled_one_bucket_64", {"VEGA_MODEL": COMPILED, "VEGA_LENGTH_BUCKETS": "512",
                                "VEGA_BUCKET_PADDING": "0"}, 64, MIXED),
    # A second process beside the loaded one (PEERED), with and without Redis between them.
    ("overflow_on_64", {"VEGA_REDIS_URL": REDIS}, 64, MIXED),
    ("overflow_off_64", {}, 64, MIXED),
)
SPECS = {name: (env, connections, lengths) for name, env, connections, lengths in PHASES}
# Phases run as a pair (run_pair), for the targets that are their ratio.
PAIRED = {"fixed_default_64": "fixed_default_1024", "mixed_buckets_64": "mixed_one_bucket_64",
          "compiled_buckets_64": "compiled_one_bucket_64", "overflow_on_64": "overflow_off_64",
          "mixed_default_64": "mixed_default_1024"}
# Phases whose server has a peer process, started with the same settings and left idle.
PEERED = {"overflow_on_64", "overflow_off_64"}


def load(port: int, connections: int, seconds: float, lengths: str, out: Path
         ) -> tuple[dict[str, Any], float, list[float]]:
    """The load generator's report, the cores it took while it ran and the machine's CPU
    seconds meanwhile (``machine_seconds`` differences), both sampled from its second
    second to its last but one, its start-up and report writing left out."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vega.lab.loadgen", f"http://127.0.0.1:{port}",
         "--mode", "closed", "--connections", str(connections),
         "--max-connections", str(connections), "--duration-s", str(seconds),
         "--lengths", lengths, "--mix", "normal=1", "--deadline-ms", "1000",
         "--out", str(out), "--no-progress", "--honor-retry-after"],
        cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        time.sleep(2.0)
        started, cpu_before = time.monotonic(), process_seconds([proc.pid])
        machine_before = machine_seconds()
        time.sleep(max(0.5, seconds - 3.0))
        machine = [after - before for before, after in zip(machine_before, machine_seconds())]
        cores = (process_seconds([proc.pid]) - cpu_before) / (time.monotonic() - started)
        if proc.wait(timeout=seconds + 120) != 0:
            raise RuntimeError(f"the load generator exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report, cores, machine


def process_seconds(pids: list[int]) -> float:
    """CPU seconds these processes (model processes, the load generator) have taken so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def children(pid: int) -> list[int]:
    listed = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                            text=True, check=False).stdout
    return [int(child) for child in listed.split()]


class Server:
    """A fresh server for one phase, and the counters that say where its CPU went."""

    def __init__(self, port: int, env: dict[str, str], peer_port: int | None = None) -> None:
        self.port = port
        self.peer_port = peer_port
        named = {"VEGA_NODE_ID": "A"} if peer_port is not None else {}
        self.proc = serve(port, **{"VEGA_MODEL": MODEL, **env, **named})
        self.peer: subprocess.Popen[bytes] | None = None
        try:
            # The peer: same settings, never loaded; it runs what the first sends it.
            if peer_port is not None:
                self.peer = serve(peer_port, **{"VEGA_MODEL": MODEL, **env, "VEGA_NODE_ID": "B"})
            self.status: dict[str, Any] = json.loads(_get(port, "/v1/status"))
        except BaseException:  # the peer not ready, or a Ctrl-C: the first is stopped too
            self.stop()
            raise
        self.kids = children(self.proc.pid)
        self.peer_kids = [] if self.peer is None else children(self.peer.pid)
        self.slices: list[tuple[dict[str, Any], float, dict[str, Any]]] = []

    def load(self, connections: int, lengths: str, seconds: float, out: Path) -> None:
        """One slice of closed-loop load; its report and counters are kept."""
        busy_before = batch_seconds(self.port)
        peer_before = self._peer_counters()
        threads_before, kids_before = thread_seconds(self.proc.pid), process_seconds(self.kids)
        report, loadgen_cores, machine_s = load(self.port, connections, seconds, lengths, out)
        threads_after, kids_after = thread_seconds(self.proc.pid), process_seconds(self.kids)
        busy_after = batch_seconds(self.port)
        peer_after = self._peer_counters()
        self.slices.append((report, seconds, {
            "busy_s": busy_after[0] - busy_before[0], "batches": busy_after[1] - busy_before[1],
            "threads": (threads_before, threads_after), "kids_s": kids_after - kids_before,
            "loadgen_s": loadgen_cores * seconds,
            "machine_s": machine_s,
            "peer": [after - before for before, after in zip(peer_before, peer_after)]}))

    def _peer_counters(self) -> tuple[float, float]:
        """The CPU seconds of the peer's model processes, and the batches this server has
        sent out to peers."""
        if self.peer_port is None:
            return 0.0, 0.0
        sent = sum(float(line.rsplit(" ", 1)[1])
                   for line in _get(self.port, "/metrics").splitlines()
                   if line.startswith('vega_overflow_batches_total{direction="out"}'))
        return process_seconds(self.peer_kids), sent

    def stop(self) -> None:
        for proc in (self.proc, self.peer):
            if proc is not None:
                proc.terminate()
        for proc in (self.proc, self.peer):
            if proc is not None:
                proc.wait(30)

    def phase(self) -> dict[str, Any]:
        """Its slices summed: rates over their time, counts added, the worst slice's p99."""
        parts = [summary(report, seconds) for report, seconds, _ in self.slices]
        counters = [c for _, _, c in self.slices]
        phase: dict[str, Any] = {
            "throughput": statistics.fmean(p["throughput"] for p in parts),
            "ok_rate": round(statistics.fmean(p["ok_rate"] for p in parts), 1),
            "p50_ms": statistics.median(p["p50_ms"] for p in parts),
            "p99_ms": max(p["p99_ms"] for p in parts),
            "p99_after_1s_ms": max((p["p99_after_1s_ms"] for p in parts
                                    if p["p99_after_1s_ms"] is not None), default=None),
            "by_status": dict(sum((Counter(p["by_status"]) for p in parts), Counter())),
            "mean_batch": _batch_mean(report for report, _, _ in self.slices)}
        if len(parts) > 1:
            phase["slices_ok_rate"] = [p["ok_rate"] for p in parts]
        phase["executor"] = self.status.get("executor", {}).get("kind")
        models: dict[str, Any] = self.status.get("models", {})
        first: dict[str, Any] = next(iter(models.values()), {})
        phase["length_buckets"] = first.get("length_buckets")
        batches = sum(c["batches"] for c in counters)
        phase["mean_batch_ms"] = 1000 * sum(c["busy_s"] for c in counters) / batches \
            if batches else None
        phase["refused"] = sum(n for code, n in phase["by_status"].items() if code != "200")
        answers = sum(phase["by_status"].values())
        split = [thread_split(self.proc.pid, *c["threads"]) or (0.0, 0.0, 0.0)
                 for c in counters]
        loop_s, model_thread_s = sum(s[0] for s in split), sum(s[1] for s in split)
        seconds = sum(s for _, s, _ in self.slices)
        phase["model_busy"] = round(sum(c["busy_s"] for c in counters) / seconds, 2)
        if self.peer_port is not None:
            phase["peer_model_cores"] = round(sum(c["peer"][0] for c in counters) / seconds, 2)
            phase["batches_to_peer"] = int(sum(c["peer"][1] for c in counters))
        if answers and loop_s:
            model_s = sum(c["kids_s"] for c in counters) if self.kids else model_thread_s
            loadgen_s = sum(c["loadgen_s"] for c in counters)
            phase["cpu_us_per_answer"] = {
                "loop": round(1e6 * loop_s / answers, 1),
                "model": round(1e6 * model_s / answers, 1),
                "loadgen": round(1e6 * loadgen_s / answers, 1)}
            phase["cores"] = {"loop": round(loop_s / seconds, 2),
                              "model": round(model_s / seconds, 2),
                              "loadgen": round(loadgen_s / seconds, 2)}
        # Whether the cores were the bound (idle near 0) and whether the host took some.
        phase["machine"] = machine_shares([sum(c["machine_s"][i] for c in counters)
                                           for i in range(3)])
        return phase


def _batch_mean(reports: Iterable[dict[str, Any]]) -> float | None:
    sizes = [report.get("batches", {}).get("size") or {} for report in reports]
    count = sum(s.get("count", 0) for s in sizes)
    return sum(s.get("sum", 0) for s in sizes) / count if count else None


def run_phase(port: int, env: dict[str, str], connections: int, lengths: str,
              seconds: float, out: Path, peered: bool = False) -> dict[str, Any]:
    server = Server(port, env, peer_port=free_ports(1)[0] if peered else None)
    try:
        server.load(connections, lengths, seconds, out)
    finally:
        server.stop()
    return server.phase()


def run_pair(ports: tuple[int, int], names: tuple[str, str], seconds: float, out: Path
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two phases a ratio compares, both servers up at once and loaded in turn (A B B A
    A B B A, slices of half the phase's time): a VM whose speed drifts within minutes
    moves both alike, where phases run one after the other can differ by a third.

    A phase whose target is against the module alone (BESIDE) also has the module alone
    measured right after each of its slices, both servers idle: ``module_alone_beside``
    at its best batch, ``module_at_served_batch_beside`` at the slice's mean batch."""
    servers: list[Server] = []
    beside: list[tuple[float, float]] = []
    try:
        for port, name in zip(ports, names):
            servers.append(Server(port, SPECS[name][0],
                                  peer_port=free_ports(1)[0] if name in PEERED else None))
        for number, which in enumerate((0, 1, 1, 0) * 2):
            _env, connections, lengths = SPECS[names[which]]
            servers[which].load(connections, lengths, seconds / 2, out / f"{which}-{number}")
            if which == 0 and names[0] in BESIDE:
                served = _batch_mean([servers[0].slices[-1][0]])
                beside.append(module_alone(round(served) if served else 32))
    finally:
        for server in servers:
            server.stop()
    first = servers[0].phase()
    if beside:
        first["module_alone_beside"] = [round(best, 1) for best, _ in beside]
        first["module_at_served_batch_beside"] = [round(at, 1) for _, at in beside]
    return first, servers[1].phase()


STOLEN_WARNING = 0.05  # a phase's share of stolen CPU time worth a line in the output

# Phases compared with the module alone measured beside each of their slices (run_pair).
BESIDE = {"fixed_default_64"}


def module_alone(served_batch: int) -> tuple[float, float]:
    """The module alone at 64 steps, items/s at its best batch (a second each at 32 and
    64) and at ``served_batch``."""
    rates = ceiling(64, tuple(sorted({32, 64, served_batch})), per_size_s=1.0, spec=MODEL)
    return max(rates[32], rates[64]), rates[served_batch]


PROFILE_BOUNDS = "16,32,64,96,128,192,256,512"  # lengths the simulator interpolates between


def simulated(number: int, names: tuple[str, ...], seconds: float, out: Path
              ) -> dict[str, float]:
    """200s a second the batcher would serve each phase at the module's costs measured now.
    A profile runs full-length windows, so a one-bucket batch, whose padding the module
    masks, runs a few per cent cheaper than simulated (docs/bench.md)."""
    profile = out / f"{number}-profile.json"
    _vega("profile", "--model", MODEL, "--torch-threads", "1", "--buckets", PROFILE_BOUNDS,
          "--repeats", "15", "--out", str(profile))
    rates = {}
    for name in names:
        env, connections, lengths = SPECS[name]
        report = out / f"{number}-simulated-{name}"
        settings = [arg for key, value in env.items() for arg in ("--set", f"{key}={value}")]
        _vega("simulate", "--latency", str(profile), "--mode", "closed",
              "--connections", str(connections), "--lengths", lengths, "--mix", "normal=1",
              "--duration-s", str(seconds), "--seed", str(number), "--no-plots",
              "--out", str(report), *settings)
        rates[name] = json.loads((report / "report.json").read_text())["summary"]["ok_rate"]
    return rates


def compile_module(out: Path) -> None:
    """``vega export`` the module once; the compiled phases serve the package."""
    package = out / "encoder.pt2"
    _vega("export", "--model", MODEL, "--out", str(package))
    for _name, env, _connections, _lengths in PHASES:
        if env.get("VEGA_MODEL") == COMPILED:
            env["VEGA_MODEL"] = f"{COMPILED}{package}"  # SPECS holds the same dicts


def start_redis(out: Path) -> subprocess.Popen[bytes]:
    """A redis-server of the run's own on a unix socket; the overflow phases use it."""
    sock = out / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock),
                             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                             "--dir", str(out)], stdout=subprocess.DEVNULL)
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start")
    for _name, env, _connections, _lengths in PHASES:
        if env.get("VEGA_REDIS_URL") == REDIS:
            env["VEGA_REDIS_URL"] = f"{REDIS}{sock}"
    return proc


def _vega(*args: str) -> None:
    """A ``vega`` command, quiet unless it fails."""
    done = subprocess.run([sys.executable, "-m", "vega", *args], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vega {args[0]} exited {done.returncode}: {done.stderr[-2000:]}")


def _get(port: int, path: str) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).text


RATIOS = {  # name: (phase, what it is divided by: a phase or a ceiling)
    "thread_64_vs_ceiling": ("fixed_thread_64", "ceiling_items_per_s"),
    "default_64_vs_ceiling": ("fixed_default_64", "ceiling_items_per_s"),
    "wide_thread_64_vs_ceiling": ("wide_thread_64", "wide_ceiling_items_per_s"),
    "wide_default_64_vs_ceiling": ("wide_default_64", "wide_ceiling_items_per_s"),
    "mixed_buckets_vs_one_bucket": ("mixed_buckets_64", "mixed_one_bucket_64"),
    "mixed_planned_vs_fixed_buckets": ("mixed_buckets_64", "mixed_fixed_buckets_64"),
    "ok_1024_vs_64": ("fixed_default_1024", "fixed_default_64"),
    "mixed_ok_1024_vs_64": ("mixed_default_1024", "mixed_default_64"),
    "http_path_64_vs_ceiling": ("http_path_64", "ceiling_items_per_s"),
    "compiled_mixed_buckets_vs_one_bucket": ("compiled_buckets_64", "compiled_one_bucket_64"),
    # Two pairs loaded one after the other: the VM's drift between them counts in full.
    "compiled_vs_eager_mixed_buckets": ("compiled_buckets_64", "mixed_buckets_64"),
    "overflow_on_vs_off": ("overflow_on_64", "overflow_off_64"),
}


def ratios(round_: dict[str, Any]) -> dict[str, float]:
    """Each ratio whose two sides the round measured (``--phases`` may leave some out)."""
    def rate(name: str) -> float:
        if name.endswith("ceiling_items_per_s"):
            return float(max(round_[name].values()))
        return float(round_[name]["ok_rate"])

    found = {key: rate(top) / max(rate(bottom), 1e-9)
             for key, (top, bottom) in RATIOS.items() if top in round_ and bottom in round_}
    sim = round_.get("simulated_ok_rate", {})
    if "mixed_buckets_64" in sim and "mixed_one_bucket_64" in sim:
        found["mixed_simulated_buckets_vs_one_bucket"] = (
            sim["mixed_buckets_64"] / max(sim["mixed_one_bucket_64"], 1e-9))
    if "fixed_default_64" in round_:
        found["cpu_bound_64_vs_ceiling"] = (cpu_bound(round_["fixed_default_64"])
                                            / rate("ceiling_items_per_s"))
        phase = round_["fixed_default_64"]
        for key, top, bottom in (
                ("default_64_vs_module_beside", "slices_ok_rate", "module_alone_beside"),
                ("default_64_vs_module_at_served_batch", "slices_ok_rate",
                 "module_at_served_batch_beside"),
                ("served_batch_vs_best_batch", "module_at_served_batch_beside",
                 "module_alone_beside")):
            pairs = list(zip(phase.get(top, []), phase.get(bottom, [])))
            if pairs:  # each slice against the module alone measured right after it
                found[key] = statistics.fmean(a / b for a, b in pairs)
    return found


def cpu_bound(phase: dict[str, Any]) -> float:
    """Answers per second the machine's cores could give at this phase's CPU per answer."""
    per_answer_us = sum(phase.get("cpu_us_per_answer", {}).values())
    return (os.cpu_count() or 1) * 1e6 / per_answer_us if per_answer_us else float("nan")


def ceilings(number: int, when: str) -> dict[str, dict[int, float]]:
    """The module alone (and at width 256): items/s per batch size, at 64 steps."""
    measured = {
        "ceiling_items_per_s": ceiling(64, (8, 16, 32, 64), per_size_s=1.5, spec=MODEL),
        "wide_ceiling_items_per_s": ceiling(64, (16, 32, 64), per_size_s=1.5, spec=WIDE)}
    for key, rates in measured.items():
        print(f"round {number} {key} at the {when}, 64 steps: " + ", ".join(
            f"b{size}: {rate:.0f}/s" for size, rate in rates.items()), flush=True)
    return measured


def bracketed(start: dict[str, dict[int, float]], end: dict[str, dict[int, float]]
              ) -> dict[str, Any]:
    """The ceilings a round's ratios use: per batch size, the mean of the module alone
    measured before and after the round's phases. A VM whose speed drifts by a fifth
    within minutes otherwise moves every ratio by as much; the drift is reported."""
    bracket: dict[str, Any] = {}
    for key, drift in (("ceiling_items_per_s", "ceiling_drift"),
                       ("wide_ceiling_items_per_s", "wide_ceiling_drift")):
        bracket[key] = {size: (start[key][size] + end[key][size]) / 2 for size in start[key]}
        bracket[drift] = max(end[key].values()) / max(start[key].values())
    return bracket


def main() -> int:
    parser = argparse.ArgumentParser(description="The eager-module benchmark (see the docstring).")
    parser.add_argument("seconds", nargs="?", type=float, default=10.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--phases", default="", help="comma-separated phase names (default all)")
    options = parser.parse_args()
    chosen = set(filter(None, options.phases.split(",")))
    unknown = chosen - set(SPECS)
    if unknown:
        parser.error(f"--phases: no phase {', '.join(sorted(unknown))}; "
                     f"the phases: {', '.join(SPECS)}")
    out = Path(tempfile.mkdtemp(prefix="vega-bench-eager-"))
    print(f"device: {device()}")
    results: dict[str, Any] = {"seconds": options.seconds, "device": device(), "rounds": []}

    def wanted(key: str, value: str) -> bool:
        return any(env.get(key) == value and (not chosen or name in chosen)
                   for name, env, _connections, _lengths in PHASES)

    if wanted("VEGA_MODEL", COMPILED):
        compile_module(out)
    redis = start_redis(out) if wanted("VEGA_REDIS_URL", REDIS) else None
    try:
        run_rounds(options.rounds, options.seconds, chosen, out, results)
    finally:
        if redis is not None:
            redis.terminate()
    keys = [k for k in results["rounds"][0]["ratios"]
            if all(k in r["ratios"] for r in results["rounds"])]
    results["median_ratios"] = {k: statistics.median(r["ratios"][k] for r in results["rounds"])
                                for k in keys}
    print("median ratios: " + json.dumps({k: round(v, 2)
                                          for k, v in results["median_ratios"].items()}))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


def run_rounds(rounds: int, seconds: float, chosen: set[str], out: Path,
               results: dict[str, Any]) -> None:
    for number in range(1, rounds + 1):
        round_: dict[str, Any] = {"ceilings_at_start": ceilings(number, "start")}
        for name, env, connections, lengths in PHASES:
            if chosen and name not in chosen or name in round_:
                continue
            partner = PAIRED.get(name)
            if partner is not None and (not chosen or partner in chosen):
                first, second = free_ports(2)
                round_[name], round_[partner] = run_pair(
                    (first, second), (name, partner), seconds, out / f"{number}-{name}")
                names = [name, partner]
            else:
                round_[name] = run_phase(free_ports(1)[0], env, connections, lengths, seconds,
                                         out / f"{number}-{name}", peered=name in PEERED)
                names = [name]
            for done in names:
                print(f"round {number} {done}: {json.dumps(round_[done])}", flush=True)
                stolen = round_[done].get("machine", {}).get("stolen", 0.0)
                if stolen >= STOLEN_WARNING:
                    print(f"round {number} {done}: the host took {stolen:.0%} of this VM's "
                          "CPU time meanwhile; its figures measured the host", flush=True)
        mixed = ("mixed_buckets_64", "mixed_one_bucket_64")
        if all(name in round_ for name in mixed):
            round_["simulated_ok_rate"] = simulated(number, mixed, seconds, out)
            print(f"round {number} simulated at this minute's costs: "
                  + json.dumps(round_["simulated_ok_rate"]), flush=True)
        round_["ceilings_at_end"] = ceilings(number, "end")
        round_.update(bracketed(round_["ceilings_at_start"], round_["ceilings_at_end"]))
        print(f"round {number} the module alone at the end vs at the start: "
              f"{round_['ceiling_drift']:.2f}x (wide: {round_['wide_ceiling_drift']:.2f}x); "
              "ratios use the mean of the two", flush=True)
        round_["ratios"] = ratios(round_)
        print(f"round {number} ratios: "
              + json.dumps({k: round(v, 2) for k, v in round_["ratios"].items()}), flush=True)
        results["rounds"].append(round_)


if __name__ == "__main__":
    raise SystemExit(main())
