"""The package layout holds: the lab stays out of the server, modules stay small, nginx ships."""

from __future__ import annotations

import ast
import configparser
import importlib.resources
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tests.servers import VegaProcess

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vega"
LAB = PACKAGE / "lab"
# The command-line entry point imports a lab tool only when its command is run.
MAY_IMPORT_LAB = {PACKAGE / "cli.py"}
MAX_MODULE_LINES = 460


def modules() -> Iterator[Path]:
    return (p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_lab(name: str) -> bool:
    return name == "vega.lab" or name.startswith("vega.lab.")


def lab_imports(source: str, name: str, is_package: bool = False) -> list[str]:
    """What ``source`` (module ``name``) imports of vega.lab: statements at any depth,
    relative ones resolved, and string arguments of import_module / __import__."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_lab(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            found += [t for t in targets if is_lab(t)][:1]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and is_lab(arg.value):
                found.append(arg.value)
    return found


def test_the_import_check_sees_every_form() -> None:
    source = "\n".join([
        "import vega.lab.report", "from vega.lab import traffic", "from vega import lab",
        "from .lab import hdr", "def f():", "    import importlib",
        "    importlib.import_module('vega.lab.simulate')", "import vega.records",
        "from vega import errors"])
    assert lab_imports(source, "vega.somewhere") == [
        "vega.lab.report", "vega.lab", "vega.lab", "vega.lab", "vega.lab.simulate"]
    assert lab_imports("from .lab import x", "vega.pressure", is_package=True) == []
    assert lab_imports("from ..lab import x", "vega.pressure", is_package=True) == ["vega.lab"]


def test_nothing_outside_the_lab_imports_it() -> None:
    offenders = {}
    for path in modules():
        if LAB in path.parents or path in MAY_IMPORT_LAB:
            continue
        found = lab_imports(path.read_text(), module_name(path), path.name == "__init__.py")
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def imported_by(statement: str) -> dict[str, list[str]]:
    """Run ``statement`` in a fresh interpreter; the vega and matplotlib modules it loaded."""
    code = (f"import json, sys\n{statement}\n"
            "print(json.dumps({'vega': sorted(m for m in sys.modules if m.startswith('vega')),"
            " 'matplotlib': sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=True)
    loaded: dict[str, list[str]] = json.loads(result.stdout.splitlines()[-1])
    return loaded


def test_the_server_side_imports_neither_the_lab_nor_matplotlib() -> None:
    loaded = imported_by("import vega.cli, vega.server, vega.runtime")
    assert {"vega.cli", "vega.server", "vega.runtime"} <= set(loaded["vega"])
    assert [m for m in loaded["vega"] if is_lab(m)] == []
    assert loaded["matplotlib"] == []


def test_plots_import_matplotlib_only_when_drawing() -> None:
    loaded = imported_by("import vega.lab.loadgen, vega.lab.simulate, vega.lab.plots")
    assert "vega.lab.plots" in loaded["vega"]
    assert loaded["matplotlib"] == []


def test_no_module_is_over_the_line_limit() -> None:
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules()}
    over = {name: n for name, n in sorted(lengths.items()) if n > MAX_MODULE_LINES}
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines (split them): {over}"


def test_the_nginx_template_ships_as_package_data() -> None:
    resource = importlib.resources.files("vega.lab") / "nginx.conf"
    assert resource.is_file()
    assert "least_conn" in resource.read_text()
    top = ROOT / "nginx.conf"
    assert top.is_symlink()
    assert top.resolve() == (LAB / "nginx.conf").resolve()
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "nginx.conf" in setup["options.package_data"]["vega.lab"].split()


# Imports of vega.lab fail in the server this starts, and each attempt is written down.
BLOCK_LAB = '''
import sys

class BlockLab:
    def find_spec(self, name, path=None, target=None):
        if name == "vega.lab" or name.startswith("vega.lab."):
            with open(__file__ + ".attempts", "a") as log:
                log.write(name + "\\n")
            raise ImportError(f"{name} is blocked: vega serve must not need the lab")
        return None

sys.meta_path.insert(0, BlockLab())
open(__file__ + ".attempts", "a").close()
'''


def test_vega_serve_runs_without_the_lab(vega: Callable[..., VegaProcess],
                                         tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_LAB)
    server = vega(PYTHONPATH=str(blocker), VEGA_MODEL="python:tests.models:echo")
    response = httpx.post(server.url + "/v1/infer", json={"inputs": [[0.5] * 8] * 4},
                          timeout=10)
    assert response.status_code == 200, response.text
    attempts = blocker / "sitecustomize.py.attempts"
    assert attempts.exists()  # the blocker was loaded in the server
    assert attempts.read_text() == ""


def test_every_script_is_run_by_bash_and_its_python_is_the_checkouts() -> None:
    # scripts/bench_oip and bench_pressure ran under the system's python3, without Vega's
    # packages: each Python script is a .py file run by a bash wrapper with .venv's python.
    for script in sorted(p for p in (ROOT / "scripts").iterdir() if p.stat().st_mode & 0o111):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), script.name
        assert "python" not in text or ".venv/bin/python" in text, script.name
