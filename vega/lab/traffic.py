"""Traffic for the load generator: arrival times, priority mix, length distribution.

A profile is a list of phases, each with a rate that goes linearly from ``start``
to ``end`` requests/s over ``duration_s``. Arrival times come from inverting the
integrated rate Λ(t): the k-th arrival is at Λ⁻¹(u_k), where u_k = k + ½ for a
constant process (evenly spaced at the local rate) and a running sum of Exp(1)
draws for a Poisson process (a non-homogeneous Poisson process, by time
rescaling). So a phase at rate r for d seconds gets r·d arrivals (constant) or
about that many (Poisson).

Profiles (``profile_from``):

    steady  rate for duration_s
    step    steps "RATE:SECONDS,RATE:SECONDS,..."
    ramp    rate → ramp_to over duration_s
    burst   rate for burst_at_s, rate×burst_factor for burst_s, rate until duration_s
    trace   a file of timestamps (see ``read_trace``), replayed at trace_speed×

A mix is "sheddable=70,normal=25,critical=5" (weights, any scale); lengths are
"16", "16=50,64=30,256=20" (weighted choice) or "uniform:8:64".

``OPTIONS`` is the load generator's option table (flags, spec files, defaults);
``resolve`` merges defaults < spec file < flags, ``load_spec`` reads a spec file
(a JSON object or ``key=value`` lines, keys as the flags without ``--``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from vega.records import PRIORITY_NAMES

PRIORITIES = PRIORITY_NAMES  # the request classes, highest first
MAX_DISTINCT_LENGTHS = 1024

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class TrafficError(ValueError):
    """A profile, mix, length or trace that cannot be used; the message says why."""


@dataclass(frozen=True)
class Phase:
    duration_s: float
    start: float  # requests/s at the start of the phase
    end: float  # requests/s at its end (linear in between)

    @property
    def expected(self) -> float:
        """Λ over the phase: the expected number of arrivals."""
        return (self.start + self.end) / 2.0 * self.duration_s


@dataclass(frozen=True)
class Arrivals:
    """What to send and when: times in seconds from the run's start, and per arrival
    the index of its priority in PRIORITIES and its length."""

    t_s: FloatArray
    priority: IntArray
    length: IntArray

    def __len__(self) -> int:
        return len(self.t_s)


def steady(rate: float, duration_s: float) -> list[Phase]:
    return [Phase(duration_s, rate, rate)]


def ramp(start: float, end: float, duration_s: float) -> list[Phase]:
    return [Phase(duration_s, start, end)]


def step(steps: Sequence[tuple[float, float]]) -> list[Phase]:
    """``steps`` are (rate, seconds) pairs."""
    return [Phase(seconds, rate, rate) for rate, seconds in steps]


def burst(rate: float, factor: float, at_s: float, burst_s: float, duration_s: float
          ) -> list[Phase]:
    """Baseline ``rate``, then ``factor``× from ``at_s`` for ``burst_s``, then baseline
    until ``duration_s``."""
    after = duration_s - at_s - burst_s
    if at_s < 0 or burst_s <= 0 or after < 0:
        raise TrafficError(f"burst of {burst_s}s at {at_s}s does not fit in {duration_s}s")
    phases = [Phase(at_s, rate, rate), Phase(burst_s, rate * factor, rate * factor),
              Phase(after, rate, rate)]
    return [p for p in phases if p.duration_s > 0]


def parse_steps(text: str) -> list[tuple[float, float]]:
    """"100:5,800:10,100:5" → [(100, 5), (800, 10), (100, 5)] (rate:seconds)."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        rate, _, seconds = part.partition(":")
        try:
            steps.append((float(rate), float(seconds)))
        except ValueError:
            raise TrafficError(f"step {part!r} is not RATE:SECONDS") from None
    if not steps:
        raise TrafficError("steps is empty: expected RATE:SECONDS,...")
    return steps


