"""Benchmark of the async lane: a burst well over capacity, 30% of it able to wait.

    scripts/bench-jobs [--seconds 5] [--rate 1500] [--async-share 0.3]

Runs (each on fresh `vega serve` processes, the echo test model at a fixed cost per
item so capacity is known): the burst without jobs; the same burst with a share sent
with ``Prefer: respond-async``; then two processes sharing a redis-server started
here, one SIGKILLed mid-drain. Reports inline 200s (with/without jobs, their ratio),
when the last job finished against the drain time predicted at the burst's end, jobs
lost (must be 0), and inline p99 of a light load with and without a job backlog
draining. Open loop: latency counts from each request's scheduled send time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.infra import RedisServer  # noqa: E402
from tests.models import window  # noqa: E402
from tests.servers import VegaProcess  # noqa: E402

ENV = {"VEGA_MODEL": "python:tests.models:echo", "TEST_PER_ITEM_MS": "2",
       "VEGA_LENGTH_BUCKETS": "16", "VEGA_CAPACITY_SAMPLE_S": "0.2"}
BODY = orjson.dumps({"inputs": window(16)})


async def burst(urls: list[str], rate: float, seconds: float, share: float,
                connections: int = 256) -> dict[str, Any]:
    """Open loop at ``rate``/s for ``seconds``; every 1/share-th request asks respond-async."""
    count = int(rate * seconds)
    every = round(1 / share) if share > 0 else 0
    results: list[tuple[int, float, bool, str]] = []
    due: asyncio.Queue[int | None] = asyncio.Queue()
    start = time.monotonic()
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        async def schedule() -> None:
            for i in range(count):
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                due.put_nowait(i)
            for _ in range(connections):
                due.put_nowait(None)

        async def worker() -> None:
            while (i := await due.get()) is not None:
                wants = bool(every) and i % every == 0
                headers = {"Prefer": "respond-async"} if wants else {}
                try:
                    r = await client.post(urls[i % len(urls)] + "/v1/infer", content=BODY,
                                          headers=headers)
                    job = r.json().get("id", "") if r.status_code == 202 else ""
                    results.append((r.status_code, time.monotonic() - start - i / rate, wants,
                                    job))
                except httpx.HTTPError:
                    results.append((0, 0.0, wants, ""))

        await asyncio.gather(schedule(), *(worker() for _ in range(connections)))
    ok = [lat for status, lat, _, _ in results if status == 200]
    return {"sent": count, "ok": len(ok), "p99_ms": p99(ok),
            "jobs": [job for *_, job in results if job],
            "refused": sum(1 for r in results if r[0] == 429),
            "errors": sum(1 for r in results if r[0] not in (200, 202, 429)),
            "ended_at": time.monotonic()}


def p99(latencies: list[float]) -> float:
    if not latencies:
        return float("nan")
    ordered = sorted(latencies)
    return round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1)


def predicted_drain_s(urls: list[str]) -> float:
    best = 0.0
    for url in urls:
        try:
            jobs = httpx.get(url + "/v1/status", timeout=5).json()["models"]["echo"]["jobs"]
            best = max(best, float(jobs["predicted_drain_s"]))
        except (httpx.HTTPError, KeyError):
            continue
    return best


async def drain(urls: list[str], jobs: list[str], light_rate: float,
                kill: Any = None) -> dict[str, Any]:
    """Poll every job until final while a light inline load measures inline p99."""
    start = time.monotonic()
    light = asyncio.ensure_future(burst(urls, light_rate, 3, 0, connections=16))
    pending, statuses, last_done = set(jobs), {}, start
    killed = False
    async with httpx.AsyncClient(timeout=10) as client:
        while pending and time.monotonic() - start < 300:
            if kill is not None and not killed and len(pending) < 0.6 * len(jobs):
                kill()  # mid-drain
                killed = True
            live = [u for u in urls if kill is None or not killed or u != urls[0]]
            for job in list(pending)[:200]:
                try:
                    doc = (await client.get(f"{live[-1]}/v1/jobs/{job}")).json()
                except httpx.HTTPError:
                    continue
                if doc.get("status") not in ("queued", "running"):
                    statuses[job] = doc.get("status")
                    pending.discard(job)
                    last_done = time.monotonic()
            await asyncio.sleep(0.05)
    during = await light
    return {"inline_p99_ms_while_draining": during["p99_ms"], "last_done_s": round(last_done - start, 2), "done": sum(
        1 for s in statuses.values() if s == "done"), "lost": len(jobs) - sum(
        1 for s in statuses.values() if s == "done"), "killed": killed}


async def light_only(urls: list[str], rate: float, seconds: float) -> float:
    return float((await burst(urls, rate, seconds, 0, connections=16))["p99_ms"])


def serve(n: int, logs: Path, **env: str) -> list[VegaProcess]:
    procs = [VegaProcess({**ENV, **env}, log_path=logs / f"vega-{time.monotonic_ns()}-{i}.log")
             for i in range(n)]
    for proc in procs:
        proc.start(wait_ready=False)
    for proc in procs:
        proc.wait_ready()
    return procs


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=1500.0)
    parser.add_argument("--async-share", type=float, default=0.3)
    parser.add_argument("--light-rate", type=float, default=40.0)
    parser.add_argument("--per-item-ms", type=float, default=2.0,
                        help="the model's cost per item: capacity is about 1000/this items/s")
    args = parser.parse_args()
    ENV["TEST_PER_ITEM_MS"] = str(args.per_item_ms)
    logs = Path(tempfile.mkdtemp(prefix="bench-jobs-"))
    report: dict[str, Any] = {}

    (plain,) = serve(1, logs)
    urls = [plain.url]
    report["no_jobs"] = {k: v for k, v in (await burst(urls, args.rate, args.seconds, 0)
                                           ).items() if k not in ("jobs", "ended_at")}
    await asyncio.sleep(1)
    report["inline_p99_ms_idle"] = await light_only(urls, args.light_rate, 3)
    plain.kill()

    (one,) = serve(1, logs)
    urls = [one.url]
    with_jobs = await burst(urls, args.rate, args.seconds, args.async_share)
    predicted = predicted_drain_s(urls)
    drained = await drain(urls, with_jobs["jobs"], args.light_rate)
    report["with_jobs"] = {"ok": with_jobs["ok"], "refused": with_jobs["refused"],
                           "jobs": len(with_jobs["jobs"]), "p99_ms": with_jobs["p99_ms"],
                           "predicted_drain_s": predicted, **drained}
    report["ok_ratio"] = round(with_jobs["ok"] / max(1, report["no_jobs"]["ok"]), 3)
    one.kill()

    redis = RedisServer(logs).start()
    pair = serve(2, logs, VEGA_REDIS_URL=redis.url, VEGA_CLAIM_IDLE_MS="1000")
    urls = [p.url for p in pair]
    two = await burst(urls, args.rate, args.seconds, args.async_share)
    predicted = predicted_drain_s(urls)
    drained = await drain(urls, two["jobs"], args.light_rate, kill=pair[0].kill)
    report["two_processes_one_killed"] = {"ok": two["ok"], "jobs": len(two["jobs"]),
                                          "predicted_drain_s": predicted, **drained}
    for proc in pair:
        proc.kill()
    redis.stop()
    print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    lost = report["with_jobs"]["lost"] + report["two_processes_one_killed"]["lost"]
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    asyncio.run(main())
