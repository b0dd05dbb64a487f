"""The event loop's CPU per inference request, through the real app in this process.

``scripts/bench_loop [REQUESTS] [--rounds=N]`` (defaults 32000, 3). The real app and
runtime (default settings, the cheap ``python:tests.models:echo_fast`` model in a
thread) answer /v1/infer calls made straight through ASGI by 64 concurrent callers: no
sockets, no load generator. What it reports is the loop's own work per request
(parsing, admission, batching, futures, metrics, the answer), as process CPU time, so
two versions of the hot path can be compared on a shared VM whose speed drifts too much
for a socket benchmark to show a 5% change. Run it in each version's checkout in turn.

``--instructions`` counts instead the machine instructions each request took (the
process run under valgrind's callgrind, counting only the measured requests): the
same to 0.2% from run to run whatever the VM's speed, so a change of a few percent
shows in one run of each version. It needs valgrind and a C compiler, runs ~50 times
slower (1280 requests by default), and gives the requests 30-s deadlines and a
1000-s CoDel interval so that slowness refuses none. Instructions are not time (cache
misses and system calls cost more than they count): confirm a gain in time too.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
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


# Turns callgrind's counting on for the measured requests only, then writes their count.
COUNTER_C = """#include <valgrind/callgrind.h>
void count_from_here(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void count_to_here(void) { CALLGRIND_DUMP_STATS_AT("measured"); CALLGRIND_STOP_INSTRUMENTATION; }
"""
UNDER_CALLGRIND = "VEGA_BENCH_COUNTER"  # the counter library's path, in the counted process
SLOW_SETTINGS = {"VEGA_DEFAULT_DEADLINE_MS": "30000", "VEGA_CODEL_INTERVAL_MS": "1000000"}


async def measure(requests: int) -> float:
    """CPU microseconds per request over ``requests`` calls, after a warm-up; under
    callgrind, only those calls are counted."""
    counter = os.environ.get(UNDER_CALLGRIND)
    library = ctypes.CDLL(counter) if counter else None
    app, runtime = create_app(load_settings(environ={
        "VEGA_MODEL": "python:tests.models:echo_fast", "VEGA_EXECUTOR": "thread",
        "VEGA_TORCH_THREADS": "1", **(SLOW_SETTINGS if counter else {})}))
    await runtime.start()
    await runtime.wait_ready()
    gc.collect()
    gc.freeze()  # as vega serve does once warm (vega.cli.settle_heap)

    async def caller(count: int) -> None:
        for _ in range(count):
            await call(app)

    try:
        await asyncio.gather(*(caller(100) for _ in range(CALLERS)))
        if library is not None:
            library.count_from_here()
        started = time.process_time()
        await asyncio.gather(*(caller(requests // CALLERS) for _ in range(CALLERS)))
        spent = time.process_time() - started
        if library is not None:
            library.count_to_here()
        return 1e6 * spent / (requests // CALLERS * CALLERS)
    finally:
        await runtime.stop()


def count_instructions(requests: int) -> int:
    """Run one round under callgrind; print and return instructions per request."""
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"--instructions needs {tool} (Debian: apt-get install valgrind gcc)")
    requests = requests // CALLERS * CALLERS
    with tempfile.TemporaryDirectory(prefix="vega-bench-loop-") as folder:
        source, library = Path(folder, "counter.c"), Path(folder, "counter.so")
        source.write_text(COUNTER_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
                       check=True)
        out = Path(folder, "callgrind.out")
        counted = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                  f"--callgrind-out-file={out}", sys.executable, __file__,
                                  str(requests), "--rounds=1"],
                                 env={**os.environ, UNDER_CALLGRIND: str(library)},
                                 capture_output=True, text=True, check=False)
        if counted.returncode != 0:
            raise SystemExit(f"the counted run exited {counted.returncode}:\n"
                             f"{counted.stderr[-2000:]}")
        summary = re.search(r"^summary: (\d+)", Path(f"{out}.1").read_text(), re.MULTILINE)
        if summary is None:  # the dump count_to_here writes
            raise SystemExit("callgrind wrote no count for the measured requests")
        total = int(summary.group(1))
    per_request = round(total / requests)
    print(f"{per_request} instructions per request ({requests} requests)")
    return per_request


def main() -> int:
    parser = argparse.ArgumentParser(description="The loop's CPU per request (see the docstring).")
    parser.add_argument("requests", nargs="?", type=int)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per request under callgrind instead")
    options = parser.parse_args()
    if options.requests is not None and options.requests < CALLERS:
        parser.error(f"requests: at least {CALLERS}, one a caller (not {options.requests})")
    if options.rounds < 1:
        parser.error(f"--rounds: at least 1 (not {options.rounds})")
    if options.instructions:
        count_instructions(options.requests or 1280)
        return 0
    options.requests = options.requests or 32000
    results = []
    for number in range(1, options.rounds + 1):
        results.append(uvloop.run(measure(options.requests)))
        print(f"round {number}: {results[-1]:.1f} us of CPU per request", flush=True)
    print(f"median: {statistics.median(results):.1f} us of CPU per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