def check_phases(phases: Sequence[Phase]) -> None:
    for p in phases:
        if not (math.isfinite(p.duration_s) and p.duration_s > 0):
            raise TrafficError(f"phase duration {p.duration_s} is not a positive number")
        if not (p.start >= 0 and p.end >= 0 and math.isfinite(p.start + p.end)):
            raise TrafficError(f"phase rate {p.start}..{p.end} is not a number >= 0")
    if not phases or sum(p.expected for p in phases) <= 0:
        raise TrafficError("the profile offers no requests")


def arrival_times(phases: Sequence[Phase], process: str = "poisson",
                  rng: np.random.Generator | None = None, limit: int | None = None
                  ) -> FloatArray:
    """Arrival times (s from 0) for ``phases``; ``process`` is "poisson" or "constant".

    ``limit`` caps the number of arrivals (the earliest are kept).
    """
    check_phases(phases)
    rng = rng or np.random.default_rng()
    total = sum(p.expected for p in phases)
    if process == "constant":
        u = np.arange(math.floor(total - 0.5) + 1, dtype=np.float64) + 0.5
    elif process == "poisson":
        n = int(total + 6 * math.sqrt(total) + 16)  # enough draws with overwhelming odds
        u = np.cumsum(rng.exponential(1.0, n))
        while u[-1] < total:
            u = np.concatenate([u, u[-1] + np.cumsum(rng.exponential(1.0, n))])
        u = u[u < total]
    else:
        raise TrafficError(f"process {process!r} is not poisson or constant")
    if limit is not None:
        u = u[:limit]
    return _invert(phases, u)


def _invert(phases: Sequence[Phase], u: FloatArray) -> FloatArray:
    """t with Λ(t) = u, for each u (sorted), through the piecewise-linear rate."""
    ends = np.cumsum([p.expected for p in phases])
    starts_t = np.concatenate([[0.0], np.cumsum([p.duration_s for p in phases])[:-1]])
    which = np.minimum(np.searchsorted(ends, u, side="right"), len(phases) - 1)
    before = np.concatenate([[0.0], ends[:-1]])[which]
    a = np.array([p.start for p in phases])[which]
    slope = np.array([(p.end - p.start) / p.duration_s for p in phases])[which]
    rest = u - before
    # Solve slope/2·τ² + a·τ = rest; the stable root form also covers slope = 0.
    tau = 2.0 * rest / (a + np.sqrt(np.maximum(a * a + 2.0 * slope * rest, 0.0)))
    out: FloatArray = starts_t[which] + np.nan_to_num(tau, nan=0.0, posinf=0.0)
    return out


