"""Settings: defaults < env file < ``VEGA_*`` environment < command-line flags.

Every setting is declared once, as a field of ``Settings``; ``SPECS`` (the table the
env file documentation ``conf/vega.env``, the CLI flags and the validation come from)
is read off those fields. The result is one frozen ``Settings`` object built at start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vega.channel.url import parse_redis_url
from vega.envfile import ConfigError as ConfigError  # re-exported: part of what config offers
from vega.envfile import mask_url
from vega.envfile import read_env_file as read_env_file
from vega.records import PRIORITY_NAMES

Parser = Callable[[str], Any]


@dataclass(frozen=True)
class Spec:
    name: str  # without the VEGA_ prefix, lower case: the Settings field
    default: str
    parse: Parser
    allowed: str  # what the error message says is allowed
    doc: str
    secret: bool = False

    @property
    def env(self) -> str:
        return "VEGA_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _int(lo: int, hi: int | None = None) -> Parser:
    def parse(raw: str) -> int:
        value = int(raw.strip())
        if value < lo or (hi is not None and value > hi):
            raise ValueError
        return value

    return parse


def _float(lo: float, hi: float | None = None) -> Parser:
    def parse(raw: str) -> float:
        value = float(raw.strip())
        if not math.isfinite(value) or value < lo or (hi is not None and value > hi):
            raise ValueError
        return value

    return parse


def _choice(*options: str) -> Parser:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in options:
            raise ValueError
        return value

    return parse


def _text(raw: str) -> str:
    return raw.strip()


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # one part of a host name
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")
_TARGET = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*:[^\W\d]\w*")  # python:package.module:attr


def _model(raw: str) -> str:
    """A model spec's form (whether it loads is found at start): a typo is a bad setting."""
    value = raw.strip()
    kind, _, rest = value.partition(":")
    if value in ("sensor", "sensor-small") or (kind in ("torchscript", "aoti") and rest) \
            or (kind == "python" and _TARGET.fullmatch(rest) is not None):
        return value
    raise ValueError


def _host(raw: str) -> str:
    """An IP address or a host name; never empty, which uvicorn would take as every
    interface."""
    value = raw.strip()
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if len(value) > 253 or not _HOSTNAME.fullmatch(value):
            raise
    return value


def _tokens(raw: str) -> str:
    """Bearer tokens, comma-separated: each trimmed, none empty or holding a space."""
    tokens = [token.strip() for token in raw.split(",")]
    if raw.strip() and (not all(tokens) or any(len(t.split()) > 1 for t in tokens)):
        raise ValueError
    return ",".join(tokens) if raw.strip() else ""


def _name(raw: str) -> str:
    """A model's name: one segment of /v1/models/{name}/infer, a label, a Redis key part
    (inside the braces of a Redis Cluster hash tag: no brace of its own)."""
    value = raw.strip()
    if len(value) > 128 or any(c in "/{}" or c.isspace() or not c.isprintable() for c in value):
        raise ValueError
    return value


def _bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError


def _device(raw: str) -> str:
    value = raw.strip().lower()
    if value in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise ValueError


