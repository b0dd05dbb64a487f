"""The event loop's CPU per inference request, through the real app in this process.

``scripts/bench_loop [REQUESTS] [--rounds=N]`` (defaults 32000, 3). The real app and
runtime (default settings, the cheap ``python:tests.models:echo_fast`` model in a
thread) answer /v1/infer calls made straight through ASGI by 64 concurrent callers: no
sockets, no load generator. What it reports is the loop's own work per request
(parsing, admission, batching, futures, metrics, the answer), as process CPU time, so
two versions of the hot path can be compared on a shared VM whose speed drifts too much
for a socket benchmark to show a 5% change. Run it in each version's checkout in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vega.config import load_settings  # noqa: E402
from vega.server import create_app  # noqa: E402

CALLERS = 64
BODY = orjson.dumps({"instances": [
    np.random.default_rng(0).standard_normal((64, 8)).round(6).tolist()]})
SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
         "scheme": "http", "path": "/v1/infer", "raw_path": b"/v1/infer", "query_string": b"",
         "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
         "headers": [(b"host", b"vega"), (b"content-type", b"application/json"),
                     (b"content-length", str(len(BODY)).encode())]}


async def call(app: Any) -> None:
    """One request, as a server would hand it to the app."""
    read = False
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # the caller stays connected
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(dict(SCOPE), receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"answered {sent[0]['status']}: {sent[1].get('body')!r}")


async def measure(requests: int) -> float:
    """CPU microseconds per request over ``requests`` calls, after a warm-up."""
    app, runtime = create_app(load_settings(environ={
        "VEGA_MODEL": "python:tests.models:echo_fast", "VEGA_EXECUTOR": "thread",
        "VEGA_TORCH_THREADS": "1"}))
    await runtime.start()
    await runtime.wait_ready()
    gc.collect()
    gc.freeze()  # as vega serve does once warm (vega.cli.settle_heap)

    async def caller(count: int) -> None:
        for _ in range(count):
            await call(app)

    try:
        await asyncio.gather(*(caller(100) for _ in range(CALLERS)))
        started = time.process_time()
        await asyncio.gather(*(caller(requests // CALLERS) for _ in range(CALLERS)))
        return 1e6 * (time.process_time() - started) / (requests // CALLERS * CALLERS)
    finally:
        await runtime.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description="The loop's CPU per request (see the docstring).")
    parser.add_argument("requests", nargs="?", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    results = []
    for number in range(1, options.rounds + 1):
        results.append(uvloop.run(measure(options.requests)))
        print(f"round {number}: {results[-1]:.1f} us of CPU per request", flush=True)
    print(f"median: {statistics.median(results):.1f} us of CPU per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