def parse_weights(text: str, what: str) -> dict[str, float]:
    """"a=70,b=30" → {"a": 70.0, "b": 30.0}; a lone "a" means {"a": 1.0}."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise TrafficError(f"{what} {part!r}: weight is not a number") from None
        if weight < 0 or not math.isfinite(weight):
            raise TrafficError(f"{what} {part!r}: weight must be >= 0")
        weights[key.strip()] = weights.get(key.strip(), 0.0) + weight
    if not weights or sum(weights.values()) <= 0:
        raise TrafficError(f"{what} {text!r} has no positive weight")
    return weights


def parse_mix(text: str) -> dict[str, float]:
    """Priority mix → probabilities by class name."""
    weights = parse_weights(text, "mix")
    unknown = set(weights) - set(PRIORITIES)
    if unknown:
        raise TrafficError(f"mix class(es) {sorted(unknown)} not in {PRIORITIES}")
    total = sum(weights.values())
    return {name: weights.get(name, 0.0) / total for name in PRIORITIES}


def parse_lengths(text: str) -> dict[int, float]:
    """Length distribution → probabilities by length."""
    text = text.strip()
    if text.startswith("uniform:"):
        try:
            low, high = (int(x) for x in text[len("uniform:"):].split(":"))
        except ValueError:
            raise TrafficError(f"lengths {text!r} is not uniform:LOW:HIGH") from None
        if not 1 <= low <= high or high - low >= MAX_DISTINCT_LENGTHS:
            raise TrafficError(f"lengths {text!r}: need 1 <= LOW <= HIGH, "
                               f"at most {MAX_DISTINCT_LENGTHS} lengths")
        return {n: 1.0 / (high - low + 1) for n in range(low, high + 1)}
    weights = parse_weights(text, "lengths")
    try:
        lengths = {int(k): w for k, w in weights.items()}
    except ValueError:
        raise TrafficError(f"lengths {text!r}: lengths must be integers") from None
    if min(lengths) < 1 or len(lengths) > MAX_DISTINCT_LENGTHS:
        raise TrafficError(f"lengths {text!r}: lengths must be >= 1")
    total = sum(lengths.values())
    return {n: w / total for n, w in lengths.items()}


def draw(n: int, mix: Mapping[str, float], lengths: Mapping[int, float],
         rng: np.random.Generator) -> tuple[IntArray, IntArray]:
    """``n`` (priority index, length) draws."""
    probs = np.array([mix.get(name, 0.0) for name in PRIORITIES])
    priority = rng.choice(len(PRIORITIES), size=n, p=probs / probs.sum()).astype(np.int64)
    values = np.array(list(lengths), dtype=np.int64)
    weights = np.array(list(lengths.values()))
    length = values[rng.choice(len(values), size=n, p=weights / weights.sum())]
    return priority, length


def read_trace(path: str | Path) -> tuple[FloatArray, list[str | None], list[int | None]]:
    """A trace file: one arrival a line, ``T [PRIORITY] [LENGTH]`` separated by spaces or
    commas; T in seconds (any origin: the first is taken as 0); ``#`` starts a comment.
    Lines need not be sorted."""
    times: list[float] = []
    priorities: list[str | None] = []
    lengths: list[int | None] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].replace(",", " ").split()
        if not fields:
            continue
        try:
            times.append(float(fields[0]))
            priority = fields[1] if len(fields) > 1 and fields[1] != "-" else None
            length = int(fields[2]) if len(fields) > 2 else None
        except ValueError:
            raise TrafficError(f"{path}:{number}: expected T [PRIORITY] [LENGTH]") from None
        if priority is not None and priority not in PRIORITIES:
            raise TrafficError(f"{path}:{number}: priority {priority!r} not in {PRIORITIES}")
        priorities.append(priority)
        lengths.append(length)
    if not times:
        raise TrafficError(f"{path}: no arrivals")
    order = np.argsort(np.array(times), kind="stable")
    t = np.array(times)[order]
    return (t - t[0], [priorities[i] for i in order], [lengths[i] for i in order])


def trace_arrivals(path: str | Path, speed: float, mix: Mapping[str, float],
                   lengths: Mapping[int, float], rng: np.random.Generator,
                   limit: int | None = None) -> Arrivals:
    """A replayed trace; classes and lengths missing from a line are drawn from the mix."""
    if not speed > 0:
        raise TrafficError("trace_speed must be > 0")
    t, named, sized = read_trace(path)
    if limit is not None:
        t, named, sized = t[:limit], named[:limit], sized[:limit]
    priority, length = draw(len(t), mix, lengths, rng)
    for i, name in enumerate(named):
        if name is not None:
            priority[i] = PRIORITIES.index(name)
        size = sized[i]
        if size is not None:
            length[i] = size
    return Arrivals(t / speed, priority, length)


def profile_from(options: Mapping[str, Any]) -> list[Phase]:
    """Phases from the load generator's options (profile, rate, duration_s, ...)."""
    kind = options["profile"]
    rate, duration = float(options["rate"]), float(options["duration_s"])
    if kind == "steady":
        return steady(rate, duration)
    if kind == "ramp":
        return ramp(rate, float(options["ramp_to"]), duration)
    if kind == "step":
        return step(parse_steps(str(options["steps"] or "")))
    if kind == "burst":
        return burst(rate, float(options["burst_factor"]), float(options["burst_at_s"]),
                     float(options["burst_s"]), duration)
    raise TrafficError(f"profile {kind!r} is not steady, step, ramp, burst or trace")


