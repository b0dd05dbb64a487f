"""``vega export``: compile a model ahead of time into a package that ``aoti:PATH`` serves.

``torch.export`` traces the module's forward pass over windows of any batch size and any
length up to the model's longest, and AOTInductor compiles it for this host's device and
instruction set. A module whose code branches on the window length (padding it to whole
patches, say) cannot be traced for every length: then it is traced for lengths that are a
multiple of 2, 4, 8, ... (the first whose program answers as the module does at such
lengths), and the served batches are padded up to that multiple. The compiled package is
checked against the module the same way before it is kept: AOTInductor's code does not
check the shapes it is given. The serving host needs neither the module's Python code nor a
compiler.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from vega.config import ConfigError, load_settings
from vega.models.base import SequenceModel, min_length
from vega.models.compiled import FORMAT, PREFIX
from vega.models.loader import ModelLoadError, default_name, load_model
from vega.outpath import unwritable

EXIT_FAILED = 2
MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
# Batches are padded to at least two multiples: traced with one, a module's code may take a
# length-1 dimension for one that broadcasts, and torch.export then guards it out.
LEAST = 2


class ExportError(Exception):
    """The model cannot be compiled; the message says why."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model spec to compile (python:module:attr, or a built-in)")
    parser.add_argument("--model-name", "--name", dest="model_name",
                        help="the name a python: builder taking `name` is given, as `vega "
                             "serve` gives it (default VEGA_MODEL_NAME from the environment "
                             "or --env-file, else the attribute's name)")
    parser.add_argument("--env-file", help="systemd EnvironmentFile with VEGA_* settings "
                        "(read for VEGA_MODEL_NAME)")
    parser.add_argument("--out", required=True, help="package to write (a .pt2 file)")
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda: the device the package will run on (default cpu)")
    parser.add_argument("--length-multiple", type=int, choices=MULTIPLES,
                        help="trace for lengths that are a multiple of this only "
                             "(default: the smallest that traces)")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        problem = unwritable(Path(args.out))
        if problem is not None:
            raise ExportError(f"--out {args.out}: {problem}")
        adapter = load_model(args.model, served_name(args))
        multiple = export_package(adapter, Path(args.out), device=args.device,
                                  multiples=(args.length_multiple,) if args.length_multiple
                                  else MULTIPLES)
    except (ConfigError, ModelLoadError, ExportError) as error:
        print(f"vega export: {error}", file=sys.stderr)
        return EXIT_FAILED
    served = default_name(f"aoti:{args.out}")
    rename = "" if served == adapter.name else f" (VEGA_MODEL_NAME={adapter.name} keeps its name)"
    print(f"wrote {args.out}: model {adapter.name}, lengths "
          f"{min_length(adapter)}..{adapter.max_length} padded to a multiple of {multiple} "
          f"(at least {multiple * _least(min_length(adapter), multiple)}), "
          f"for {args.device}, in {time.monotonic() - started:.0f} s; serve it as "
          f"VEGA_MODEL=aoti:{args.out}, named {served}{rename}", file=sys.stderr)
    return 0


def served_name(args: argparse.Namespace) -> str:
    """VEGA_MODEL_NAME as `vega serve` reads and checks it (flag, environment, env file):
    a builder keyed by name then compiles the model that is served under that name."""
    flags = {} if args.model_name is None else {"VEGA_MODEL_NAME": args.model_name}
    return load_settings(env_file=args.env_file, overrides=flags).model_name


