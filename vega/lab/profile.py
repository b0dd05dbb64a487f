"""``vega profile``: measure the model's batch latency per length bucket and batch size.

The model is loaded with the same adapter, device and torch threads a server
would use (``VEGA_*`` settings, ``--env-file``, flags), and each (bucket, size)
shape is run through ``Executor.run_sync`` with the executor driven from an event loop,
as a server's warm-up runs them (a model process's batch is timed by its own clock): one
untimed pass, then ``--repeats`` timed ones, each pass over every shape in turn. The file
written is what ``vega simulate`` replays::

    {"model": "sensor", "spec": "sensor", "device": "cpu", "torch_threads": 1,
     "buckets": [16, ..., 512], "sizes": [1, 2, 4, ...], "repeats": 5,
     "seconds": {"16": {"1": {"p50": 0.0011, "p90": 0.0013}, ...}, ...}}

Bucket keys are the bucket's upper length bound: every item of a batch is padded
to it, the worst case of that bucket, which is what the batcher predicts for too.
``LatencyModel`` reads such a file back: the simulator's stand-in for the executor.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vega.buckets import length_bounds
from vega.config import ConfigError, Settings, load_settings
from vega.modelproc.handle import ModelProcessError
from vega.models.loader import ModelLoadError
from vega.outpath import unwritable
from vega.warmup import in_turn, warm_up_failed

EXIT_CONFIG = 2
EXIT_LOAD = 3  # as `vega serve` exits when its model cannot be loaded


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", help="systemd EnvironmentFile with VEGA_* settings")
    parser.add_argument("--model", help="model spec (default VEGA_MODEL)")
    parser.add_argument("--model-name", help="the name a python: builder taking `name` is "
                        "given, as `vega serve` gives it (default VEGA_MODEL_NAME from the "
                        "environment or --env-file, else the attribute's name)")
    parser.add_argument("--device", help="cpu, cuda, cuda:N or auto (default VEGA_DEVICE)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch intra-op threads (default VEGA_TORCH_THREADS)")
    parser.add_argument("--buckets", help="comma-separated length bounds "
                        "(default VEGA_LENGTH_BUCKETS, capped at the model's longest input)")
    parser.add_argument("--sizes", help="comma-separated batch sizes "
                        "(default powers of two up to VEGA_MAX_BATCH_SIZE, and it)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per shape")
    parser.add_argument("--out", default="profile.json", help="file to write (JSON)")


def run(args: argparse.Namespace) -> int:
    try:
        named = {} if args.model_name is None else {"VEGA_MODEL_NAME": args.model_name}
        if args.device is not None:  # checked as `vega serve --device` is
            named["VEGA_DEVICE"] = args.device
        settings = load_settings(env_file=args.env_file, overrides=named)
        buckets = _ints(args.buckets) if args.buckets else None
        sizes = _ints(args.sizes) if args.sizes else default_sizes(settings.max_batch_size)
    except (ConfigError, ValueError) as error:
        print(f"vega profile: {error}", file=sys.stderr)
        return EXIT_CONFIG
    problem = unwritable(Path(args.out))
    if args.torch_threads is not None and args.torch_threads < 0:
        problem = f"--torch-threads={args.torch_threads}: expected >= 0"
    if args.repeats < 1:
        problem = f"--repeats={args.repeats}: expected >= 1"
    if problem is not None:
        print(f"vega profile: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        profile = measure(settings, model=args.model, device=args.device,
                          torch_threads=args.torch_threads, buckets=buckets, sizes=sizes,
                          repeats=args.repeats, progress=sys.stderr)
    except (ModelLoadError, ModelProcessError) as error:
        print(f"vega profile: {error}", file=sys.stderr)
        return EXIT_LOAD
    Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {args.out}: {len(profile['buckets'])} buckets x {len(sizes)} sizes",
          file=sys.stderr)
    return 0


def default_sizes(max_batch_size: int) -> list[int]:
    sizes = {1, max_batch_size}
    size = 2
    while size < max_batch_size:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def measure(settings: Settings, *, model: str | None = None, device: str | None = None,
            torch_threads: int | None = None, buckets: list[int] | None = None,
            sizes: list[int], repeats: int = 5, progress: Any = None) -> dict[str, Any]:
    """Load the model and time every (bucket, size); return the profile document."""
    from vega.executor import Executor, driven, pick_device, process_plan
    from vega.models import load_model, min_length

    spec = model or settings.model
    name = settings.model_name  # a builder keyed by name builds the model it serves
    adapter = load_model(spec, name)
    threads = settings.torch_threads if torch_threads is None else torch_threads
    chosen = pick_device(device or settings.device)
    if threads:
        import torch

        torch.set_num_threads(threads)
    # The model runs where a server would run it (VEGA_EXECUTOR): the times include
    # what handing a batch to a model process costs. Its slot holds the largest size asked
    # for, which may pass VEGA_MAX_BATCH_SIZE (to tell what raising it would buy).
    served = settings.replace(torch_threads=threads,
                              max_batch_size=max(settings.max_batch_size, *sizes))
    plan = process_plan(served, [adapter], ((spec, name),))
    executor = Executor({adapter.name: adapter}, threads=1, torch_threads=threads, plan=plan)

    def timed(bound: int, size: int, samples: list[Any]) -> float:
        try:
            return executor.run_sync(adapter.name, samples, bound)[1]
        except ModelProcessError:
            raise
        except Exception as error:  # the model raised: one line naming the shape, as warm-up
            raise warm_up_failed(adapter, bound, size, error) from error

    with driven(executor):  # stopped however this block ends, a failed load included
        try:
            executor.load(chosen)
        except (ModelLoadError, ModelProcessError):
            raise
        except Exception as error:  # the model's load check raised: as `vega serve` says it
            raise ModelLoadError(str(error) or repr(error)) from error
        bounds = list(length_bounds(tuple(buckets or settings.length_buckets),
                                    adapter.max_length, min_length(adapter)))
        shapes = [(bound, size, [adapter.example(bound)] * size) for bound in bounds
                  for size in sizes]
        times: dict[tuple[int, int], list[float]] = {(b, n): [] for b, n, _ in shapes}
        for bound, size, samples in shapes:
            timed(bound, size, samples)  # untimed: allocations
        for bound, size, samples in in_turn(shapes, repeats):  # as warm-up times them
            times[bound, size].append(timed(bound, size, samples))
    seconds = {str(bound): {str(size): {"p50": statistics.median(times[bound, size]),
                                        "p90": _p90(times[bound, size])} for size in sizes}
               for bound in bounds}
    if progress is not None:
        for bound in bounds:
            last = seconds[str(bound)][str(sizes[-1])]["p50"]
            print(f"bucket {bound}: size {sizes[-1]} p50 {1000 * last:.2f} ms", file=progress)
    return {"model": adapter.name, "spec": spec, "device": chosen, "torch_threads": threads,
            "executor": executor.kind,
            "host": platform.node(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "min_length": min_length(adapter), "buckets": bounds, "sizes": sizes,
            "repeats": repeats, "seconds": seconds}


def _p90(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _ints(raw: str) -> list[int]:
    values = [int(part) for part in raw.split(",") if part.strip()]
    if not values or any(v < 1 for v in values) or values != sorted(set(values)):
        raise ValueError(f"{raw!r}: expected increasing positive integers, comma separated")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vega profile", description=__doc__.split("\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


@dataclass(frozen=True)
class LatencyModel:
    """Batch seconds by (padded length, size), bilinear in both, from a ``vega profile`` file.

    Lengths below the shortest profiled one cost as much as it; above the longest,
    as much as the longest. Sizes past the largest profiled one extrapolate
    linearly from the last two. With ``noise`` each draw is log-normal with the
    profiled p50 as median and p90 as 90th percentile.
    """

    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    p50: tuple[tuple[float, ...], ...]  # [length index][size index]
    p90: tuple[tuple[float, ...], ...]
    model: str = ""
    min_length: int = 1  # the fewest steps the model takes (profiles before it: 1)

    @classmethod
    def from_profile(cls, doc: dict[str, Any]) -> LatencyModel:
        lengths = tuple(int(b) for b in doc["buckets"])
        sizes = tuple(int(s) for s in doc["sizes"])
        seconds = doc["seconds"]
        p50 = tuple(tuple(float(seconds[str(b)][str(s)]["p50"]) for s in sizes) for b in lengths)
        p90 = tuple(tuple(float(seconds[str(b)][str(s)].get("p90", seconds[str(b)][str(s)]["p50"]))
                          for s in sizes) for b in lengths)
        return cls(lengths, sizes, p50, p90, str(doc.get("model", "")),
                   int(doc.get("min_length", 1)))

    @classmethod
    def from_file(cls, path: str | Path) -> LatencyModel:
        try:
            doc = json.loads(Path(path).read_text())
            model = cls.from_profile(doc)
            if not model.lengths or not model.sizes:
                raise ValueError("no buckets or no sizes")
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as error:
            raise ValueError(f"{path}: not a profile written by `vega profile` "
                             f"({type(error).__name__}: {error})") from None
        return model

    @property
    def max_length(self) -> int:
        return self.lengths[-1]

    def seconds(self, length: int, size: int, table: str = "p50") -> float:
        grid = self.p50 if table == "p50" else self.p90
        i, wi = _weights(self.lengths, float(length), clamp_high=True)
        j, wj = _weights(self.sizes, float(size), clamp_high=False)
        low = grid[i][j] + wj * (grid[i][j + 1] - grid[i][j]) if wj else grid[i][j]
        if not wi:
            return max(0.0, low)
        high = grid[i + 1][j] + wj * (grid[i + 1][j + 1] - grid[i + 1][j]) if wj else grid[i + 1][j]
        return max(0.0, low + wi * (high - low))

    def sigma(self, length: int, size: int) -> float:
        """Log-normal shape putting p90 where the profile measured it."""
        p50, p90 = self.seconds(length, size), self.seconds(length, size, "p90")
        return math.log(p90 / p50) / 1.2815515655446004 if p90 > p50 > 0 else 0.0


def _weights(points: tuple[int, ...], x: float, clamp_high: bool) -> tuple[int, float]:
    """(index, weight) such that value = v[index] + weight * (v[index+1] - v[index])."""
    if len(points) == 1 or x <= points[0]:
        return 0, 0.0
    if x >= points[-1] and clamp_high:
        return len(points) - 1, 0.0
    i = min(bisect.bisect_right(points, x) - 1, len(points) - 2)
    return i, (x - points[i]) / (points[i + 1] - points[i])


if __name__ == "__main__":
    raise SystemExit(main())