def plan(options: Mapping[str, Any], rng: np.random.Generator) -> Arrivals:
    """Every arrival of an open-loop run, from the load generator's options."""
    mix = parse_mix(str(options["mix"]))
    lengths = parse_lengths(str(options["lengths"]))
    limit = options.get("requests")
    if options["profile"] == "trace":
        if not options.get("trace"):
            raise TrafficError("profile trace needs a trace file")
        return trace_arrivals(options["trace"], float(options["trace_speed"]), mix, lengths,
                              rng, limit)
    t = arrival_times(profile_from(options), str(options["process"]), rng, limit)
    priority, length = draw(len(t), mix, lengths, rng)
    return Arrivals(t, priority, length)


def can_wait(n: int, share: float, seed: int | None) -> npt.NDArray[np.bool_]:
    """Which of ``n`` arrivals can wait; drawn apart from the arrivals themselves, so a
    share changes nothing else about a seeded run."""
    if share <= 0:
        return np.zeros(n, dtype=np.bool_)
    rng = np.random.default_rng(None if seed is None else [seed, 22])
    return rng.random(n) < share


# --- load generator options: one table for flags, spec files and defaults ---------

def parse_bool(text: str) -> bool:
    if str(text).strip().lower() in ("1", "true", "yes", "on"):
        return True
    if str(text).strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not true or false")


@dataclass(frozen=True)
class Opt:
    name: str
    default: Any
    type: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None


OPTIONS = (
    Opt("url", "http://127.0.0.1:8000", str, "server base URL; a path in it replaces --path"),
    Opt("spec", None, str, "spec file (JSON object or key=value lines) with any of these "
        "options; flags given on the command line win"),
    Opt("mode", "open", str, "open loop (arrivals at a rate) or closed loop (N connections)",
        ("open", "closed")),
    Opt("profile", "steady", str, "open-loop traffic shape",
        ("steady", "step", "ramp", "burst", "trace")),
    Opt("process", "poisson", str, "arrival process within the profile",
        ("poisson", "constant")),
    Opt("rate", 1000.0, float, "requests/s (steady, ramp start, burst baseline)"),
    Opt("duration_s", 10.0, float, "seconds of load (open: profile length; closed: run time)"),
    Opt("requests", None, int, "stop after this many requests (both modes)"),
    Opt("ramp_to", 5000.0, float, "ramp: requests/s at the end"),
    Opt("steps", None, str, "step: RATE:SECONDS,RATE:SECONDS,... (overrides duration)"),
    Opt("burst_factor", 10.0, float, "burst: rate multiplier during the burst"),
    Opt("burst_at_s", 2.0, float, "burst: start of the burst"),
    Opt("burst_s", 3.0, float, "burst: length of the burst"),
    Opt("trace", None, str, "trace: file of 'T [PRIORITY] [LENGTH]' lines"),
    Opt("trace_speed", 1.0, float, "trace: replay speed factor"),
    Opt("mix", "sheddable=70,normal=25,critical=5", str, "priority mix, class=weight,..."),
    Opt("lengths", "16", str, "sequence lengths: N, N=w,M=w,... or uniform:LO:HI"),
    Opt("deadline_ms", "1000", str, "deadline sent with each request: MS or class=MS,..."),
    Opt("can_wait", 0.0, float, "share of requests (0..1) that can wait: sent with Prefer: "
        "respond-async, a 202 is followed by polling its job until it ends"),
    Opt("job_ttl_s", 600.0, float, "how long a job's caller waits for it: an accepted job "
        "not ended by then (and drain_s more) counts as lost"),
    Opt("connections", 16, int, "closed: connections; open: connections opened at start"),
    Opt("max_connections", 256, int, "open: most connections; past it requests queue "
        "client-side (reported as backlog)"),
    Opt("timeout_s", 10.0, float, "client timeout of one request after it is sent"),
    Opt("honor_retry_after", False, parse_bool, "closed: after a 429/503 a connection waits the "
        "answer's Retry-After header before its next request, as HTTP asks"),
    Opt("drain_s", 5.0, float, "after the last send, wait at most this long for answers"),
    Opt("poll_s", 0.25, float, "poll GET /v1/status this often for queue depth; 0 = off"),
    Opt("metrics", True, parse_bool, "read /metrics before and after for batch histograms"),
    Opt("path", "/v1/infer", str, "request path"),
    Opt("uds", None, str, "connect through this unix socket instead of TCP"),
    Opt("token", os.environ.get("VEGA_BENCH_TOKEN"), str, "bearer token for a server with "
        "VEGA_AUTH_TOKENS (default: the VEGA_BENCH_TOKEN environment variable, which keeps "
        "it out of the process list)"),
    Opt("seed", None, int, "random seed (arrivals, mix, lengths, input values)"),
    Opt("out", None, str, "output directory (default out/bench-YYYYmmdd-HHMMSS)"),
    Opt("plots", True, parse_bool, "write PNG plots"),
    Opt("progress", None, parse_bool, "progress bar on stderr (default: when stderr is a TTY)"),
)
BY_NAME = {o.name: o for o in OPTIONS}

