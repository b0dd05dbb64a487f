"""A user's own eager module, served at default settings: fixed and mixed window lengths.

``scripts/bench_eager [SECONDS] [--rounds=N]`` (defaults 10, 1). The model is the eager
test module ``python:tests.models:encoder`` (PatchTST-like, width 128, 6 layers; not the
built-in model, not TorchScript). Every server runs with VEGA_TORCH_THREADS=1 and
otherwise default settings: priority ``normal``, the default 1-s deadline. Each phase
runs on a fresh server, and each round takes them in turn:

1. the module alone, no HTTP, one thread, batch sizes 8..64 at 64 steps: the ceiling,
   measured again after the round's last phase; ratios use the mean of the two;
2. 64 connections, 64 steps, the model in a thread (VEGA_EXECUTOR=thread);
3. the same at the default executor (a model process for an eager module);
4. 64 connections, lengths uniform in 16..256, default length buckets (cut from the
   measured costs);
5. the same with the configured bounds as given (VEGA_BUCKET_PADDING=0), and with one
   bucket (VEGA_LENGTH_BUCKETS=512);
6. 1024 connections that honour Retry-After, 64 steps;
7. phases 2 and 3 with the module at width 256 (``encoder_wide``), against its own ceiling;
8. the HTTP path alone: a model that costs nothing (``echo_fast``, in a thread), 64
   connections: what one process's loop answers at most on this machine.

Ratios come from one run; the load generator shares the machine's cores. Each phase also
reports the CPU it took per answer: the loop (the server's main thread), the model
(its process, or its thread) and the load generator. Their sum bounds what the machine's
cores can serve (``cpu_bound_64_vs_ceiling``: that bound over the module's ceiling), so
a ratio short of a target says whether the cores or the serving fell short.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_core import (  # noqa: E402
    batch_seconds,
    ceiling,
    cpu_use,
    serve,
    summary,
    thread_seconds,
)

MODEL = "python:tests.models:encoder"
WIDE = "python:tests.models:encoder_wide"
MIXED = "uniform:16:256"
PHASES: tuple[tuple[str, dict[str, str], int, str], ...] = (
    ("fixed_thread_64", {"VEGA_EXECUTOR": "thread"}, 64, "64"),
    ("fixed_default_64", {}, 64, "64"),
    ("mixed_buckets_64", {}, 64, MIXED),
    ("mixed_fixed_buckets_64", {"VEGA_BUCKET_PADDING": "0"}, 64, MIXED),
    ("mixed_one_bucket_64", {"VEGA_LENGTH_BUCKETS": "512", "VEGA_BUCKET_PADDING": "0"}, 64,
     MIXED),
    ("fixed_default_1024", {}, 1024, "64"),
    # The same module at width 256: its own cost, not the HTTP path, bounds the server.
    ("wide_thread_64", {"VEGA_MODEL": WIDE, "VEGA_EXECUTOR": "thread"}, 64, "64"),
    ("wide_default_64", {"VEGA_MODEL": WIDE}, 64, "64"),
    ("http_path_64", {"VEGA_MODEL": "python:tests.models:echo_fast", "VEGA_EXECUTOR": "thread"},
     64, "64"),
)


def load(port: int, connections: int, seconds: float, lengths: str, out: Path
         ) -> tuple[dict[str, Any], float]:
    """The load generator's report, and the cores it took while it ran (its start-up and
    report writing left out: sampled from its second second to its last but one)."""
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
        time.sleep(max(0.5, seconds - 3.0))
        cores = (process_seconds([proc.pid]) - cpu_before) / (time.monotonic() - started)
        if proc.wait(timeout=seconds + 120) != 0:
            raise RuntimeError(f"the load generator exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report, cores


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


def run_phase(port: int, env: dict[str, str], connections: int, lengths: str,
              seconds: float, out: Path) -> dict[str, Any]:
    proc = serve(port, **{"VEGA_MODEL": MODEL, **env})
    try:
        status = json.loads(_get(port, "/v1/status"))
        kids = children(proc.pid)
        busy_before = batch_seconds(port)
        threads_before, kids_before = thread_seconds(proc.pid), process_seconds(kids)
        report, loadgen_cores = load(port, connections, seconds, lengths, out)
        threads_after, kids_after = thread_seconds(proc.pid), process_seconds(kids)
        busy_after = batch_seconds(port)
    finally:
        proc.terminate()
        proc.wait(30)
    batches = busy_after[1] - busy_before[1]
    phase = summary(report, seconds)
    phase["executor"] = status.get("executor", {}).get("kind")
    phase["length_buckets"] = next(iter(status.get("models", {}).values()), {}).get(
        "length_buckets")
    phase["mean_batch_ms"] = 1000 * (busy_after[0] - busy_before[0]) / batches if batches else None
    phase["refused"] = sum(n for code, n in phase["by_status"].items() if code != "200")
    answers = sum(phase["by_status"].values())
    threads = cpu_use(proc.pid, threads_before, threads_after, batches, answers)
    if answers and threads:
        model_s = (kids_after - kids_before if kids else
                   threads["model_cpu_ms_per_batch"] * batches / 1000)
        phase["cpu_us_per_answer"] = {
            "loop": round(threads["loop_cpu_us_per_answer"], 1),
            "model": round(1e6 * model_s / answers, 1),
            "loadgen": round(1e6 * loadgen_cores * seconds / answers, 1)}
    return phase


def _get(port: int, path: str) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).text


def ratios(round_: dict[str, Any]) -> dict[str, float]:
    best = max(round_["ceiling_items_per_s"].values())
    wide = max(round_["wide_ceiling_items_per_s"].values())
    ok = {name: round_[name]["ok_rate"] for name, *_ in PHASES if name in round_}
    return {
        "thread_64_vs_ceiling": ok["fixed_thread_64"] / best,
        "default_64_vs_ceiling": ok["fixed_default_64"] / best,
        "wide_thread_64_vs_ceiling": ok["wide_thread_64"] / wide,
        "wide_default_64_vs_ceiling": ok["wide_default_64"] / wide,
        "mixed_buckets_vs_one_bucket": ok["mixed_buckets_64"] / max(ok["mixed_one_bucket_64"], 1e-9),
        "mixed_planned_vs_fixed_buckets":
            ok["mixed_buckets_64"] / max(ok["mixed_fixed_buckets_64"], 1e-9),
        "ok_1024_vs_64": ok["fixed_default_1024"] / max(ok["fixed_default_64"], 1e-9),
        "http_path_64_vs_ceiling": ok["http_path_64"] / best,
        "cpu_bound_64_vs_ceiling": cpu_bound(round_["fixed_default_64"]) / best,
    }


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
    out = Path(tempfile.mkdtemp(prefix="vega-bench-eager-"))
    results: dict[str, Any] = {"seconds": options.seconds, "rounds": []}
    port = 18800
    for number in range(1, options.rounds + 1):
        round_: dict[str, Any] = {"ceilings_at_start": ceilings(number, "start")}
        for name, env, connections, lengths in PHASES:
            if chosen and name not in chosen:
                continue
            round_[name] = run_phase(port, env, connections, lengths, options.seconds,
                                     out / f"{number}-{name}")
            port += 1
            print(f"round {number} {name}: {json.dumps(round_[name])}", flush=True)
        round_["ceilings_at_end"] = ceilings(number, "end")
        round_.update(bracketed(round_["ceilings_at_start"], round_["ceilings_at_end"]))
        print(f"round {number} the module alone at the end vs at the start: "
              f"{round_['ceiling_drift']:.2f}x (wide: {round_['wide_ceiling_drift']:.2f}x); "
              "ratios use the mean of the two", flush=True)
        round_["ratios"] = ratios(round_) if not chosen else {}
        print(f"round {number} ratios: "
              + json.dumps({k: round(v, 2) for k, v in round_["ratios"].items()}), flush=True)
        results["rounds"].append(round_)
    keys = results["rounds"][0]["ratios"]
    results["median_ratios"] = {k: statistics.median(r["ratios"][k] for r in results["rounds"])
                                for k in keys}
    print("median ratios: " + json.dumps({k: round(v, 2)
                                          for k, v in results["median_ratios"].items()}))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
