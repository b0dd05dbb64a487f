"""How the suite shares the machine when it runs on several pytest-xdist workers.

``scripts/test`` runs it on four workers, a test file to a worker (``--dist loadfile``,
so a module's servers start once). Two rules keep that both fast and honest:

- Modules marked ``slow`` are handed out first, so the last minute of the run is not
  one long module running alone while the other workers idle (``--no-loadscope-reorder``
  keeps this order; xdist would hand out the modules with the most tests first). Of
  those, ``slow(first=True)`` goes first (the soak: one long test), then the ones
  without an exclusive test: long shared tests then run while no exclusive test waits
  for them to end, holding every worker back.
- A test marked ``exclusive`` (a claim that holds only on cores nobody else is using: a
  load that the server must carry without refusals, a process killed while it holds
  work, a simulator matched against a real run) waits until no other test runs, and
  other workers wait while it runs. Other tests share the cores: most of their time is
  servers starting and waiting.

Across worker processes the second rule is a readers-writer lock over two ``flock``ed
files. Every test first passes a turnstile; an exclusive test holds it while it waits
for the room to empty, so a stream of shared tests cannot starve it. Without workers
(``-n 0``, or plain ``pytest``) nothing is locked. Registered through
``pytest_plugins`` in conftest.py.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

LOCKS_ENV = "TESTS_EXCLUSIVE_LOCKS"  # not VEGA_*: Settings refuses names it does not know
_made = pytest.StashKey[str]()  # the lock folder, in the controller that made it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow modules first, those without exclusive tests before those with; each module's
    tests still together and in order."""
    waiting = {item.path for item in items if item.get_closest_marker("exclusive")}

    def order(item: pytest.Item) -> tuple[bool, bool, bool]:
        slow = item.get_closest_marker("slow")
        return slow is None, not (slow and slow.kwargs.get("first")), item.path in waiting

    items.sort(key=order)


def pytest_configure(config: pytest.Config) -> None:
    workers = getattr(config.option, "numprocesses", None)
    if workers and not hasattr(config, "workerinput") and LOCKS_ENV not in os.environ:
        # The controller makes the lock files before its workers start; they inherit
        # the environment.
        os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="vega-tests-locks-")
        config.stash[_made] = os.environ[LOCKS_ENV]


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_made, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(LOCKS_ENV, None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item,
                            nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Setup, call and teardown of ``item`` under the lock (shared, or alone if marked)."""
    folder = os.environ.get(LOCKS_ENV) if hasattr(item.config, "workerinput") else None
    if not folder:
        return (yield)
    alone = item.get_closest_marker("exclusive") is not None
    with open(Path(folder) / "turnstile", "a") as turnstile, \
            open(Path(folder) / "room", "a") as room:
        _lock(turnstile, fcntl.LOCK_EX)
        _lock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            _unlock(turnstile)
        try:
            return (yield)
        finally:
            _unlock(room)
            if alone:
                _unlock(turnstile)


def _lock(file: IO[str], how: int) -> None:
    fcntl.flock(file.fileno(), how)


def _unlock(file: IO[str]) -> None:
    fcntl.flock(file.fileno(), fcntl.LOCK_UN)
