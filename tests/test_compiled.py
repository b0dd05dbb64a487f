"""A model compiled ahead of time (`vega export`) and served as ``aoti:PATH``."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.models import encoder_small, per_step
from tests.servers import VegaProcess, served_device
from vega.errors import VegaError
from vega.models import SequenceModel, load_model
from vega.models.compiled import CompiledModel, PackageError, read_metadata
from vega.models.export import ExportError, _agrees, export_package
from vega.models.loader import ModelLoadError

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py): one compile, ~20 s

SMALL = "python:tests.models:encoder_small"
ROOT = Path(__file__).resolve().parent.parent
DEVICE = served_device()  # the package is compiled for it
KIND = DEVICE.split(":")[0]
OTHER = "cpu" if KIND == "cuda" else "cuda"


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vega", "export", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compiled") / "small.pt2"
    done = export("--model", SMALL, "--out", str(out), "--device", KIND)
    assert done.returncode == 0, done.stderr[-3000:]
    # Served under the file's name, which is not the model's: the line says so.
    assert f"VEGA_MODEL=aoti:{out}, named small (VEGA_MODEL_NAME=encoder_small keeps " \
        "its name)" in done.stderr
    return out


def reference() -> SequenceModel:
    model = encoder_small("reference")  # the same seed, run eagerly in this process
    model.load(DEVICE)
    return model


def test_the_package_carries_what_serving_it_needs(package: Path) -> None:
    metadata = read_metadata(package)
    assert {key: metadata[f"vega.{key}"] for key in
            ("channels", "max_length", "output_size", "length_multiple", "least_length")} == \
        {"channels": "8", "max_length": "512", "output_size": "4",
         "length_multiple": "8", "least_length": "16"}  # the module pads to whole patches
    model = load_model(f"aoti:{package}")
    assert isinstance(model, CompiledModel) and model.name == "small"
    assert (model.channels, model.max_length, model.module) == (8, 512, None)  # not loaded


@pytest.mark.parametrize("lengths", [[64] * 8, [1, 5, 9, 16, 37, 130, 256], [512, 3]])
def test_the_package_answers_as_the_module_does(package: Path, lengths: list[int]) -> None:
    model = load_model(f"aoti:{package}")
    model.load(DEVICE)
    eager = reference()
    rng = np.random.default_rng(len(lengths))
    samples = [model.decode(rng.standard_normal((n, 8)).tolist())[0] for n in lengths]
    compiled = model.run(samples, max(lengths))
    direct = eager.run(samples, max(lengths))
    assert len(compiled) == len(samples)
    for got, want in zip(compiled, direct):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_auto_serves_the_package_in_a_model_process(
        package: Path, vega: Callable[..., VegaProcess]) -> None:
    proc = vega(VEGA_MODEL=f"aoti:{package}")
    status = httpx.get(proc.url + "/v1/status", timeout=5).json()
    assert status["executor"]["kind"] == "process"
    assert list(status["models"]) == ["small"]
    eager = reference()
    rng = np.random.default_rng(19)
    for length in (3, 41, 200, 512):
        rows = rng.standard_normal((length, 8)).astype(np.float32)
        answer = httpx.post(proc.url + "/v1/infer", timeout=30,
                            content=orjson.dumps({"inputs": rows.tolist()}))
        assert answer.status_code == 200, answer.text
        want = eager.run([rows], length)[0]
        np.testing.assert_allclose(answer.json()["outputs"], want, rtol=0, atol=1e-5)
    # One window a batch, run at the least length (16) and at whole patches (41 -> 48):
    # the padding reported is what the package ran, 13 + 7 steps of 16 + 48 + 200 + 512.
    status = httpx.get(proc.url + "/v1/status", timeout=5).json()
    assert status["models"]["small"]["padding_share"] == round(20 / 776, 4)


def test_a_package_for_another_device_is_refused_before_it_loads(package: Path) -> None:
    model = CompiledModel(str(package), "small")
    with pytest.raises(PackageError, match=f"compiled for {KIND}, not {OTHER}"):
        model.load(OTHER)
    assert model.module is None


def test_what_is_not_a_package_of_vega_export_is_refused_clearly(
        package: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(f"aoti:{tmp_path / 'missing.pt2'}")
    plain = tmp_path / "plain.pt2"
    with zipfile.ZipFile(plain, "w") as archive:
        archive.writestr("plain/archive_format", "pt2")
    with pytest.raises(ModelLoadError, match="not an AOTInductor package"):
        load_model(f"aoti:{plain}")
    # A package whose Vega metadata is gone (an AOTInductor package from elsewhere).
    stripped = tmp_path / "stripped.pt2"
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(stripped, "w") as target:
        for name in source.namelist():
            data = source.read(name)
            if name.endswith("wrapper_metadata.json"):
                data = orjson.dumps({k: v for k, v in orjson.loads(data).items()
                                     if not k.startswith("vega.")})
            target.writestr(name, data)
    with pytest.raises(ModelLoadError, match="not written by `vega export`"):
        load_model(f"aoti:{stripped}")


def test_export_refuses_what_it_cannot_compile(tmp_path: Path) -> None:
    wrong_name = export("--model", SMALL, "--out", str(tmp_path / "small.bin"))
    assert wrong_name.returncode == 2 and "must end in .pt2" in wrong_name.stderr
    unknown = export("--model", "python:tests.models:nothing", "--out", str(tmp_path / "x.pt2"))
    assert unknown.returncode == 2 and "nothing" in unknown.stderr
    # An adapter over a plain callable: said to be no torch module, not blamed on lengths.
    plain = export("--model", "python:tests.models:echo", "--out", str(tmp_path / "e.pt2"))
    assert plain.returncode == 2 and "only a torch module" in plain.stderr, plain.stderr
    nowhere = export("--model", SMALL, "--out", str(tmp_path / "no" / "small.pt2"))
    assert nowhere.returncode == 2 and "no does not exist" in nowhere.stderr
    if KIND == "cpu":  # no GPU here: asked for one, a line saying so, not a traceback
        no_gpu = export("--model", SMALL, "--out", str(tmp_path / "gpu.pt2"), "--device", "cuda")
        assert no_gpu.returncode == 2 and "--device cuda" in no_gpu.stderr
        assert "Traceback" not in no_gpu.stderr
    assert list(tmp_path.iterdir()) == []


def test_export_builds_the_model_under_the_name_it_is_served_by(tmp_path: Path) -> None:
    """A builder keyed by ``name`` is given VEGA_MODEL_NAME (or --name), as `vega serve`
    gives it, not the attribute's name: else another model is compiled."""
    out = str(tmp_path / "x.pt2")
    env_file = tmp_path / "vega.env"
    env_file.write_text("VEGA_MODEL_NAME=forecast\n")
    other = tmp_path / "other.env"
    other.write_text("VEGA_MODEL_NAME=alpha\n")
    by_flag = export("--model", "python:tests.models:echo", "--model-name", "forecast",
                     "--env-file", str(other), "--out", out)  # the flag wins, as in serve
    by_file = export("--model", "python:tests.models:echo", "--env-file", str(env_file),
                     "--out", out)
    by_env = subprocess.run([sys.executable, "-m", "vega", "export", "--model",
                             "python:tests.models:echo", "--out", out], cwd=ROOT, text=True,
                            capture_output=True, timeout=600, check=False,
                            env={**os.environ, "VEGA_MODEL_NAME": "forecast"})
    for done in (by_flag, by_file, by_env):  # the echo adapter cannot be traced: its error
        assert done.returncode == 2 and "model 'forecast'" in done.stderr, done.stderr
    bad = export("--model", "python:tests.models:echo", "--name", "a/b", "--out", out)
    assert bad.returncode == 2 and "VEGA_MODEL_NAME" in bad.stderr and \
        len(bad.stderr.splitlines()) == 1, bad.stderr  # refused as serve refuses it