def load_spec(path: str) -> dict[str, Any]:
    """A spec file: a JSON object, or ``key=value`` lines with ``#`` comments."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TrafficError(f"{path}: expected a JSON object")
        items = [(str(k), v) for k, v in raw.items()]
    else:
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise TrafficError(f"{path}:{number}: expected key=value")
            items.append((key.strip(), value.strip()))
    spec = {}
    for key, value in items:
        name = key.replace("-", "_")
        o = BY_NAME.get(name)
        if o is None or name == "spec":
            raise TrafficError(f"{path}: unknown option {key!r}")
        try:
            spec[name] = value if value is None else o.type(str(value))
        except ValueError as exc:
            raise TrafficError(f"{path}: {key}={value!r}: {exc}") from None
        if o.choices and spec[name] not in o.choices:
            raise TrafficError(f"{path}: {key}={value!r} is not one of {', '.join(o.choices)}")
    return spec


def resolve(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Every option: defaults < spec file (``flags["spec"]``) < ``flags`` that are not None."""
    options = {o.name: o.default for o in OPTIONS}
    if flags.get("spec"):
        options.update(load_spec(flags["spec"]))
    options.update({o.name: flags[o.name] for o in OPTIONS if flags.get(o.name) is not None})
    if options["profile"] == "step" and options["steps"]:
        options["duration_s"] = sum(s for _, s in parse_steps(options["steps"]))
    for name in ("rate", "duration_s", "connections", "max_connections", "timeout_s",
                 "job_ttl_s"):
        if not (isinstance(options[name], (int, float)) and options[name] > 0):
            raise TrafficError(f"{name} must be > 0, not {options[name]}")
    for name, least in (("requests", 1), ("seed", 0), ("poll_s", 0)):  # None: not given
        value = options[name]
        if value is not None and not (isinstance(value, (int, float)) and value >= least):
            raise TrafficError(f"{name} must be >= {least}, not {value}")
    if not str(options["path"]).startswith("/"):
        raise TrafficError(f"path {options['path']!r} must start with /")
    parse_deadlines(str(options["deadline_ms"]))  # refused here, not when the load starts
    parse_mix(str(options["mix"]))
    parse_lengths(str(options["lengths"]))
    if not 0.0 <= options["can_wait"] <= 1.0:
        raise TrafficError(f"can_wait must be between 0 and 1, not {options['can_wait']}")
    options["max_connections"] = max(options["max_connections"], options["connections"])
    return options


def parse_deadlines(text: str) -> dict[str, float]:
    """"500" or "critical=2000,normal=500,sheddable=100" → seconds by class."""
    if "=" not in text:
        try:
            given = dict.fromkeys(PRIORITIES, float(text))
        except ValueError:
            raise TrafficError(f"deadline_ms {text!r}: give a number or all of "
                               f"{PRIORITIES}") from None
    else:
        given = parse_weights(text, "deadline_ms")
    unknown = set(given) - set(PRIORITIES)
    if unknown or len(given) != len(PRIORITIES):
        raise TrafficError(f"deadline_ms {text!r}: give a number or all of {PRIORITIES}")
    if not all(0 < ms < math.inf for ms in given.values()):
        raise TrafficError(f"deadline_ms {text!r}: each deadline must be a number > 0")
    return {p: given[p] / 1000 for p in PRIORITIES}
