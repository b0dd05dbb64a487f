"""conf/vega@.service: it verifies, and its sandbox is tight without locking Vega out."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.infra import require
from tests.servers import ROOT

UNIT = ROOT / "conf" / "vega@.service"


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True,
                          check=False, timeout=60)


def test_the_unit_verifies(tmp_path: Path) -> None:
    require("systemd-analyze")
    # verify insists that ExecStart exists: point it at this checkout's own `vega`.
    text = UNIT.read_text().replace("ExecStart=/opt/vega/.venv/bin/vega",
                                    f"ExecStart={Path(sys.executable).parent / 'vega'}")
    unit = tmp_path / "vega@1.service"
    unit.write_text(text)
    result = analyze("verify", str(unit))
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


def test_the_unit_is_exposed_at_most_3_5() -> None:
    require("systemd-analyze")
    result = analyze("security", "--offline=true", "--threshold=35", str(UNIT))
    report = result.stdout + result.stderr
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", report)
    assert result.returncode == 0 and level is not None, report[-3000:]
    assert float(level.group(1)) <= 3.5, report[-3000:]


def test_the_sandbox_still_lets_vega_work() -> None:
    # A sandbox can score well and break the service: what Vega needs must stay allowed.
    require("systemd-analyze")
    settings = [line.strip() for line in UNIT.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    families = next(line for line in settings if line.startswith("RestrictAddressFamilies="))
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families.split("=", 1)[1].split())
    assert not any(line.startswith(("MemoryDenyWriteExecute=", "ProcSubset=",
                                    "PrivateNetwork=")) for line in settings)
    assert "RuntimeDirectory=vega" in settings and "ProtectSystem=strict" in settings
    # Model processes share memory through memfd_create, and watch the serving process
    # through a pidfd (to exit with it): the call filter must allow both.
    needed = {"memfd_create", "pidfd_open"}
    assert needed <= calls("@system-service")
    denied = [group for line in settings if line.startswith("SystemCallFilter=~")
              for group in line.split("=", 1)[1].lstrip("~").split()]
    for group in denied:
        assert not needed & calls(group), group


def calls(group: str) -> set[str]:
    """The system calls of a systemd call group, nested groups expanded."""
    found: set[str] = set()
    for line in analyze("syscall-filter", group).stdout.splitlines()[1:]:
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        found |= calls(name) if name.startswith("@") else {name}
    return found
