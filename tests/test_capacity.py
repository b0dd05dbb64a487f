"""The capacity signal: rises under sustained overload, falls back when idle, never flaps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import orjson

from tests.models import window
from tests.servers import VegaProcess, wait_until
from vega.pressure.capacity import Capacity, CapacityConfig, Sample

CLASSES = ("critical", "normal", "sheddable")


class Feed:
    """Builds cumulative samples one second apart from per-second figures."""

    def __init__(self, capacity: Capacity, processes: int = 1) -> None:
        self.capacity = capacity
        self.processes = processes
        self.at = 0.0
        self.busy_s = 0.0
        self.refused = 0.0
        self.history: list[int] = []

    def second(self, utilisation: float, refusals_per_s: float = 0.0, queued: int = 0,
               age_s: float = 0.0) -> int:
        self.at += 1.0
        self.busy_s += utilisation
        self.refused += refusals_per_s
        self.capacity.observe(Sample(
            at=self.at, busy_s=self.busy_s, threads=1,
            depth={c: queued if c == "normal" else 0 for c in CLASSES},
            oldest_age_s={c: age_s if c == "normal" else 0.0 for c in CLASSES},
            refusals={"queue_full": self.refused, "draining": 0.0}, item_s=0.002,
            processes=self.processes))
        self.history.append(self.capacity.suggested)
        return self.capacity.suggested

    def changes(self) -> int:
        return sum(a != b for a, b in zip(self.history, self.history[1:]))


def signal() -> Capacity:
    return Capacity(CapacityConfig(target=0.75, grow_after_s=5, shrink_after_s=30))


def test_rises_under_sustained_overload_and_falls_back_only_when_idle() -> None:
    feed = Feed(signal())
    assert feed.second(0.3) == 1
    for _ in range(4):  # overloaded, but not for long enough yet
        assert feed.second(1.0, refusals_per_s=500, queued=200, age_s=0.4) == 1
    for _ in range(5):
        feed.second(1.0, refusals_per_s=500, queued=200, age_s=0.4)
    grown = feed.capacity.suggested
    # 1.0 busy + 500 refused x 2 ms + 200 queued x 2 ms over 5 s = 2.08 -> /0.75 -> 3
    assert grown == 3
    view = feed.capacity.view()
    assert view["refusals_per_s"] == {"queue_full": 500.0} and view["utilisation"] == 1.0
    for _ in range(60):  # busy but keeping up: no reason to grow, none to shrink
        assert feed.second(0.7, queued=3, age_s=0.01) == grown
    for _ in range(30):  # idle, but not yet for the shrink window
        assert feed.second(0.05) == grown
    assert feed.second(0.05) == 1
    assert feed.changes() == 2


def test_alternating_load_does_not_flap() -> None:
    feed = Feed(signal())
    for second in range(200):
        if second % 4 < 2:
            feed.second(1.0, refusals_per_s=300, queued=100, age_s=0.3)
        else:
            feed.second(0.1)
    assert feed.changes() == 0 and feed.capacity.suggested == 1


def test_noisy_overload_grows_once_and_holds() -> None:
    feed = Feed(signal(), processes=2)
    for second in range(120):
        feed.second(0.9 + 0.1 * (second % 3 == 0), refusals_per_s=200 + 100 * (second % 2),
                    queued=50, age_s=0.2)
    assert feed.changes() == 1 and feed.history[0] == 2
    assert feed.capacity.suggested > 2


def test_status_and_metrics_report_the_signal_under_real_load(
        vega: Callable[..., VegaProcess]) -> None:
    server = vega(VEGA_MODEL="python:tests.models:echo", TEST_SLEEP_MS="50",
                  VEGA_MAX_BATCH_SIZE="1", VEGA_LENGTH_BUCKETS="16", VEGA_QUEUE_CAPACITY="16",
                  VEGA_CAPACITY_SAMPLE_S="0.1", VEGA_CAPACITY_GROW_S="0.5",
                  VEGA_CAPACITY_SHRINK_S="1")

    def capacity() -> dict[str, object]:
        view: dict[str, object] = httpx.get(server.url + "/v1/status").json()["capacity"]
        return view

    assert capacity()["suggested_processes"] == 1
    body = orjson.dumps({"inputs": window(8)})

    async def overload_until_it_grows(limit_s: float) -> tuple[dict[str, object], bool]:
        """40 connections sending back to back (a standing queue and refusals): the view
        once it suggests more processes, and whether any view before it reported refusals
        (they come in bursts: consecutive samples under a busy CPU read 250, 0, 150, 230
        and 0 a second, so the sample that grows can hold none)."""
        async with httpx.AsyncClient(timeout=10) as client:
            loop = asyncio.get_running_loop()
            end = loop.time() + limit_s
            view: dict[str, object] = {}
            refusals_seen = False

            async def worker() -> None:
                while loop.time() < end and not view:
                    await client.post(server.url + "/v1/infer", content=body)

            workers = [asyncio.ensure_future(worker()) for _ in range(40)]
            while loop.time() < end:
                await asyncio.sleep(0.1)
                seen = (await client.get(server.url + "/v1/status")).json()["capacity"]
                refusals_seen = refusals_seen or bool(seen["refusals_per_s"])
                if seen["suggested_processes"] > 1:
                    view.update(seen)
                    break
            await asyncio.gather(*workers)
            return view, refusals_seen

    grown, refusals_seen = asyncio.run(overload_until_it_grows(10.0))
    assert grown and refusals_seen, grown
    metrics = httpx.get(server.url + "/metrics").text
    assert "vega_suggested_processes" in metrics and "vega_executor_utilisation" in metrics
    assert 'vega_queue_age_seconds{model="echo",priority="normal"}' in metrics
    wait_until(lambda: capacity()["suggested_processes"] == 1, 10, "the signal to fall back")


def test_the_suggestion_follows_the_fleet_until_it_first_grows_or_shrinks() -> None:
    # The first sample is taken as the process starts, before any peer's beat is read.
    feed = Feed(signal(), processes=1)
    feed.second(0.7)
    feed.processes = 4  # then three peers, each of the four 70% busy, keeping up
    for _ in range(600):
        feed.second(0.7)
    assert feed.capacity.view()["suggested_processes"] == 4
