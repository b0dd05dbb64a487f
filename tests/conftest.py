from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.servers import VegaProcess

pytest_plugins = ["tests.infra", "tests.netns", "tests.redis_topologies", "tests.scheduling"]


def _starter(logs: Path) -> tuple[Callable[..., VegaProcess], list[VegaProcess]]:
    started: list[VegaProcess] = []

    def start(wait_ready: bool = True, **env: str) -> VegaProcess:
        proc = VegaProcess(env, log_path=logs / f"vega-{len(started)}.log")
        started.append(proc)
        return proc.start(wait_ready=wait_ready)

    return start, started


@pytest.fixture
def vega(tmp_path: Path) -> Iterator[Callable[..., VegaProcess]]:
    """Factory: start a real `vega serve` with the given VEGA_*/TEST_* env; stopped after."""
    start, started = _starter(tmp_path)
    yield start
    for proc in started:
        proc.kill()


@pytest.fixture(scope="module")
def vega_module(tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Callable[..., VegaProcess]]:
    """As ``vega``, shared by the tests of one module (each start costs seconds)."""
    start, started = _starter(tmp_path_factory.mktemp("vega"))
    yield start
    for proc in started:
        proc.kill()