def _buckets(raw: str) -> tuple[int, ...]:
    bounds = tuple(int(part) for part in raw.split(",") if part.strip())
    if not bounds or any(b < 1 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise ValueError
    return bounds


def _cpus(raw: str) -> tuple[int, ...]:
    """A Linux CPU list ("1", "2-3", "0,2"), each CPU one this machine has; empty = none."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in raw.split(","))):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo or hi >= (os.cpu_count() or 1):
            raise ValueError
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def _redis_url(raw: str) -> str:
    value = raw.strip()
    if value:
        parse_redis_url(value)  # ValueError when it names no Redis
    return value


def _node_id(raw: str) -> str:
    value = raw.strip()
    if value and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", value):
        raise ValueError
    return value


def _names(raw: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not names or ("*" in names and len(names) > 1):
        raise ValueError
    return names


def _classes(raw: str) -> tuple[str, ...]:
    names = tuple(part.strip().lower() for part in raw.split(",") if part.strip())
    if any(name not in PRIORITY_NAMES for name in names):
        raise ValueError
    return names


def setting(default: str, parse: Parser, allowed: str, doc: str, secret: bool = False) -> Any:
    """A ``Settings`` field: its default as written in an env file, how a value is read and
    checked, what the error says is allowed, and its documentation."""
    return dataclasses.field(default=parse(default), metadata={"vega": {
        "default": default, "parse": parse, "allowed": allowed, "doc": doc, "secret": secret}})


@dataclass(frozen=True)
class Settings:
    """Every setting, declared once: ``VEGA_<NAME>``, ``--<name>`` and conf/vega.env come
    from these fields."""

    host: str = setting("127.0.0.1", _host, "an IP address or a host name",
        "Address to listen on (0.0.0.0 or :: for every interface).")
    port: int = setting("8000", _int(0, 65535), "an integer 0-65535",
        "TCP port (0 = any free port).")
    uds: str = setting("", _text, "a path or empty",
        "Listen on this unix socket instead of host:port.")
    model: str = setting("sensor", _model,
        "sensor, sensor-small, torchscript:PATH, aoti:PATH or python:module:attr",
        "The model this process serves (the default for /v1/infer).")
    model_name: str = setting("", _name, "a name of at most 128 characters, no '/', braces "
        "or spaces, or empty",
        "Name the model is served under (default: derived from VEGA_MODEL).")
    device: str = setting("auto", _device, "cpu, cuda, cuda:N or auto",
        "Where the model runs; auto picks cuda when available.")
    torch_threads: int = setting("1", _int(0), "an integer >= 0",
        "torch intra-op threads per executor thread: 1 for a process a core (at torch's "
        "default every process takes every core); 0 = torch's default, for one process "
        "on many cores.")
    executor_threads: int = setting("1", _int(1, 64), "an integer 1-64",
        "Executor threads running batches (one per device is usual).")
    executor: str = setting("auto", _choice("auto", "thread", "process"),
        "auto, thread or process",
        "Where the model runs: a thread of this process, or a model process of its own "
        "(fed through shared memory, so an eager module's Python does not contend with "
        "the event loop for the GIL); auto = process for an eager torch module or a "
        "compiled package (aoti:), thread for TorchScript and other adapters.")
    model_cpus: tuple[int, ...] = setting("", _cpus, "a CPU list such as 1 or 2-3, or empty",
        "CPUs the model processes run on; the rest of this process keeps off them, so the "
        "event loop does not preempt the model. Empty = no pinning. Only with model processes.")
    model_timeout_s: float = setting("30", _float(0.01, 3600), "a number 0.01-3600",
        "A batch running longer in a model process is taken to hang: the process is "
        "killed and restarted, that batch answered 500 model_error. Warm-up passes too.")
    model_start_timeout_s: float = setting("300", _float(1, 86400), "a number 1-86400",
        "A model process that has not built and loaded its models within this is killed "
        "(the start fails; after a restart, it is tried again with backoff).")
    warmup_batches: int = setting("2", _int(0, 100), "an integer 0-100",
        "Warm-up passes per (length bucket, batch size) before the process is ready.")
    max_batch_size: int = setting("32", _int(1, 4096), "an integer 1-4096",
        "A batch is dispatched when it reaches this many items...")
    max_wait_ms: float = setting("5", _float(0, 10_000), "a number 0-10000",
        "...or when its oldest item has waited this long (with "
        "VEGA_DISPATCH_WHEN_IDLE=true, only while Redis overflow may hand it to a peer).")
    dispatch_when_idle: bool = setting("true", _bool, "true or false",
        "While an executor thread has no batch, dispatch what is queued at once; "
        "while all are busy, only full batches (a partial one grows until a thread frees; "
        "with VEGA_REDIS_URL it still goes at VEGA_MAX_WAIT_MS, for a peer to take).")
    length_buckets: tuple[int, ...] = setting("16,32,64,128,256,512", _buckets,
        "increasing positive integers, comma separated",
        "Upper bounds of the length buckets; a batch pads only to its own longest item.")
    bucket_padding: float = setting("0.25", _float(0, 10), "a number 0-10",
        "After warm-up, the length buckets are cut again from the measured batch times so "
        "that padding an item to its bucket's bound costs at most this share more per item "
        "(0 = VEGA_LENGTH_BUCKETS as given; those bounds are where warm-up measures).")
    max_inflight_batches: int = setting("2", _int(1, 64), "an integer 1-64",
        "Batches formed ahead while others run (pipelining bound); each is formed just "
        "before a thread frees.")
    queue_capacity: int = setting("1024", _int(1), "an integer >= 1",
        "Most items queued in this process, all classes together.")
    shed_watermark: float = setting("0.5", _float(0, 1), "a number 0-1",
        "Queue fill above which sheddable items are refused (429 shed).")
    normal_watermark: float = setting("0.9", _float(0, 1), "a number 0-1",
        "Queue fill above which normal items are refused (429 queue_full); "
        "critical keeps the rest.")
    rate_limit: float = setting("0", _float(0), "a number >= 0",
        "Token bucket refill in cost units per second (1 unit = one item of the "
        "shortest bucket); 0 = off.")
    burst: float = setting("0", _float(0), "a number >= 0",
        "Token bucket size in cost units (0 = one second of VEGA_RATE_LIMIT).")
    refusal_rate: float = setting("500", _float(0), "a number >= 0",
        "Most 429s sent per second, evenly spaced: one sooner than its turn waits for it, "
        "so callers ignoring Retry-After cannot swamp the loop (0 = off).")
    refusal_max_hold_ms: float = setting("2000", _float(0, 60_000), "a number 0-60000",
        "Longest a paced 429 is held (never past a deadline the request named).")
    default_deadline_ms: float = setting("1000", _float(1), "a number >= 1",
        "Deadline of a request that names none.")
    max_deadline_ms: float = setting("30000", _float(1), "a number >= 1",
        "Longest deadline a caller may ask for; longer ones are capped.")
    deadline_margin_ms: float = setting("2", _float(0), "a number >= 0",
        "Safety margin added to predicted completion in deadline checks.")
    codel_interval_ms: float = setting("100", _float(1), "a number >= 1",
        "Non-critical items join the queue only while the work ahead of them is "
        "under this; a queue that has not emptied for this long is a standing queue, and "
        "while no batch in it took every item of its buckets, serve newest first and refuse "
        "non-critical items older than this (two batch times where those are longer).")
    codel_target_ms: float = setting("5", _float(0), "a number >= 0",
        "Under a standing queue, non-critical items join only while the work ahead is "
        "below this (or one full batch where one length bucket is queued, two where several "
        "are, if more).")
    max_body_bytes: int = setting("4194304", _int(64), "an integer >= 64",
        "Largest request body read; larger ones get 413.")
    max_instances: int = setting("256", _int(1), "an integer >= 1",
        "Most instances in one request.")
    drain_timeout_s: float = setting("30", _float(0), "a number >= 0",
        "On SIGTERM, longest wait for admitted work before exiting.")
    access_log: bool = setting("false", _bool, "true or false",
        "Log every request (uvicorn access log).")
    redis_url: str = setting("", _redis_url,
        "empty, redis://host:port/db (rediss:// TLS, unix:///path), "
        "redis+cluster://host:port,host:port (seed nodes) or "
        "redis+sentinel://host:port,host:port/primary-name",
        "Redis for overflow between processes: one server, a Redis Cluster "
        "(redis+cluster://seed,seed) or a Sentinel-managed primary "
        "(redis+sentinel://sentinel,sentinel/name); empty = this process alone.", secret=True)
    node_id: str = setting("", _node_id, "1-64 of A-Z a-z 0-9 _ . : -",
        "Name of this process in Redis (default: host-pid).")
    auth_tokens: str = setting("", _tokens, "comma-separated tokens, none empty or with a "
        "space; or empty",
        "Bearer tokens accepted on the API; empty = no authentication.", secret=True)
    auth_open_paths: str = setting("/healthz,/readyz,/metrics,/v2/health/live,/v2/health/ready",
        _text, "comma-separated paths", "Paths served without a token when tokens are set.")
    log_level: str = setting("info", _choice("critical", "error", "warning", "info", "debug"),
        "critical, error, warning, info or debug", "Log level.")
    overflow_threshold_ms: float = setting("0", _float(0), "a number >= 0",
        "With Redis: a formed batch goes to a peer with spare threads once its predicted "
        "wait here exceeds the measured steal round trip by this much.")
    redis_timeout_ms: float = setting("100", _float(1, 10_000), "a number 1-10000",
        "Longest wait for one Redis command; past it the batch is served locally.")
    claim_idle_ms: int = setting("2000", _int(10), "an integer >= 10",
        "A stolen batch or a job pending this long (its process died) is reclaimed.")
    max_attempts: int = setting("3", _int(1, 100), "an integer 1-100",
        "Hand-offs of one batch, or runs of one job, before it goes to the dead-letter "
        "stream (a job is then failed).")
    heartbeat_ms: int = setting("1000", _int(50), "an integer >= 50",
        "How often this process writes its state to Redis (TTL: 3 beats + 0.5 s).")
    stream_maxlen: int = setting("10000", _int(100), "an integer >= 100",
        "Approximate cap on entries per overflow, reply and dead-letter stream.")
    clock_skew_ms: float = setting("50", _float(0), "a number >= 0",
        "Allowed wall-clock difference between hosts when a thief reads a deadline.")
    cache_bytes: int = setting("0", _int(0), "an integer >= 0",
        "Response cache: most bytes of answers kept in this process (0 = no cache).")
    cache_models: tuple[str, ...] = setting("*", _names, "* or model names, comma separated",
        "Models whose answers are cached when VEGA_CACHE_BYTES > 0 (* = every model).")
    cache_redis_ttl_s: float = setting("0", _float(0), "a number >= 0",
        "With VEGA_REDIS_URL: also share cached answers through Redis for this long "
        "(0 = this process only).")
    cache_nondeterministic: bool = setting("false", _bool, "true or false",
        "Cache answers of models that say their outputs are not deterministic.")
    idempotency_ttl_s: float = setting("600", _float(0), "a number >= 0",
        "How long the answer to an Idempotency-Key is kept for repeats (0 = header ignored).")
    idempotency_max_keys: int = setting("10000", _int(1), "an integer >= 1",
        "Most Idempotency-Key answers kept in this process (oldest dropped first).")
    fallback_model: str = setting("", lambda raw: _model(raw) if raw.strip() else "",
        "empty, sensor-small or another VEGA_MODEL value",
        "A cheaper model for the same inputs, serving degradable classes under pressure.")
    degrade_watermark: float = setting("0.25", _float(0, 1), "a number 0-1",
        "Queue fill of the main model above which degradable requests go to the fallback "
        "(they also go there whenever the main model would refuse them).")
    degrade_classes: tuple[str, ...] = setting("normal,sheddable", _classes,
        "classes, comma separated, or empty", "Classes that may be served by the fallback model.")
    jobs_max_depth: int = setting("10000", _int(1), "an integer >= 1",
        "Most jobs queued or running per model (POST /v1/jobs past it: 429 queue_full); "
        "without VEGA_REDIS_URL they are held in this process's memory.")
    jobs_memory_bytes: int = setting("268435456", _int(1), "an integer >= 1",
        "Without VEGA_REDIS_URL: most bytes of job inputs held in this process's memory, "
        "queued or running (POST /v1/jobs past it: 429 queue_full).")
    jobs_default_ttl_s: float = setting("600", _float(0.001), "a number > 0",
        "How long a job may wait to run when its body names no ttl_s.")
    jobs_max_ttl_s: float = setting("86400", _float(0.001), "a number > 0",
        "Longest ttl_s a job may ask for; longer ones are capped.")
    jobs_result_ttl_s: float = setting("3600", _float(1), "a number >= 1",
        "How long a finished job's result (or its failure) is kept for GET /v1/jobs/{id}.")
    jobs_redis_timeout_ms: float = setting("1000", _float(1, 60_000), "a number 1-60000",
        "Longest wait for one job-store command in Redis (a job can wait; a burst of "
        "submits keeps the loop busy past VEGA_REDIS_TIMEOUT_MS).")
    jobs_batch_ms: float = setting("20", _float(0), "a number >= 0",
        "A batch of job items is cut to what is predicted to run in this long, so an "
        "inline request arriving meanwhile waits at most that (0 = one job item a batch).")
    jobs_drain_target_s: float = setting("300", _float(1), "a number >= 1",
        "The capacity signal suggests enough processes to drain the job backlog in this long.")
    capacity_sample_s: float = setting("1", _float(0.05, 60), "a number 0.05-60",
        "How often the capacity signal samples load.")
    capacity_grow_s: float = setting("5", _float(0), "a number >= 0",
        "Backlog or refusals must last this long before the suggested processes grow.")
    capacity_shrink_s: float = setting("60", _float(0), "a number >= 0",
        "The process must be idle this long before the suggested processes shrink.")
    capacity_target: float = setting("0.75", _float(0.05, 1), "a number 0.05-1",
        "Executor utilisation the suggested number of processes plans for.")

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in self.public().items())})"

    def public(self) -> dict[str, Any]:
        """Settings as a dict with secrets masked, for printing."""
        out = dataclasses.asdict(self)
        for spec in SPECS:
            if spec.secret and out[spec.name]:
                value = out[spec.name]
                out[spec.name] = mask_url(value) if "://" in value else "***"
        return out

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


SPECS: tuple[Spec, ...] = tuple(
    Spec(f.name, **f.metadata["vega"]) for f in dataclasses.fields(Settings))

_BY_ENV = {spec.env: spec for spec in SPECS}
NOT_SETTINGS = frozenset({"VEGA_BENCH_TOKEN"})  # read by `vega bench`, not by the server


def load_settings(
    env_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Settings:
    """The frozen settings (``overrides``: flag values keyed by env name, ``VEGA_PORT``);
    ConfigError names the first bad value."""
    raw = {spec.env: spec.default for spec in SPECS}
    layers: list[Mapping[str, str]] = [read_env_file(env_file)] if env_file else []
    layers.append({k: v for k, v in (os.environ if environ is None else environ).items()
                   if k.startswith("VEGA_")})
    layers.append(overrides or {})
    for layer in layers:
        for key, value in layer.items():
            if not key.startswith("VEGA_") or key in NOT_SETTINGS:
                continue  # an env file's other variables (PYTHONPATH...), or a tool's own
            if key not in _BY_ENV:
                raise ConfigError(f"{key}: unknown setting (see conf/vega.env)")
            raw[key] = value
    values: dict[str, Any] = {}
    for spec in SPECS:
        try:
            values[spec.name] = spec.parse(raw[spec.env])
        except (ValueError, TypeError):
            shown = raw[spec.env]
            if spec.secret:
                shown = mask_url(shown) if "://" in shown else "***"
            raise ConfigError(
                f"{spec.env}={shown!r} is not allowed: expected {spec.allowed}") from None
    settings = Settings(**values)
    _check_together(settings)
    return settings


def _check_together(s: Settings) -> None:
    for name, value, bound, limit in (
            ("SHED_WATERMARK", s.shed_watermark, "NORMAL_WATERMARK", s.normal_watermark),
            ("DEFAULT_DEADLINE_MS", s.default_deadline_ms, "MAX_DEADLINE_MS", s.max_deadline_ms),
            ("JOBS_DEFAULT_TTL_S", s.jobs_default_ttl_s, "JOBS_MAX_TTL_S", s.jobs_max_ttl_s)):
        if value > limit:
            raise ConfigError(f"VEGA_{name}={value} is not allowed: expected a number "
                              f"<= VEGA_{bound} ({limit})")
    if s.fallback_model and s.fallback_model == s.model:
        raise ConfigError(f"VEGA_FALLBACK_MODEL={s.fallback_model!r} is not allowed: "
                          "expected a model other than VEGA_MODEL")


def env_file_text() -> str:
    """The documented env file: every setting with its default (conf/vega.env)."""
    lines = ["# Vega settings. Every line shows the default; uncomment to change.",
        "# Precedence: defaults < this file < VEGA_* environment < flags.",
        "# Under systemd this file overrides the unit's Environment= lines: leave what differs",
        "# per instance (VEGA_UDS, VEGA_NODE_ID, VEGA_HOST, VEGA_PORT, VEGA_DEVICE) to those.",
        ""]
    for spec in SPECS:
        lines.append(f"# {spec.doc} Allowed: {spec.allowed}.")
        lines.append(f"#{spec.env}={spec.default}")
        lines.append("")
    return "\n".join(lines)
