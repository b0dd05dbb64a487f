"""New connections while the loop is busy: how long a caller on a fresh connection waits.

``scripts/bench_accept [SECONDS] [--burst=N]`` (defaults 12, 512). One ``vega serve`` at
default settings with a model that costs nothing (``python:tests.models:echo_fast``,
in a thread), so its event loop is what limits it, as under a flood of cache hits.
A closed loop of 256 connections keeps the loop busy for SECONDS; a third of the way
in, N more connections are opened at once, as a burst opens them (callers growing their
pools, Nginx opening upstream connections past its keep-alive cache), and each sends
one request. Reported: the burst's time from connect to answer against the steady
connections' latency in the same run (``burst_p99_vs_steady_p99``), and the burst's
answers by status. A server that accepts new connections slowly leaves them waiting
in its listen queue, before admission sees them and past their deadlines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from bench_core import free_ports, serve  # noqa: E402

PORT = free_ports(1)[0]  # the server this run starts
STEADY = 256
BODY = orjson.dumps({"instances": [np.full((64, 8), 0.5).tolist()]})
REQUEST = (b"POST /v1/infer HTTP/1.1\r\nHost: vega\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


async def first_answer(timeout_s: float) -> tuple[float, int]:
    """Seconds from connecting to the end of the first answer's head, and its status (0: none)."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", PORT)
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
    except (TimeoutError, OSError, asyncio.IncompleteReadError):
        return time.perf_counter() - started, 0
    writer.close()
    return time.perf_counter() - started, status


async def burst(count: int, timeout_s: float) -> list[tuple[float, int]]:
    return list(await asyncio.gather(*(first_answer(timeout_s) for _ in range(count))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", nargs="?", type=float, default=12.0)
    parser.add_argument("--burst", type=int, default=512)
    args = parser.parse_args()
    server = serve(PORT, VEGA_MODEL="python:tests.models:echo_fast", VEGA_EXECUTOR="thread")
    try:
        with tempfile.TemporaryDirectory(prefix="vega-bench-accept-") as out:
            steady = subprocess.Popen(
                [sys.executable, "-m", "vega.lab.loadgen", f"http://127.0.0.1:{PORT}",
                 "--mode", "closed", "--connections", str(STEADY), "--max-connections",
                 str(STEADY), "--duration-s", str(args.seconds), "--lengths", "64",
                 "--mix", "normal=1", "--out", out, "--no-progress", "--honor-retry-after"],
                cwd=ROOT, stdout=subprocess.DEVNULL)
            try:
                time.sleep(args.seconds / 3)
                answers = asyncio.run(burst(args.burst, args.seconds))
                steady.wait(args.seconds + 120)
            finally:  # stopped early (Ctrl-C): it must not write into the folder once removed
                if steady.poll() is None:
                    steady.kill()
                    steady.wait()
            report: dict[str, Any] = json.loads((Path(out) / "report.json").read_text())
    finally:
        server.terminate()
        server.wait(30)
    waits = np.array([seconds for seconds, _ in answers]) * 1000
    statuses = Counter(str(status or "none") for _, status in answers)
    steady_ms = report["summary"]["latency_ms"]
    result = {
        "steady_200_per_s": report["summary"]["ok_rate"],
        "steady_p50_ms": steady_ms["p50"], "steady_p99_ms": steady_ms["p99"],
        "burst": args.burst, "burst_statuses": dict(statuses),
        "burst_p50_ms": round(float(np.percentile(waits, 50)), 1),
        "burst_p99_ms": round(float(np.percentile(waits, 99)), 1),
        "burst_max_ms": round(float(waits.max()), 1),
        "burst_p99_vs_steady_p99": round(float(np.percentile(waits, 99)) / steady_ms["p99"], 2),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
