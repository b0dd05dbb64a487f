"""The soak script, shortened: mixed load through Nginx, a fault of each kind, books balanced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.infra import require

pytestmark = pytest.mark.slow(first=True)  # the longest test: no exclusive test waits on it

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_short_soak_keeps_the_books(tmp_path: Path) -> None:
    require("nginx", "redis-server")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--seconds", "26", "--rate", "80",
         "--fault-every-s", "5", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "lost 0, doubled 0, outside the table 0" in result.stdout
    assert result.stdout.count("s: ") >= 4  # every kind of fault happened
