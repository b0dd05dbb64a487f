"""Pressure relief, measured: the fallback model at 10x load, the cache with repeated inputs.

Starts `vega serve` with the built-in sensor model (one torch thread) for each case
and drives it with the load generator's engine (vega.lab.engine: open loop, latency
from the scheduled send time, goodput = answers within their deadline per second).

1. Capacity: a short closed loop finds the throughput C the server sustains.
2. Fallback: open loop at FACTOR x C (default 10) for SECONDS, the loadgen's default
   class mix; once with no fallback, once with VEGA_FALLBACK_MODEL=sensor-small.
   Reports goodput, refusal rate and how many answers the fallback gave.
3. Cache: closed loop for SECONDS with REPEAT (default 30%) of the requests
   repeating one of the last 1000 distinct inputs; cache off, then on.

    scripts/bench_pressure [--seconds 10] [--factor 10] [--repeat 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vega.lab import report as rep
from vega.lab import traffic
from vega.lab.client import Kind, Target
from vega.lab.engine import Engine, offer, settle

# Long windows make the model, not HTTP, the bottleneck: 10x its capacity stays within
# what one Python client can offer.
LENGTH = 256
DEADLINE_S = 1.0
BASE_ENV = {"VEGA_MODEL": "sensor", "VEGA_TORCH_THREADS": "1", "VEGA_WARMUP_BATCHES": "1",
            "VEGA_LENGTH_BUCKETS": str(LENGTH), "VEGA_LOG_LEVEL": "warning"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str, timeout_s: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read())


@contextmanager
def server(**env: str) -> Iterator[str]:
    """A `vega serve` with BASE_ENV + ``env``, until the block ends."""
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("VEGA_")}
    full |= BASE_ENV | env | {"VEGA_PORT": str(port), "PYTHONPATH": str(ROOT)}
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "vega", "serve"], env=full, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            yield _ready(proc, log, url)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ready(proc: subprocess.Popen[bytes], log: Any, url: str) -> str:
    """Poll /readyz until the server is warm."""
    end = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"vega exited: {log.read()[-2000:].decode(errors='replace')}")
        try:
            get(url + "/readyz")
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    return url


def metric(url: str, name: str) -> float:
    """Sum of every sample of ``name`` on /metrics, once the server answers again."""
    started = time.monotonic()
    while True:
        try:
            text = get(url + "/metrics", 10.0).decode()
            break
        except OSError:
            if time.monotonic() - started > 180:
                return float("nan")
    recovered_s = time.monotonic() - started
    if recovered_s > 5:
        print(f"  (the server took {recovered_s:.0f} s to answer /metrics after the load)")
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kind(target: Target, rows: Any, priority: str) -> Kind:
    body = orjson.dumps({"inputs": rows, "priority": priority,
                         "deadline_ms": 1000 * DEADLINE_S})
    return Kind(target.request("POST", target.path, body), priority, DEADLINE_S)


def bodies(target: Target, count: int, repeat: float, rng: np.random.Generator,
           mix: str = "sheddable=70,normal=25,critical=5") -> list[Kind]:
    """``count`` requests, ``repeat`` of them repeating one of the last 1000 distinct ones."""
    weights = traffic.parse_mix(mix)
    classes = rng.choice(list(weights), size=count, p=np.array(list(weights.values())))
    distinct: list[Any] = []
    out = []
    for index in range(count):
        if distinct and rng.random() < repeat:
            rows = distinct[-1000:][int(rng.integers(min(1000, len(distinct))))]
        else:
            rows = np.round(rng.random((LENGTH, 8)), 4).tolist()
            distinct.append(rows)
        out.append(kind(target, rows, str(classes[index])))
    return out


async def closed(url: str, kinds: list[Kind], seconds: float, connections: int = 32
                 ) -> dict[str, Any]:
    target = Target.parse(url, "/v1/infer", None)
    engine = Engine(target, rep.Tally(1.0), connections, 10.0, closed=True)
    cycle = iter(kinds * 1000)
    engine.next_kind = lambda: next(cycle)
    engine.start = time.perf_counter()
    for _ in range(connections):
        engine.open()
    await asyncio.sleep(seconds)
    await settle(engine, 5.0)
    return dict(rep.build_report(engine.tally)["summary"])


async def open_loop(url: str, kinds: list[Kind], rate: float, seconds: float
                    ) -> dict[str, Any]:
    target = Target.parse(url, "/v1/infer", None)
    engine = Engine(target, rep.Tally(1.0), 2000, 10.0)
    count = min(len(kinds), int(rate * seconds))
    times = list(np.arange(count) / rate)
    engine.start = time.perf_counter()
    for _ in range(64):
        engine.open()
    await offer(engine, times, kinds[:count])
    await settle(engine, 5.0)
    return dict(rep.build_report(engine.tally)["summary"])


def refusal_rate(summary: dict[str, Any]) -> float:
    refused = sum(v for k, v in summary["counts_by_status"].items() if k in ("429", "503"))
    return float(refused / max(1, summary["sent"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--repeat", type=float, default=0.3)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    rng = np.random.default_rng(7)
    results: dict[str, Any] = {}

    with server() as url:
        target = Target.parse(url, "/v1/infer", None)
        calibrate = bodies(target, 4000, 0.0, rng)
        capacity = asyncio.run(closed(url, calibrate, 4.0))["ok_rate"]
    rate = args.factor * capacity
    print(f"capacity (closed loop, 32 connections): {capacity:.0f} req/s; "
          f"fallback runs offer {rate:.0f} req/s for {args.seconds:.0f} s", flush=True)

    for label, env in (("fallback off", {}), ("fallback on", {"VEGA_FALLBACK_MODEL": "sensor-small"})):
        with server(**env) as url:
            kinds = bodies(Target.parse(url, "/v1/infer", None), int(rate * args.seconds), 0.0, rng)
            summary = asyncio.run(open_loop(url, kinds, rate, args.seconds))
            degraded = metric(url, "vega_degraded_total")
        results[label] = summary
        print(f"{label:>13}: goodput {summary['goodput']:.0f}/s "
              f"({100 * summary['goodput_ratio']:.1f}% of offered)  "
              f"ok {summary['ok_rate']:.0f}/s  refused {100 * refusal_rate(summary):.1f}%  "
              f"degraded answers {degraded:.0f}  "
              f"p99 {summary['latency_ms'].get('p99')} ms", flush=True)

    for label, env in (("cache off", {}), ("cache on", {"VEGA_CACHE_BYTES": "67108864"})):
        with server(**env) as url:
            kinds = bodies(Target.parse(url, "/v1/infer", None), 20000, args.repeat, rng)
            summary = asyncio.run(closed(url, kinds, args.seconds))
            hits = metric(url, "vega_cache_hits_total")
        results[label] = summary
        print(f"{label:>13}: throughput {summary['ok_rate']:.0f}/s with "
              f"{100 * args.repeat:.0f}% repeated inputs  cache hits {hits:.0f}  "
              f"p50 {summary['latency_ms'].get('p50')} ms  p99 {summary['latency_ms'].get('p99')} ms",
              flush=True)
    out = ROOT / "out" / "bench-pressure.json"
    out.parent.mkdir(exist_ok=True)
    out.write_bytes(orjson.dumps(results, default=float,
                                 option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