def export_package(adapter: Any, out: Path, *, device: str = "cpu",
                   multiples: tuple[int, ...] = MULTIPLES) -> int:
    """Compile ``adapter``'s module into the package ``out``; the length multiple it holds for."""
    import torch

    if not isinstance(adapter, SequenceModel) or \
            not isinstance(adapter.module, torch.nn.Module):
        raise ExportError(f"model {adapter.name!r}: only a torch module over windows "
                          "(a python: model or a built-in) can be compiled")
    if out.suffix != ".pt2":
        raise ExportError(f"--out {out}: the package's name must end in .pt2")
    try:
        target = torch.device(device)
        module = adapter.module.to(target).eval()
    except (RuntimeError, AssertionError) as error:  # torch asserts when CUDA is missing
        raise ExportError(f"--device {device}: {error}") from None
    program, multiple = _trace(module, adapter, device, multiples)
    least = multiple * _least(adapter.min_length, multiple)
    probe = torch.from_numpy(adapter.example(least)[None]).to(device)
    with torch.inference_mode():
        output = module(probe, torch.tensor([least], device=device))
    metadata = {"format": FORMAT, "channels": adapter.channels,
                "max_length": adapter.max_length, "output_size": output[0].numel(),
                "length_multiple": multiple, "least_length": least,
                "min_length": adapter.min_length}
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(out),
            inductor_configs={"aot_inductor.metadata": {
                PREFIX + key: str(value) for key, value in metadata.items()}})
        compiled = torch._inductor.aoti_load_package(str(out))
    except Exception as error:  # the compiler's many failure types
        raise ExportError(f"model {adapter.name!r}: AOTInductor failed: {error}") from None
    if not _agrees(compiled, module, adapter, multiple, device):
        out.unlink()
        raise ExportError(f"model {adapter.name!r}: the compiled package does not answer as "
                          "the module does; nothing was written")
    return multiple


def _trace(module: Any, adapter: SequenceModel, device: str,
           multiples: tuple[int, ...]) -> tuple[Any, int]:
    """The exported program for any batch size and the first length multiple that traces."""
    import torch
    from torch.export import Dim

    batch = Dim("batch", min=1)
    example_length = min(adapter.max_length, 64)
    failure = ""
    for multiple in multiples:
        # torch wants a range, not one value: a short model's top multiples reach past it.
        least = _least(adapter.min_length, multiple)
        steps = Dim("steps", min=least, max=max(least + 1, -(-adapter.max_length // multiple)))
        length = multiple * max(least, example_length // multiple)
        x = torch.from_numpy(adapter.example(length)[None].repeat(2, 0)).to(device)
        lengths = torch.tensor([length, max(adapter.min_length, length // 2)], device=device)
        try:
            with torch.inference_mode():
                program = torch.export.export(
                    module, (x, lengths),
                    dynamic_shapes=({0: batch, 1: steps if multiple == 1 else multiple * steps},
                                    {0: batch}))
        except Exception as error:  # export raises many types for code it cannot trace
            failure = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            continue
        if _agrees(program.module(), module, adapter, multiple, device):
            return program, multiple
        failure = "the traced program answers otherwise than the module"
    raise ExportError(f"model {adapter.name!r}: torch.export cannot trace it for lengths "
                      f"that are a multiple of {multiples[-1]}: {failure}")


def _least(shortest: int, multiple: int) -> int:
    """The fewest multiples a padded batch holds: two, and the model's shortest window."""
    return max(LEAST, -(-shortest // multiple))


def _agrees(candidate: Any, module: Any, adapter: SequenceModel, multiple: int,
            device: str) -> bool:
    """Whether ``candidate`` answers as ``module`` for batches padded to the least length,
    to odd multiples of ``multiple`` (which no larger power of two divides) and to the
    longest length."""
    import torch

    least = _least(adapter.min_length, multiple)
    longest = multiple * max(least, -(-adapter.max_length // multiple))
    pads = sorted({min(multiple * n, longest) for n in (least, 3, 5, 7, 9, 15) if n >= least}
                  | {longest})
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for pad in pads:
                x = torch.randn(3, pad, adapter.channels, generator=generator).to(device)
                shortest = adapter.min_length  # a window as short as is accepted
                lengths = torch.tensor([pad, max(shortest, pad // 2), shortest], device=device)
                expected = module(x, lengths)
                # To the output's own precision: float16 differs in its last place when
                # the compiler orders the sums otherwise.
                eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
                tolerance = max(1e-4, 16 * eps)
                if not torch.allclose(candidate(x, lengths), expected, rtol=tolerance,
                                      atol=tolerance / 10):
                    return False
    except Exception:  # a failed shape check, a wrong-shaped answer: it does not agree
        return False
    return True
