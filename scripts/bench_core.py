"""Issue 2's benchmark, as one repeatable run (``scripts/bench_core [LENGTH] [SECONDS]``).

1. The model's own items/s per batch size, no HTTP: the ceiling.
2. A server (VEGA_TORCH_THREADS=1) under a closed loop of 64 connections.
3. The same with VEGA_MAX_BATCH_SIZE=1: what batching buys.
4. The default server under 1024 connections: statuses, p99, memory.

The load generator runs on the machine's other core; every figure is from this run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def ceiling(length: int, sizes: tuple[int, ...] = (1, 8, 16, 32, 64)) -> dict[int, float]:
    import torch

    from vega.models import load_model

    torch.set_num_threads(1)
    model = load_model("sensor")
    model.load("cpu")
    sample = model.example(length)
    rates = {}
    for size in sizes:
        batch = [sample] * size
        for _ in range(5):  # TorchScript's profiling executor optimises after a few runs
            model.run(batch, length)
        runs = max(5, 200 // size)
        started = time.perf_counter()
        for _ in range(runs):
            model.run(batch, length)
        rates[size] = size * runs / (time.perf_counter() - started)
    return rates


def rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    fields["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return fields


def serve(port: int, **env: str) -> subprocess.Popen[bytes]:
    full = {**os.environ, "VEGA_PORT": str(port), "VEGA_TORCH_THREADS": "1", **env}
    proc = subprocess.Popen([sys.executable, "-m", "vega", "serve"], env=full, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not become ready")


def bench(port: int, connections: int, seconds: float, length: int, out: Path,
          polite: bool) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "vega.loadgen", f"http://127.0.0.1:{port}",
                    "--mode", "closed", "--connections", str(connections),
                    "--max-connections", str(connections), "--duration-s", str(seconds),
                    "--lengths", str(length), "--mix", "normal=1", "--deadline-ms", "5000",
                    "--out", str(out), "--no-progress",
                    "--honor-retry-after" if polite else "--no-honor-retry-after"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                   timeout=seconds + 120)  # a stuck run fails loudly instead of hanging
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def summary(report: dict[str, Any]) -> dict[str, Any]:
    s = report["summary"]
    sizes = report.get("batches", {}).get("size") or {}
    mean_batch = sizes["sum"] / sizes["count"] if sizes.get("count") else None
    return {"throughput": s["throughput"], "ok_rate": s["ok_rate"],
            "p50_ms": s["latency_ms"]["p50"], "p99_ms": s["latency_ms"]["p99"],
            "by_status": s["counts_by_status"], "mean_batch": mean_batch}


def main() -> int:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    results: dict[str, Any] = {"length": length, "seconds": seconds}
    results["ceiling_items_per_s"] = rates = ceiling(length)
    best = max(rates.values())
    print(f"model alone, L={length}: " + ", ".join(f"b{k}: {v:.0f}/s" for k, v in rates.items()))
    out = Path(tempfile.mkdtemp(prefix="vega-bench-core-"))
    port = 18700
    # Clients wait out a 429's Retry-After, as the header asks, except in the last run,
    # where 1024 connections resend at once: the worst a misbehaving fleet can do.
    for name, env, connections, polite in (
            ("batched_64", {}, 64, True),
            ("unbatched_64", {"VEGA_MAX_BATCH_SIZE": "1"}, 64, True),
            ("batched_1024", {}, 1024, True),
            ("batched_1024_ignoring_retry_after", {}, 1024, False)):
        proc = serve(port, **env)
        try:
            before = rss_kib(proc.pid)
            report = bench(port, connections, seconds, length, out / name, polite)
            after = rss_kib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
        results[name] = {**summary(report), "rss_before_kib": before["VmRSS"],
                         "rss_after_kib": after["VmRSS"], "rss_peak_kib": after["VmHWM"],
                         "fds_before": before["fds"], "fds_after": after["fds"]}
        print(f"{name}: {json.dumps(results[name])}")
        port += 1
    b64, u64, b1024 = results["batched_64"], results["unbatched_64"], results["batched_1024"]
    rude = results["batched_1024_ignoring_retry_after"]
    results["ratios"] = {
        "server_64_vs_ceiling": b64["ok_rate"] / best,
        "batched_vs_unbatched": b64["ok_rate"] / max(u64["ok_rate"], 1e-9),
        "ok_1024_vs_64": b1024["ok_rate"] / b64["ok_rate"],
        "ok_1024_ignoring_retry_after_vs_64": rude["ok_rate"] / b64["ok_rate"],
    }
    print("ratios: " + json.dumps({k: round(v, 2) for k, v in results["ratios"].items()}))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