def test_a_module_that_branches_on_its_values_is_not_compiled(tmp_path: Path) -> None:
    import torch

    class Branchy(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            total = x.sum(dim=(1, 2))[:, None]
            return total if bool(x.sum() > 0) else -total

    model = SequenceModel(Branchy(), "branchy", channels=8, max_length=64, output_size=1)
    with pytest.raises(ExportError, match="cannot trace it"):
        export_package(model, tmp_path / "branchy.pt2")
    assert list(tmp_path.iterdir()) == []


def test_a_per_step_package_answers_each_window_its_own_rows(tmp_path: Path) -> None:
    out = tmp_path / "labeller.pt2"
    done = export("--model", "python:tests.models:per_step", "--out", str(out), "--device", KIND)
    assert done.returncode == 0, done.stderr[-3000:]
    model = load_model(f"aoti:{out}")
    model.load(DEVICE)
    assert isinstance(model, CompiledModel) and model.per_step
    assert model.outputs[0].shape == (-1, 3)
    eager = per_step("reference")
    eager.load(DEVICE)
    rng = np.random.default_rng(4)
    samples = [model.decode(rng.standard_normal((n, 8)).tolist())[0] for n in (1, 5, 17, 40)]
    for sample, rows in zip(samples, model.run(samples, 40)):
        assert rows.shape == (sample.shape[0], 3)
        np.testing.assert_allclose(rows, eager.run([sample], sample.shape[0])[0], atol=1e-5)


def test_a_module_that_needs_its_min_length_is_compiled_and_keeps_it(tmp_path: Path) -> None:
    out = tmp_path / "patches.pt2"
    done = export("--model", "python:tests.models:patches", "--out", str(out), "--device", KIND)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lengths 8..256" in done.stderr
    model = load_model(f"aoti:{out}")
    model.load(DEVICE)
    assert isinstance(model, CompiledModel) and (model.min_length, model.max_length) == (8, 256)
    with pytest.raises(VegaError, match="outside 8..256"):
        model.decode(np.ones((7, 8)).tolist())
    eager = load_model("python:tests.models:patches")
    eager.load(DEVICE)
    rng = np.random.default_rng(8)
    samples = [model.decode(rng.standard_normal((n, 8)).tolist())[0] for n in (8, 13, 100, 256)]
    for sample, got in zip(samples, model.run(samples, 256)):
        np.testing.assert_allclose(got, eager.run([sample], sample.shape[0])[0], atol=1e-5)


def test_a_half_precision_answer_agrees_to_its_own_precision() -> None:
    # A compiler that sums in another order differs in float16's last place, which a
    # float32 tolerance refused: `vega export` refused every float16 module.
    import torch

    def halves(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return (x * 0.1).half().sum(-1)  # summed in float16

    def compiled(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return (x * 0.1).sum(-1).half()  # summed in float32, then rounded

    shape: Any = SimpleNamespace(max_length=32, min_length=1, channels=8)
    assert _agrees(compiled, halves, shape, 1, "cpu")
    assert not _agrees(lambda x, lengths: halves(x, lengths) + 0.01, halves, shape, 1, "cpu")
