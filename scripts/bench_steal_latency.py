"""Added latency of a stolen batch vs a local one (a note, not a test).

An origin runtime in this process and one `vega serve` peer share a Redis. The same
batch of 8 windows is run, one at a time, locally (executor) and handed off (the
peer steals it, runs it, replies): the difference is the overflow round trip.
Usage: scripts/bench-steal-latency REDIS_URL [batches]   (the peer must be running
with the same REDIS_URL and VEGA_MODEL=python:tests.models:echo)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.models import echo, window  # noqa: E402
from vega.config import load_settings  # noqa: E402
from vega.records import CRITICAL, Batch, Item  # noqa: E402
from vega.runtime import Runtime  # noqa: E402


async def main(url: str, count: int) -> None:
    settings = load_settings(environ={"VEGA_REDIS_URL": url, "VEGA_NODE_ID": "bench-origin",
                                      "VEGA_WARMUP_BATCHES": "1", "VEGA_LENGTH_BUCKETS": "16",
                                      "VEGA_MAX_BATCH_SIZE": "8", "VEGA_HEARTBEAT_MS": "200"})
    rt = Runtime(settings, [echo("echo")])
    await rt.start()
    await rt.wait_ready()
    streams = rt.streams
    assert streams is not None
    streams.stealing = False
    while not (streams.up and streams.peers):
        await asyncio.sleep(0.1)
    adapter = rt.models["echo"].adapter
    loop = asyncio.get_running_loop()

    def batch() -> Batch:
        items = []
        for _ in range(8):
            sample, length = adapter.decode(window(4))
            items.append(Item(sample=sample, length=length, priority=CRITICAL,
                              deadline=loop.time() + 5, future=loop.create_future()))
        return Batch(model="echo", bucket=0, items=items, pad_to=4)

    times: dict[str, list[float]] = {"local": [], "stolen": []}
    for i in range(count):
        for kind in ("local", "stolen"):
            b = batch()
            started = time.perf_counter()
            if kind == "local":
                await rt._run_local(b)
            else:
                assert await streams.offer(b, local_wait_s=1.0)
            await asyncio.gather(*(item.future for item in b.items))
            times[kind].append(1000 * (time.perf_counter() - started))
    for kind, values in times.items():
        values.sort()
        print(f"{kind:6s} p50={statistics.median(values):.2f} ms "
              f"p99={values[int(0.99 * (len(values) - 1))]:.2f} ms (n={len(values)})")
    taken = streams.metrics.overflow_events.labels("taken_back")._value.get()
    print(f"taken back: {taken:.0f}")
    await rt.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300))
