"""Callers beside one whose window takes the model process down: what they still get.

``scripts/bench_crash [SECONDS] [--period=S] [--connections=N] [--new]`` (defaults 20,
1.0, 32).
Two phases, each on a fresh ``vega serve`` at default settings with a user's eager module
(``python:tests.models:crashing_encoder``, run in a model process), windows of 16..256
steps: N closed-loop callers alone, then the same beside one caller that sends a window
the module crashes on (SIGSEGV) every S seconds, as a caller retrying it would (with
``--new``, a window not sent before each time, which no quarantine knows). Reported
per phase: the other callers' answers by status, and their 200s against the phase
without the crasher (``clean_200_vs_alone``), the restarts of the model process, the
seconds ``/readyz`` answered 503 (polled every 20 ms), and what the crasher got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_core import free_ports, serve  # noqa: E402

from tests.models import CRASH_MARK  # noqa: E402

MODEL = "python:tests.models:crashing_encoder"


def body(length: int, first: float) -> bytes:
    window = np.full((length, 8), 0.5, dtype=np.float32)
    window[0, 0] = first
    return orjson.dumps({"inputs": window.tolist()})


def outcome(answer: httpx.Response) -> str:
    code = answer.json().get("error", {}).get("code", "") if answer.status_code != 200 else ""
    return f"{answer.status_code} {code}".strip()


async def phase(url: str, seconds: float, connections: int, period_s: float, new: bool
                ) -> dict[str, Any]:
    clean: Counter[str] = Counter()
    crasher: Counter[str] = Counter()
    rng = np.random.default_rng(1)
    limits = httpx.Limits(max_connections=connections + 3)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        end = time.monotonic() + seconds

        async def caller() -> None:
            while time.monotonic() < end:
                answer = await client.post(url + "/v1/infer", content=body(
                    int(rng.integers(16, 257)), float(rng.random())))
                clean[outcome(answer)] += 1
                if answer.status_code == 503:  # Retry-After is whole seconds: a shorter pause
                    await asyncio.sleep(0.05)

        async def crashing() -> None:
            await asyncio.sleep(2.0)  # the others' traffic first
            sent = 0
            while period_s and time.monotonic() < end:
                sent += 1
                crashing = body(64 + (sent % 192 if new else 0), CRASH_MARK)
                crasher[outcome(await client.post(url + "/v1/infer", content=crashing))] += 1
                await asyncio.sleep(max(0.0, min(period_s, end - time.monotonic())))

        async def readiness() -> float:
            """Seconds the server answered /readyz 503 (no model process up), polled."""
            down, last = 0.0, time.monotonic()
            while time.monotonic() < end:
                up = (await client.get(url + "/readyz")).status_code == 200
                now = time.monotonic()
                down += 0.0 if up else now - last
                last = now
                await asyncio.sleep(0.02)
            return down

        down, *_ = await asyncio.gather(readiness(), crashing(),
                                        *(caller() for _ in range(connections)))
        metrics = (await client.get(url + "/metrics")).text
    restarts = sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("vega_model_process_restarts_total"))
    return {"clean": dict(clean), "crasher": dict(crasher), "restarts": int(restarts),
            "not_ready_s": round(down, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", nargs="?", type=float, default=20.0)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--new", action="store_true", help="a new crashing window each time")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    for name, period_s in (("alone", 0.0), ("beside_crasher", args.period)):
        port = free_ports(1)[0]
        server = serve(port, VEGA_MODEL=MODEL)
        try:
            result[name] = asyncio.run(phase(f"http://127.0.0.1:{port}", args.seconds,
                                             args.connections, period_s, args.new))
        finally:
            server.terminate()
            server.wait(30)
    alone = result["alone"]["clean"].get("200", 0)
    beside = result["beside_crasher"]["clean"]
    result["clean_200_vs_alone"] = round(beside.get("200", 0) / max(alone, 1), 2)
    result["clean_200_share_beside"] = round(beside.get("200", 0) / max(sum(beside.values()), 1), 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
