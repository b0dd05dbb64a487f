"""Model adapters: validation on decode, batching independence, the loaders."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.inproc import in_process
from tests.models import per_patch, per_step, three_channels
from vega.errors import VegaError
from vega.models import SequenceModel, identity, load_model
from vega.models.digest import state_bytes
from vega.models.fitted import fitted
from vega.models.loader import ModelLoadError


@pytest.fixture(scope="module")
def sensor() -> SequenceModel:
    model = load_model("sensor")
    model.load("cpu")
    assert isinstance(model, SequenceModel)
    return model


def test_decode_accepts_windows_and_reports_length(sensor: SequenceModel) -> None:
    sample, length = sensor.decode([[1, 2, 3, 4, 5, 6, 7, 8]] * 3)
    assert length == 3 and sample.dtype == np.float32 and sample.shape == (3, 8)


@pytest.mark.parametrize("instance", [
    [], "abc", [[1.0] * 7], [[1.0] * 8, [1.0]], [[None] * 8], [[{"a": 1}] * 8],
    [[10 ** 400] * 8], [[1e39] * 8], [[[1.0] * 8]], [[1.0] * 8] * 513,
    [[float("nan")] * 8], [[1.0] * 8] * 300 + [[-float("inf")] + [1.0] * 7],
    [[1.0] * 8] * 300 + [[1.0] * 7 + [-1e39]],  # past the first block converted
    [["1.5"] * 8], [[0.5] * 7 + ["1"]], ["abcdefgh"], [{str(k): 1.0 for k in range(8)}],
    [[True] * 8],
])
def test_decode_refuses_bad_instances_with_invalid_input(sensor: SequenceModel,
                                                         instance: object) -> None:
    with pytest.raises(VegaError) as caught:
        sensor.decode(instance)
    assert caught.value.code == "invalid_input"


@pytest.mark.parametrize("length", [1, 62, 63, 300, 512])
def test_decode_converts_every_block_of_a_long_window(sensor: SequenceModel, length: int) -> None:
    window = np.random.default_rng(length).standard_normal((length, 8)) * 1e30
    sample, _ = sensor.decode(window.tolist())
    np.testing.assert_array_equal(sample, window.astype(np.float32))
    as_float32 = window.astype(np.float32)
    assert sensor.decode(as_float32)[0] is as_float32  # already float32: checked, not copied


def test_decode_checks_every_value_of_a_strided_array(sensor: SequenceModel) -> None:
    window = np.zeros((600, 8), dtype=np.float32)
    window[599, 7] = np.nan
    with pytest.raises(VegaError) as caught:
        sensor.decode(window[1::2])  # not contiguous; its last row holds the NaN
    assert caught.value.code == "invalid_input"
    assert sensor.decode(window[:598:2])[1] == 299


def _windows() -> list[object]:
    """Windows, good and bad, of every kind a JSON body can hold."""
    rng = np.random.default_rng(7)
    normal = [rng.standard_normal((n, 8)).round(6).tolist() for n in (1, 2, 62, 63, 64, 300, 512)]
    zeros = rng.standard_normal((40, 8))
    zeros[rng.random((40, 8)) < 0.3] = 0.0
    row = [0.5] * 7
    return [*normal, zeros.tolist(), rng.integers(-1000, 1000, (9, 8)).tolist(),
            [[2 ** 62] * 8], [[1, 2.5] * 4] * 3, [[3.4028234e38, -0.0, 1e-45, 1e-50] * 2],
            [[3.5e38] + row], [[1.0] * 8] * 513, [[1.0] * 8, [1.0] * 7], [[1.0] * 9],
            [[1.0] * 7, [1.0] * 9],  # ragged, though as many values as two rows hold
            [row + [True]], [[True] + row], [[True] * 8], [[False] * 8] * 2,
            [row + [None]], [row + ["1.5"]], [row + [[1.0]]], [[]], [], ["abcdefgh"],
            [{str(k): 1.0 for k in range(8)}], [row + [float("nan")]], [(1.0,) * 8], 5]


@pytest.mark.parametrize("instance", _windows())
def test_decode_answers_as_the_general_path_does(sensor: SequenceModel,
                                                 instance: object) -> None:
    general = load_model("sensor")
    assert isinstance(general, SequenceModel)
    general._packed = lambda _instance: None  # type: ignore[method-assign, assignment]

    def outcome(model: SequenceModel) -> tuple[object, ...]:
        try:
            sample, length = model.decode(instance)
        except VegaError as error:
            return ("refused", error.code, error.message)
        return ("ok", sample.dtype, sample.shape, sample.tobytes(), length)

    assert outcome(sensor) == outcome(general)


def test_outputs_do_not_depend_on_batch_mates(sensor: SequenceModel) -> None:
    rng = np.random.default_rng(0)
    samples = [sensor.decode(rng.standard_normal((n, 8)).tolist())[0] for n in (1, 9, 64, 200)]
    batched = sensor.run(samples, 200)
    for sample, row in zip(samples, batched):
        np.testing.assert_allclose(sensor.run([sample], sample.shape[0])[0], row, atol=1e-5)


def test_a_per_step_output_is_cut_back_to_each_windows_length() -> None:
    model = per_step("labeller")
    model.load("cpu")
    assert model.per_step and model.outputs[0].shape == (-1, 3)
    rng = np.random.default_rng(1)
    samples = [model.decode(rng.standard_normal((n, 8)).tolist())[0] for n in (1, 9, 64, 200)]
    batched = model.run(samples, 200)
    for sample, rows in zip(samples, batched):
        assert rows.shape == (sample.shape[0], 3)
        np.testing.assert_allclose(rows, model.run([sample], sample.shape[0])[0], atol=1e-5)


@pytest.mark.parametrize("size", [16, 32])
def test_an_output_as_long_as_a_probed_window_is_still_one_per_window(size: int) -> None:
    class Fixed(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=(1, 2))[:, None].expand(x.shape[0], size)

    model = SequenceModel(Fixed(), "fixed", channels=8, max_length=64)
    model.load("cpu")
    assert not model.per_step and model.outputs[0].shape == (size,)  # was -1: not known
    rows = model.run([np.ones((3, 8), np.float32), np.ones((20, 8), np.float32)], 20)
    assert [row.shape for row in rows] == [(size,), (size,)]
    np.testing.assert_allclose(rows[0], 24.0)


def test_a_model_of_one_length_only_states_its_output_shape() -> None:
    class OneStep(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x[:, 0, :2]

    model = SequenceModel(OneStep(), "one_step", channels=8, max_length=1)
    model.load("cpu")
    assert not model.per_step and model.outputs[0].shape == (2,)  # was -1: never probed


def test_a_module_failing_on_a_one_step_window_is_warned_about_at_load(
        caplog: pytest.LogCaptureFixture) -> None:
    class Conv(torch.nn.Module):  # a kernel of 5 steps, no padding: 1-4 steps fail
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 4, 5)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.conv(x.transpose(1, 2))
            return out.amax(-1)

    with caplog.at_level("WARNING", logger="vega.models"):
        SequenceModel(Conv(), "conv", channels=8, max_length=64).load("cpu")
    shortest = [r.getMessage() for r in caplog.records if "1-step window" in r.getMessage()]
    assert len(shortest) == 1 and "model 'conv'" in shortest[0]
    assert "RuntimeError" in shortest[0] and "1..64 steps are accepted" in shortest[0]


def test_a_half_precision_module_is_not_warned_about_for_its_rounding(
        caplog: pytest.LogCaptureFixture) -> None:
    class Last(torch.nn.Module):  # each window's last real step through an LSTM: masked
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lstm = torch.nn.LSTM(8, 16, batch_first=True)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.lstm(x)[0]
            return out[torch.arange(x.shape[0]), lengths - 1]

    for dtype in (torch.float16, torch.bfloat16):
        caplog.clear()
        with caplog.at_level("WARNING", logger="vega.models"):
            SequenceModel(fitted(Last().to(dtype)), "half", channels=8, max_length=64).load("cpu")
        assert not caplog.records, caplog.text


def test_an_output_that_follows_the_length_otherwise_is_refused_at_load() -> None:
    model = per_patch("patches")
    shapes = r"\[2, 3\] at 16 steps, \[4, 3\] at 32"
    with pytest.raises(ValueError, match=shapes + ".*not one row per step"):
        model.load("cpu")


def test_a_module_answering_anything_but_one_tensor_is_refused_at_load() -> None:
    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return x.sum(dim=1), x.mean(dim=1)

    with pytest.raises(TypeError, match="returned a tuple, not a tensor"):
        SequenceModel(Pair(), "pair", channels=8, max_length=64).load("cpu")


def test_a_module_answering_one_number_for_its_batch_is_refused_at_load_saying_so() -> None:
    class Squeezed(torch.nn.Module):  # [B] from [B, 1], but [] for a batch of one
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=(1, 2))[:, None].squeeze()

    with pytest.raises(TypeError, match=r"returned one number for a batch of 1, not a tensor "
                                        r"\[B, \.\.\.\] with a row per window"):
        SequenceModel(Squeezed(), "squeezed", channels=8, max_length=64).load("cpu")


def test_a_module_whose_answers_depend_on_batch_mates_is_warned_about_at_load(
        caplog: pytest.LogCaptureFixture) -> None:
    class Mean(torch.nn.Module):  # a mean over every step, padding too: lengths unused
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=1)

    class MaskedMean(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1) / lengths[:, None].to(x.dtype)

    class Centred(MaskedMean):  # each answer less the batch's mean answer
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            means = super().forward(x, lengths)
            return means - means.mean(dim=0)

    with caplog.at_level("WARNING", logger="vega.models"):
        SequenceModel(MaskedMean(), "masked", channels=8, max_length=64).load("cpu")
        assert not caplog.records
        SequenceModel(Mean(), "mean", channels=8, max_length=64).load("cpu")
        SequenceModel(Centred(), "centred", channels=8, max_length=64).load("cpu")
    mean, centred = (record.getMessage() for record in caplog.records)
    assert "model 'mean': a 16-step window's answer moved" in mean
    assert "batched with a 32-step window" in mean and "reads the padding past" in mean
    assert "model 'centred'" in centred and "mixes the windows of a batch" in centred


def test_a_module_answering_nan_at_load_is_warned_about_as_such_not_as_reading_padding(
        caplog: pytest.LogCaptureFixture) -> None:
    class Nan(torch.nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1) * float("nan")

    class Inverse(torch.nn.Module):  # finite alone; the zeros padding it give infinity
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return (1 / x).sum(dim=1)

    with caplog.at_level("WARNING", logger="vega.models"):
        SequenceModel(Nan(), "nan", channels=8, max_length=64).load("cpu")
        SequenceModel(Inverse(), "inverse", channels=8, max_length=64).load("cpu")
    nan, inverse = (record.getMessage() for record in caplog.records)
    assert "model 'nan' answers NaN or infinity for a plain 16-step window" in nan
    assert "500 model_error" in nan and "padding" not in nan and "moved" not in nan
    assert "model 'inverse' answers a 16-step window with NaN or infinity" in inverse
    assert "reads the padding past `lengths`" in inverse and "moved" not in inverse


def test_a_module_taking_only_x_is_served_and_its_padding_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="vega.models"):
        model = load_model("python:tests.models:no_lengths")
        model.load("cpu")
    assert "no_lengths" in caplog.text and "forward takes no `lengths`" in caplog.text
    windows = [np.full((5, 8), 1.0, np.float32), np.full((5, 8), 3.0, np.float32)]
    np.testing.assert_allclose(np.stack(model.run(windows, 5)), np.full((2, 8), [[2.0], [6.0]]))


def test_a_module_taking_lengths_by_keyword_only_is_given_them(
        caplog: pytest.LogCaptureFixture) -> None:
    class KeywordMean(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, lengths: torch.Tensor | None = None
                    ) -> torch.Tensor:
            if lengths is None:
                return x.mean(dim=1)  # reads the padding
            return x.sum(dim=1) / lengths[:, None].to(x.dtype)

    with caplog.at_level("WARNING", logger="vega.models"):
        model = SequenceModel(fitted(KeywordMean()), "keyword", channels=8, max_length=64)
        model.load("cpu")
    assert not caplog.records, caplog.text
    windows = [np.full((2, 8), 1.0, np.float32), np.full((6, 8), 3.0, np.float32)]
    np.testing.assert_allclose(np.stack(model.run(windows, 6)), np.full((2, 8), [[1.0], [3.0]]))


def test_a_module_with_float64_weights_gets_its_windows_cast_to_them() -> None:
    model = load_model("python:tests.models:float64")
    model.load("cpu")  # the module asserts that it was given float64
    windows = [np.full((n, 8), float(n), np.float32) for n in (3, 7)]
    rows = model.run(windows, 7)
    assert [row.dtype for row in rows] == [np.float32, np.float32]
    np.testing.assert_allclose(np.stack(rows), np.outer([3, 7], np.linspace(0.5, 2.0, 8)),
                               rtol=1e-6)


def test_a_module_that_cannot_take_the_windows_says_what_it_was_given() -> None:
    model = load_model("python:tests.models:three_channels")
    with pytest.raises(RuntimeError, match=r"x \[1, 16, 8\] float32.*`vega_channels`.*mat1"):
        model.load("cpu")
    assert isinstance(model, SequenceModel)
    told = SequenceModel(model.module, "three", channels=3, max_length=64)  # as vega_channels
    told.load("cpu")
    assert told.run([np.ones((4, 3), np.float32)], 4)[0].shape == (2,)


def test_only_a_module_vega_cannot_call_as_it_is_gets_wrapped() -> None:
    from vega.models.fitted import fitted

    plain = torch.nn.Linear(8, 2)
    assert fitted(plain) is not plain  # forward(input): no lengths
    masked = load_model("python:tests.models:window_sum")  # an adapter: left alone
    assert isinstance(masked, SequenceModel) and type(masked.module).__name__ == "Sum"

    takes = three_channels("three")  # forward(x, lengths), float32 weights
    assert fitted(takes) is takes
    assert fitted(takes.half()).dtype == torch.float16  # cast to, lengths still given


def test_a_module_left_in_train_mode_runs_in_eval_mode_under_inference_mode() -> None:
    # As docs/how-it-works.md says: its dropout does nothing, and it needs no no_grad.
    class Dropped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = torch.nn.Dropout(0.9)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            assert torch.is_inference_mode_enabled()
            dropped: torch.Tensor = self.drop(x.sum(dim=1) / lengths[:, None].to(x.dtype))
            return dropped

    model = SequenceModel(Dropped().train(), "dropped", channels=8, max_length=64)
    model.load("cpu")
    windows = [np.full((n, 8), 2.0, np.float32) for n in (3, 40)]
    np.testing.assert_allclose(np.stack(model.run(windows, 40)), np.full((2, 8), 2.0))


def test_a_compiled_module_is_called_as_the_module_it_compiled() -> None:
    # torch.compile's wrapper takes (*args, **kwargs): what its module takes is behind it.
    class Mean(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=1)

    class KeywordSum(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1) / lengths[:, None].to(x.dtype)

    windows = [np.full((4, 8), 1.0, np.float32), np.full((4, 8), 3.0, np.float32)]
    for module in (Mean(), KeywordSum()):
        compiled = torch.compile(module, backend="eager")  # traced, no compiler needed
        model = SequenceModel(fitted(compiled), "compiled", channels=8, max_length=64)
        model.load("cpu")
        np.testing.assert_allclose(np.stack(model.run(windows, 4)),
                                   np.full((2, 8), [[1.0], [3.0]]))


# TorchScript is deprecated in torch 2.13 but still what many teams have saved.
@pytest.mark.filterwarnings("ignore:`torch.jit.*deprecated:DeprecationWarning")
def test_a_torchscript_module_taking_only_x_is_served(tmp_path: Path) -> None:
    class Last(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, -1]

    path = tmp_path / "last.pt"
    torch.jit.script(Last()).save(str(path))  # type: ignore[no-untyped-call]
    model = load_model(f"torchscript:{path}")
    model.load("cpu")
    window = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_allclose(model.run([window], 2)[0], window[-1])


def test_a_univariate_window_may_be_sent_flat() -> None:
    model = SequenceModel(torch.nn.Identity(), "one", channels=1, max_length=8)
    flat, length = model.decode([1, 2, 3])
    nested, _ = model.decode([[1], [2], [3]])
    assert length == 3 and flat.shape == (3, 1) and flat.dtype == np.float32
    np.testing.assert_array_equal(flat, nested)
    for bad in ([1, "x"], [[1, 2], [3, 4]], list(range(9))):
        with pytest.raises(VegaError):
            model.decode(bad)
    with pytest.raises(VegaError, match=r"expected shape \[L, 8\], got \[3\]"):
        SequenceModel(torch.nn.Identity(), "eight", channels=8, max_length=8).decode([1, 2, 3])


def test_weights_are_fixed_by_seed() -> None:
    a, b = load_model("sensor"), load_model("sensor")
    sample = a.example(32)
    np.testing.assert_array_equal(a.run([sample], 32)[0], b.run([sample], 32)[0])


# TorchScript is deprecated in torch 2.13 but still what many teams have saved.
@pytest.mark.filterwarnings("ignore:`torch.jit.*deprecated:DeprecationWarning")
def test_torchscript_model_loads_with_its_attributes(tmp_path: Path) -> None:
    class Mean(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vega_channels = 3
            self.vega_max_length = 10

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1) / lengths[:, None].to(x.dtype)

    path = tmp_path / "mean.pt"
    torch.jit.script(Mean()).save(str(path))  # type: ignore[no-untyped-call]
    model = load_model(f"torchscript:{path}")
    model.load("cpu")
    assert (model.name, model.max_length) == ("mean", 10)
    sample, _ = model.decode([[1, 2, 3], [3, 4, 5]])
    np.testing.assert_allclose(model.run([sample], 4)[0], [2, 3, 4])
    with pytest.raises(VegaError):
        model.decode([[1, 2, 3, 4]])


def test_outputs_come_back_as_float32_whatever_the_module_returns() -> None:
    # run() skips the conversions a float32 CPU output does not need; the rest still happen.
    class Scaled(torch.nn.Module):
        def __init__(self, dtype: torch.dtype) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((1, 3), 2.0, dtype=dtype))

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.sum(dim=1).to(self.scale.dtype) * self.scale

    class Weights(Scaled):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return self.scale.expand(x.shape[0], 3)  # a view that still requires grad

    samples = [np.ones((2, 3), dtype=np.float32), np.ones((1, 3), dtype=np.float32)]
    for module, expected in ((Scaled(torch.float64), [[4, 4, 4], [2, 2, 2]]),
                             (Scaled(torch.float16), [[4, 4, 4], [2, 2, 2]]),
                             (Weights(torch.float32), [[2, 2, 2], [2, 2, 2]])):
        model = SequenceModel(module, "m", channels=3, max_length=4)
        model.load("cpu")
        rows = model.run(samples, 2)
        assert [row.dtype for row in rows] == [np.float32, np.float32]
        np.testing.assert_allclose(np.stack(rows), expected)


def test_python_factory_and_bad_specs() -> None:
    model = load_model("python:tests.models:echo", "custom")
    assert model.name == "custom"
    assert load_model("python:tests.models:echo_named_itself", "custom").name == "custom"
    # A module that says its answers are draws is not cached (docs/pressure.md).
    assert not load_model("python:tests.models:sampled").deterministic
    for spec in ("nope", "python:tests.models", "python:no_such_module:x",
                 "torchscript:/no/such.pt"):
        with pytest.raises(ModelLoadError):
            load_model(spec)


def test_a_python_model_is_found_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``vega serve`` (a console script, whose path does not hold the working directory)
    loads ``python:mypackage.models:build`` from where it was started."""
    (tmp_path / "vega_user_models.py").write_text(
        "import torch\n\n"
        "class Mean(torch.nn.Module):\n"
        "    def forward(self, x, lengths):\n"
        "        return x.mean(dim=1)\n\n"
        "def build(name):\n"
        "    return Mean()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "vega_user_models", raising=False)
    model = load_model("python:vega_user_models:build", "mine")
    model.load("cpu")
    window = model.decode(np.full((4, 8), 2.0).tolist())[0]
    np.testing.assert_allclose(model.run([window], 4)[0], np.full(8, 2.0))
    assert sys.path[-1] == str(tmp_path)  # after every installed package


def test_python_names_a_module_a_factory_or_a_class_as_a_user_writes_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "vega_user_kinds.py").write_text(
        "import torch\n\n"
        "class Sum(torch.nn.Module):\n"
        "    def forward(self, x, lengths):\n"
        "        return x.sum(dim=1)\n\n"
        "model = Sum()\n"
        "def build():\n"
        "    return Sum()\n"
        "def build_named(name, device='cpu'):\n"
        "    return Sum()\n"
        "def broken(name):\n"
        "    raise FileNotFoundError('weights.pt')\n"
        "def two(name, device):\n"
        "    return Sum()\n"
        "def variant(size=8):\n"  # a default is the user's: not given the model's name
        "    assert size == 8, size\n"
        "    return Sum()\n"
        "def named_default(name='x', size=8):\n"
        "    assert name == 'named_default' and size == 8, (name, size)\n"
        "    return Sum()\n"
        "class Configured(torch.nn.Module):\n"
        "    def __init__(self, hidden=4):\n"
        "        super().__init__()\n"
        "        assert hidden == 4, hidden\n"
        "    def forward(self, x, lengths):\n"
        "        return x.sum(dim=1)\n"
        "def forgot_return():\n"
        "    Sum()\n"
        "def plain_function():\n"
        "    return lambda x, lengths: x.sum(dim=1)\n"
        "number = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "vega_user_kinds", raising=False)
    window = np.ones((2, 8), np.float32)
    for attr in ("model", "build", "build_named", "Sum", "variant", "named_default",
                 "Configured"):  # an instance, factories, classes
        model = load_model(f"python:vega_user_kinds:{attr}")
        model.load("cpu")
        assert model.name == attr
        np.testing.assert_allclose(model.run([window], 2)[0], np.full(8, 2.0))
    with caplog.at_level("ERROR", logger="vega.models"):
        with pytest.raises(ModelLoadError, match="building the model raised FileNotFoundError"):
            load_model("python:vega_user_kinds:broken")
    assert "raise FileNotFoundError" in caplog.text  # the user's traceback, in the log
    for attr, message in (("two", "takes neither the model's name nor nothing"),
                          ("number", "found 'int', not a torch module"),
                          ("forgot_return", "nor a torch module: got None \\(does the builder"),
                          ("plain_function", "nor a torch module: got function")):
        with pytest.raises(ModelLoadError, match=message):
            load_model(f"python:vega_user_kinds:{attr}")


def test_torchscript_compiles_at_load_not_in_the_first_timed_pass() -> None:
    # TorchScript's profiling executor compiles on a module's second call (~300 ms here);
    # load() makes both calls, so warm-up and `vega profile` time only compiled passes.
    model = load_model("sensor")
    assert isinstance(model, SequenceModel)
    model.load("cpu")
    assert isinstance(model.module, torch.jit.ScriptModule)
    assert len(model.module.get_debug_state().execution_plans) >= 1


def test_a_scripted_models_identity_is_the_same_before_and_after_it_is_loaded() -> None:
    # The serving process hashes the built-in model unloaded, its model process (or its
    # peers, or its cache) loaded, where the module is TorchScript by then.
    built = identity(load_model("sensor-small"))
    loaded = load_model("sensor-small")
    loaded.load("cpu")
    assert identity(loaded) == built


def test_a_module_defined_where_no_source_file_tells_has_an_identity() -> None:
    code = ("import torch\n"
            "from vega.models import SequenceModel, identity\n"
            "class M(torch.nn.Module):\n"
            "    def forward(self, x, lengths):\n"
            "        return x.mean(1)\n"
            "print(identity(SequenceModel(M(), 'm', channels=8, max_length=16)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("1:"), done.stderr[-500:]


def test_new_code_under_the_same_weights_changes_a_modules_identity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A rolling deploy of a new forward with the same weights: peers must not run each
    # other's batches, nor the cache answer with the old code's answers.
    source = (
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        torch.manual_seed(0)\n"
        "        self.lin = torch.nn.Linear(8, 4)\n"
        "    def forward(self, x, lengths):\n"
        "        return self.lin(x.mean(1)){}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    identities = []
    for n, change in enumerate(("", " + 100")):
        (tmp_path / f"net{n}.py").write_text(source.format(change))
        identities.append(identity(load_model(f"python:net{n}:Net")))
    (tmp_path / "net2.py").write_text(source.format(""))  # the first code, another file
    same = identity(load_model("python:net2:Net"))
    assert identities[0] != identities[1] and same == identities[0]


def test_a_module_names_its_version_and_new_weights_change_its_identity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_SEED", "1")
    first = load_model("python:tests.models:redeployed")
    assert first.version == "1" and identity(first) == identity(
        load_model("python:tests.models:redeployed"))  # the same weights, the same answers
    monkeypatch.setenv("TEST_SEED", "2")
    assert identity(load_model("python:tests.models:redeployed")) != identity(first)
    known = identity(first)
    monkeypatch.setattr(first, "weights_digest", lambda: pytest.fail("weights hashed again"))
    assert identity(first) == known  # the cache and the overflow channel share one hash
    monkeypatch.setenv("TEST_VERSION", "2024-06.b")
    named = load_model("python:tests.models:redeployed")
    assert named.version == "2024-06.b" and identity(named).startswith("2024-06.b:")
    monkeypatch.setenv("TEST_VERSION", "v1/2")  # a version is one segment of a /v2 path
    with pytest.raises(ModelLoadError, match="vega_version 'v1/2' is not 1-64 letters"):
        load_model("python:tests.models:redeployed")


def test_a_module_that_fails_only_batched_is_told_what_batch_it_was_given() -> None:
    adapter = load_model("python:tests.models:scale_not_lengths")
    with pytest.raises(RuntimeError, match=r"failed on an example batch: x \[2, \d+, 8\] "
                                           r"float32, lengths \[2\] int64 \(\d+, \d+\)"):
        adapter.load("cpu")


def test_a_module_names_the_fewest_steps_it_takes_and_shorter_windows_are_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="vega.models"):
        model = load_model("python:tests.models:patches")
        model.load("cpu")
    assert isinstance(model, SequenceModel) and (model.min_length, model.max_length) == (8, 256)
    assert not [r for r in caplog.records if "fails alone" in r.getMessage()]
    for short in (np.ones((7, 8)).tolist(), np.ones((7, 8), np.float32)):
        with pytest.raises(VegaError) as refused:
            model.decode(short)
        assert refused.value.code == "invalid_input" and "8..256" in refused.value.message
    windows = [model.decode(model.example(n).tolist())[0] for n in (8, 20)]
    assert [len(w) for w in windows] == [8, 20]
    alone = [model.run([w], len(w))[0] for w in windows]
    np.testing.assert_allclose(model.run(windows, 20), alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attrs, said", [
    ("vega_min_length = 300\n    vega_max_length = 256",
     "vega_min_length 300 is not within 1..vega_"),
    ("vega_min_length = 0", "vega_min_length must be 1 or more, not 0"),
    ("vega_channels = 0", "vega_channels must be 1 or more, not 0"),
    ("vega_channels = -3", "vega_channels must be 1 or more, not -3"),
    ("vega_channels = 'three'", "vega_channels must be an int, 1 or more (not a float, even a "
     "whole one, nor a bool), not 'three'"),
    ("vega_max_length = 99.7", "vega_max_length must be an int, 1 or more (not a float, even "
     "a whole one, nor a bool), not 99.7"),
    ("vega_max_length = 64.0", "vega_max_length must be an int, 1 or more (not a float, even "
     "a whole one, nor a bool), not 64.0: write 64"),
    ("vega_channels = True", "vega_channels must be an int, 1 or more (not a float, even a "
     "whole one, nor a bool), not True"),
], ids=["min_over_max", "min_0", "channels_0", "channels_negative", "channels_text",
        "max_float", "max_whole_float", "channels_bool"])
def test_a_module_s_bad_sizes_are_refused_at_load_in_one_line(
        attrs: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "vega_sizes.py").write_text(
        "import torch\n\n"
        "class Mean(torch.nn.Module):\n"
        f"    {attrs}\n\n"
        "    def forward(self, x, lengths):\n"
        "        return x.mean(dim=1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vega_sizes", raising=False)
    with pytest.raises(ModelLoadError, match=re.escape(said)):
        load_model("python:vega_sizes:Mean")


@pytest.mark.parametrize("kind", ["lazy", "quantized"])
async def test_a_lazy_or_quantized_module_is_served_as_it_answers_alone(kind: str) -> None:
    # The serving process hashes a module as built (its identity) before its model process
    # runs it: a lazy layer's parameters hold no values yet, a quantized layer's state
    # holds a dtype and packed, quantized weights. That hash stopped the start.
    reference = load_model(f"python:tests.models:{kind}")
    reference.load("cpu")
    windows = [np.random.default_rng(n).standard_normal((n, 8)).astype(np.float32)
               for n in (16, 100)]
    async with in_process({"VEGA_MODEL": f"python:tests.models:{kind}"}) as (client, runtime):
        assert runtime.executor.kind == "process"
        for sample in windows:
            answer = await client.post("/v1/infer", json={"inputs": sample.tolist()})
            assert answer.status_code == 200, answer.text
            # One window at a time: a dynamically quantized layer scales by its whole batch.
            alone = reference.run([sample], sample.shape[0])[0]
            np.testing.assert_allclose(answer.json()["outputs"], alone, atol=1e-5)


def test_a_quantized_modules_identity_follows_its_weights(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first, again = (identity(load_model("python:tests.models:quantized")) for _ in range(2))
    monkeypatch.setenv("TEST_SEED", "1")
    assert first == again != identity(load_model("python:tests.models:quantized"))


def test_extra_state_hashes_the_same_whatever_order_or_address_it_holds() -> None:
    # Equal sets iterate in insertion order where their hashes collide, and string hashes
    # are salted per process: the serving and the model process saw different reprs of
    # one module's extra state, and its start was refused as "changed on disk".
    class Tag:
        pass

    def hashed(value: object) -> bytes:
        return b"".join(state_bytes("m._extra_state", value))

    assert hashed({"tags": {8, 0}}) == hashed({"tags": {0, 8}})
    assert hashed({"b": 1, "a": torch.ones(2)}) == hashed({"a": torch.ones(2), "b": 1})
    assert hashed({"a": torch.ones(2)}) != hashed({"a": torch.zeros(2)})
    assert hashed(Tag()) == hashed(Tag())  # its default repr names its address
