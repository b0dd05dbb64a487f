"""Throughput of one load through /v1 JSON, /v2 JSON and /v2 binary, against one server.

Starts `vega serve` (sensor model, VEGA_TORCH_THREADS=1), then for each mode runs a
closed loop: CONNECTIONS clients each send one window of LENGTH x 8 floats, wait
for the answer, and send the next, for SECONDS in all (after a short unmeasured
warm-up), in ROUNDS slices taken in rotation with the other modes. Bodies are
encoded once beforehand, so the client spends the same per request in every mode
and the difference is the server's decode and encode.

    scripts/bench_oip [--seconds 10] [--connections 32] [--length 64]
                      [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

Request = tuple[str, bytes, dict[str, str]]


def requests_for(mode: str, windows: np.ndarray) -> list[Request]:
    """The pre-encoded (path, body, headers) of each window in ``mode``."""
    out: list[Request] = []
    for x in windows:
        if mode == "v1-json":
            out.append(("/v1/infer", orjson.dumps({"inputs": x.tolist()}), {}))
            continue
        tensor: dict[str, Any] = {"name": "INPUT__0", "shape": [1, *x.shape], "datatype": "FP32"}
        if mode == "v2-json":
            tensor["data"] = x.ravel().tolist()
            out.append(("/v2/models/sensor/infer", orjson.dumps({"inputs": [tensor]}), {}))
        else:
            tensor["parameters"] = {"binary_data_size": x.nbytes}
            header = orjson.dumps({"inputs": [tensor],
                                   "parameters": {"binary_data_output": True}})
            out.append(("/v2/models/sensor/infer", header + x.tobytes(),
                        {"Inference-Header-Content-Length": str(len(header))}))
    return out


async def closed_loop(url: str, requests: list[Request], connections: int,
                      seconds: float) -> tuple[int, Counter[str], list[float]]:
    """(answered, failures by status and body, latencies_s) of ``connections`` clients."""
    latencies: list[float] = []
    failed: Counter[str] = Counter()
    end = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession, start: int) -> None:
        index = start
        while time.perf_counter() < end:
            path, body, headers = requests[index % len(requests)]
            index += 1
            sent = time.perf_counter()
            async with session.post(url + path, data=body, headers=headers) as response:
                answer = await response.read()
                if response.status == 200:
                    latencies.append(time.perf_counter() - sent)
                else:  # both APIs' error bodies start with the code
                    failed[f"{response.status} {_code(answer)}"] += 1

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, i) for i in range(connections)))
    return len(latencies), failed, latencies


def _code(body: bytes) -> str:
    try:
        error = orjson.loads(body)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "?"
    return str(error["code"] if isinstance(error, dict) else error.partition(":")[0])


MODES = ("v1-json", "v2-json", "v2-binary")


async def bench(url: str, args: argparse.Namespace) -> None:
    windows = np.random.default_rng(0).standard_normal(
        (16, args.length, 8)).astype(np.float32)
    requests = {mode: requests_for(mode, windows) for mode in MODES}
    done = dict.fromkeys(MODES, 0)
    failed: dict[str, Counter[str]] = {mode: Counter() for mode in MODES}
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:
        await closed_loop(url, requests[mode], args.connections, 1.0)  # warm-up, not counted
    # Modes take turns in short slices, so a change in the machine's other load
    # (it is shared) falls on all of them alike.
    for _ in range(args.rounds):
        for mode in MODES:
            count, failures, times = await closed_loop(url, requests[mode], args.connections,
                                                       args.seconds / args.rounds)
            done[mode] += count
            failed[mode] += failures
            latencies[mode] += times
    print(f"{args.connections} connections, {args.seconds:g} s per mode in {args.rounds} "
          f"turns, windows of {args.length}x8, one window per request")
    print(f"{'mode':<10} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'failed':>7} "
          f"{'body B':>7}")
    for mode in MODES:
        cuts = statistics.quantiles(latencies[mode], n=100) if len(latencies[mode]) > 1 \
            else [0.0] * 99
        print(f"{mode:<10} {done[mode] / args.seconds:>8.0f} {1000 * cuts[49]:>8.1f} "
              f"{1000 * cuts[98]:>8.1f} {sum(failed[mode].values()):>7} "
              f"{len(requests[mode][0][1]):>7}"
              + (f"  ({', '.join(f'{n} x {what}' for what, n in failed[mode].items())})"
                 if failed[mode] else ""))
    base = done["v1-json"] or 1
    print("ratios to v1-json: " + ", ".join(f"{mode} {done[mode] / base:.2f}x"
                                            for mode in MODES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.servers import VegaProcess  # free port, readiness polled

    server = VegaProcess({"VEGA_TORCH_THREADS": "1", "VEGA_WARMUP_BATCHES": "2"},
                         log_path=Path("/tmp/vega-bench-oip.log"))
    server.start()
    try:
        asyncio.run(bench(server.url, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
