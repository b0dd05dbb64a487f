"""Processes sharing one host and device: how far N ``vega serve`` processes take a model.

``scripts/bench_procs [SECONDS] [--procs 1,2,4] [--connections 64] [--lengths 64]``
(defaults 8, 1,2,4, 64, 64). For each N: N fresh servers of the eager test module
(``python:tests.models:encoder``; default settings, VEGA_TORCH_THREADS=1, on the device
VEGA_DEVICE picks: a GPU where torch sees one), each loaded by its own closed-loop load
generator of CONNECTIONS callers at once, as Nginx ``least_conn`` would split equal
processes' callers. It prints the 200s a second of each and their sum, the sum's ratio
to one process, and the module alone at its best batch on the same device.

On a GPU, one process's event loop (HTTP, JSON, batching) is the limit long before the
device is: this says how many processes one GPU takes before the device, or the host's
cores, become the limit. On a host of few cores it says what extra processes cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_core import ceiling, device, free_ports, ready, spawn, summary
from bench_eager import MODEL, load



def start(ports: list[int]) -> list[subprocess.Popen[bytes]]:
    """The servers, started at once (their warm-ups overlap), then each waited for."""
    procs = [spawn(port, VEGA_MODEL=MODEL) for port in ports]
    try:
        for proc, port in zip(procs, ports):
            ready(proc, port)
    except BaseException:  # not ready, or a Ctrl-C: none of them is left running
        stop(procs)
        raise
    return procs


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(n: int, seconds: float, connections: int, lengths: str, out: Path) -> dict[str, Any]:
    ports = free_ports(n)
    procs = start(ports)
    try:
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(
                lambda port: load(port, connections, seconds, lengths, out / f"{n}-{port}"),
                ports))
    finally:
        stop(procs)
    each = [summary(report, seconds) for report, _cores, _machine in runs]
    return {"procs": n, "ok_rate": round(sum(s["ok_rate"] for s in each), 1),
            "each": [{k: s[k] for k in ("ok_rate", "p99_ms", "mean_batch", "by_status")}
                     for s in each]}


def main() -> int:
    parser = argparse.ArgumentParser(description="Processes sharing a host (see the docstring).")
    parser.add_argument("seconds", nargs="?", type=float, default=8.0, help="per step")
    parser.add_argument("--procs", default="1,2,4", help="comma-separated process counts")
    parser.add_argument("--connections", type=int, default=64, help="callers per process")
    parser.add_argument("--lengths", default="64", help="window lengths, as vega bench takes")
    options = parser.parse_args()
    alone = max(ceiling(64, (32, 64), per_size_s=1.0, spec=MODEL).values())
    print(f"device: {device()}; the module alone at 64 steps, best batch: {alone:.0f} items/s")
    out = Path(tempfile.mkdtemp(prefix="vega-bench-procs-"))
    steps: list[dict[str, Any]] = []
    for n in (int(p) for p in options.procs.split(",")):
        step = run(n, options.seconds, options.connections, options.lengths, out)
        one = next((s["ok_rate"] for s in steps + [step] if s["procs"] == 1), None)
        if one:  # only against a step of one process: --procs 2,4 has none
            step["vs_one"] = round(step["ok_rate"] / one, 2)
        step["vs_module_alone"] = round(step["ok_rate"] / alone, 2)
        steps.append(step)
        print(json.dumps(step))
    results = {"device": device(), "module_alone_items_per_s": alone, "steps": steps}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
