"""Settings: defaults < env file < ``VEGA_*`` environment < command-line flags.

Every setting is declared once, in ``SPECS``; the env file documentation
(``conf/vega.env``), the CLI flags and the validation all come from that table.
The result is one frozen ``Settings`` object built at start.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vega.channel.url import parse_redis_url
from vega.records import PRIORITY_NAMES


class ConfigError(ValueError):
    """A setting has a value that is not allowed; the message names both."""


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
        if not value == value or value < lo or (hi is not None and value > hi):
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


SPECS: tuple[Spec, ...] = (
    Spec("host", "127.0.0.1", _text, "an address", "Address to listen on."),
    Spec("port", "8000", _int(0, 65535), "an integer 0-65535", "TCP port (0 = any free port)."),
    Spec("uds", "", _text, "a path or empty", "Listen on this unix socket instead of host:port."),
    Spec("model", "sensor", _text, "sensor, torchscript:PATH or python:module:attr",
         "The model this process serves (the default for /v1/infer)."),
    Spec("model_name", "", _text, "a name or empty",
         "Name the model is served under (default: derived from VEGA_MODEL)."),
    Spec("device", "auto", _device, "cpu, cuda, cuda:N or auto",
         "Where the model runs; auto picks cuda when available."),
    Spec("torch_threads", "0", _int(0), "an integer >= 0",
         "torch intra-op threads per executor thread (0 = torch's default)."),
    Spec("executor_threads", "1", _int(1, 64), "an integer 1-64",
         "Executor threads running batches (one per device is usual)."),
    Spec("executor", "auto", _choice("auto", "thread", "process"), "auto, thread or process",
         "Where the model runs: a thread of this process, or a model process of its own "
         "(fed through shared memory, so an eager module's Python does not contend with "
         "the event loop for the GIL); auto = process for an eager torch module, thread "
         "for TorchScript and other adapters."),
    Spec("model_timeout_s", "30", _float(0.01, 3600), "a number 0.01-3600",
         "A batch running longer in a model process is taken to hang: the process is "
         "killed and restarted, that batch answered 500 model_error."),
    Spec("warmup_batches", "2", _int(0, 100), "an integer 0-100",
         "Warm-up passes per (length bucket, batch size) before the process is ready."),
    Spec("max_batch_size", "32", _int(1, 4096), "an integer 1-4096",
         "A batch is dispatched when it reaches this many items..."),
    Spec("max_wait_ms", "5", _float(0, 10_000), "a number 0-10000",
         "...or when its oldest item has waited this long (with "
         "VEGA_DISPATCH_WHEN_IDLE=true, only while Redis overflow may hand it to a peer)."),
    Spec("dispatch_when_idle", "true", _bool, "true or false",
         "While an executor thread has no batch, dispatch what is queued at once; "
         "while all are busy, only full batches (a partial one grows until a thread frees; "
         "with VEGA_REDIS_URL it still goes at VEGA_MAX_WAIT_MS, for a peer to take)."),
    Spec("length_buckets", "16,32,64,128,256,512", _buckets,
         "increasing positive integers, comma separated",
         "Upper bounds of the length buckets; a batch pads only to its own longest item."),
    Spec("bucket_padding", "0.25", _float(0, 10), "a number 0-10",
         "After warm-up, the length buckets are cut again from the measured batch times so "
         "that padding an item to its bucket's bound costs at most this share more per item "
         "(0 = VEGA_LENGTH_BUCKETS as given; those bounds are where warm-up measures)."),
    Spec("max_inflight_batches", "2", _int(1, 64), "an integer 1-64",
         "Batches formed ahead while others run (pipelining bound); each is formed just "
         "before a thread frees."),
    Spec("queue_capacity", "1024", _int(1), "an integer >= 1",
         "Most items queued in this process, all classes together."),
    Spec("shed_watermark", "0.5", _float(0, 1), "a number 0-1",
         "Queue fill above which sheddable items are refused (429 shed)."),
    Spec("normal_watermark", "0.9", _float(0, 1), "a number 0-1",
         "Queue fill above which normal items are refused (429 queue_full); "
         "critical keeps the rest."),
    Spec("rate_limit", "0", _float(0), "a number >= 0",
         "Token bucket refill in cost units per second (1 unit = one item of the "
         "shortest bucket); 0 = off."),
    Spec("burst", "0", _float(0), "a number >= 0",
         "Token bucket size in cost units (0 = one second of VEGA_RATE_LIMIT)."),
    Spec("refusal_rate", "500", _float(0), "a number >= 0",
         "429s answered at once per second; beyond it each waits its turn, so callers "
         "ignoring Retry-After cannot swamp the loop (0 = off)."),
    Spec("refusal_max_hold_ms", "2000", _float(0, 60_000), "a number 0-60000",
         "Longest a paced 429 is held before it is sent."),
    Spec("default_deadline_ms", "1000", _float(1), "a number >= 1",
         "Deadline of a request that names none."),
    Spec("max_deadline_ms", "30000", _float(1), "a number >= 1",
         "Longest deadline a caller may ask for; longer ones are capped."),
    Spec("deadline_margin_ms", "2", _float(0), "a number >= 0",
         "Safety margin added to predicted completion in deadline checks."),
    Spec("codel_interval_ms", "100", _float(1), "a number >= 1",
         "Non-critical items join the queue only while the work ahead of them is "
         "under this; a queue that has not emptied for this long is a standing queue: "
         "serve newest first and refuse non-critical items older than this."),
    Spec("codel_target_ms", "5", _float(0), "a number >= 0",
         "Under a standing queue, non-critical items join only while the work ahead is "
         "below this (or two full batches, if more)."),
    Spec("max_body_bytes", "4194304", _int(64), "an integer >= 64",
         "Largest request body read; larger ones get 413."),
    Spec("max_instances", "256", _int(1), "an integer >= 1",
         "Most instances in one request."),
    Spec("drain_timeout_s", "30", _float(0), "a number >= 0",
         "On SIGTERM, longest wait for admitted work before exiting."),
    Spec("access_log", "false", _bool, "true or false", "Log every request (uvicorn access log)."),
    Spec("redis_url", "", _redis_url,
         "empty, redis://host:port/db (rediss:// TLS, unix:///path), "
         "redis+cluster://host:port,host:port (seed nodes) or "
         "redis+sentinel://host:port,host:port/primary-name",
         "Redis for overflow between processes: one server, a Redis Cluster "
         "(redis+cluster://seed,seed) or a Sentinel-managed primary "
         "(redis+sentinel://sentinel,sentinel/name); empty = this process alone.", secret=True),
    Spec("node_id", "", _node_id, "1-64 of A-Z a-z 0-9 _ . : -",
         "Name of this process in Redis (default: host-pid)."),
    Spec("auth_tokens", "", _text, "comma-separated tokens or empty",
         "Bearer tokens accepted on the API; empty = no authentication.", secret=True),
    Spec("auth_open_paths", "/healthz,/readyz,/metrics,/v2/health/live,/v2/health/ready",
         _text, "comma-separated paths", "Paths served without a token when tokens are set."),
    Spec("log_level", "info", _choice("critical", "error", "warning", "info", "debug"),
         "critical, error, warning, info or debug", "Log level."),
    Spec("overflow_threshold_ms", "0", _float(0), "a number >= 0",
         "With Redis: a formed batch goes to a peer with spare threads once its predicted "
         "wait here exceeds the measured steal round trip by this much."),
    Spec("redis_timeout_ms", "100", _float(1, 10_000), "a number 1-10000",
         "Longest wait for one Redis command; past it the batch is served locally."),
    Spec("claim_idle_ms", "2000", _int(10), "an integer >= 10",
         "A stolen batch pending this long (its thief died) is reclaimed."),
    Spec("max_attempts", "3", _int(1, 100), "an integer 1-100",
         "Hand-offs of one batch before it goes to the dead-letter stream."),
    Spec("heartbeat_ms", "1000", _int(50), "an integer >= 50",
         "How often this process writes its state to Redis (TTL: 3 beats + 0.5 s)."),
    Spec("stream_maxlen", "10000", _int(100), "an integer >= 100",
         "Approximate cap on entries per overflow, reply and dead-letter stream."),
    Spec("clock_skew_ms", "50", _float(0), "a number >= 0",
         "Allowed wall-clock difference between hosts when a thief reads a deadline."),
    Spec("cache_bytes", "0", _int(0), "an integer >= 0",
         "Response cache: most bytes of answers kept in this process (0 = no cache)."),
    Spec("cache_models", "*", _names, "* or model names, comma separated",
         "Models whose answers are cached when VEGA_CACHE_BYTES > 0 (* = every model)."),
    Spec("cache_redis_ttl_s", "0", _float(0), "a number >= 0",
         "With VEGA_REDIS_URL: also share cached answers through Redis for this long "
         "(0 = this process only)."),
    Spec("cache_nondeterministic", "false", _bool, "true or false",
         "Cache answers of models that say their outputs are not deterministic."),
    Spec("idempotency_ttl_s", "600", _float(0), "a number >= 0",
         "How long the answer to an Idempotency-Key is kept for repeats (0 = header ignored)."),
    Spec("idempotency_max_keys", "10000", _int(1), "an integer >= 1",
         "Most Idempotency-Key answers kept in this process (oldest dropped first)."),
    Spec("fallback_model", "", _text, "empty, sensor-small or another VEGA_MODEL value",
         "A cheaper model for the same inputs, serving degradable classes under pressure."),
    Spec("degrade_watermark", "0.25", _float(0, 1), "a number 0-1",
         "Queue fill of the main model above which degradable requests go to the fallback "
         "(they also go there whenever the main model would refuse them)."),
    Spec("degrade_classes", "normal,sheddable", _classes, "classes, comma separated, or empty",
         "Classes that may be served by the fallback model."),
    Spec("capacity_sample_s", "1", _float(0.05, 60), "a number 0.05-60",
         "How often the capacity signal samples load."),
    Spec("capacity_grow_s", "5", _float(0), "a number >= 0",
         "Backlog or refusals must last this long before the suggested processes grow."),
    Spec("capacity_shrink_s", "60", _float(0), "a number >= 0",
         "The process must be idle this long before the suggested processes shrink."),
    Spec("capacity_target", "0.75", _float(0.05, 1), "a number 0.05-1",
         "Executor utilisation the suggested number of processes plans for."),
)

_BY_ENV = {spec.env: spec for spec in SPECS}


@dataclass(frozen=True)
class Settings:
    host: str
    port: int
    uds: str
    model: str
    model_name: str
    device: str
    torch_threads: int
    executor_threads: int
    executor: str
    model_timeout_s: float
    warmup_batches: int
    max_batch_size: int
    max_wait_ms: float
    dispatch_when_idle: bool
    length_buckets: tuple[int, ...]
    bucket_padding: float
    max_inflight_batches: int
    queue_capacity: int
    shed_watermark: float
    normal_watermark: float
    rate_limit: float
    burst: float
    refusal_rate: float
    refusal_max_hold_ms: float
    default_deadline_ms: float
    max_deadline_ms: float
    deadline_margin_ms: float
    codel_interval_ms: float
    codel_target_ms: float
    max_body_bytes: int
    max_instances: int
    drain_timeout_s: float
    access_log: bool
    redis_url: str
    node_id: str
    auth_tokens: str
    auth_open_paths: str
    log_level: str
    overflow_threshold_ms: float
    redis_timeout_ms: float
    claim_idle_ms: int
    max_attempts: int
    heartbeat_ms: int
    stream_maxlen: int
    clock_skew_ms: float
    cache_bytes: int
    cache_models: tuple[str, ...]
    cache_redis_ttl_s: float
    cache_nondeterministic: bool
    idempotency_ttl_s: float
    idempotency_max_keys: int
    fallback_model: str
    degrade_watermark: float
    degrade_classes: tuple[str, ...]
    capacity_sample_s: float
    capacity_grow_s: float
    capacity_shrink_s: float
    capacity_target: float

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


def mask_url(url: str) -> str:
    """Hide the password of a URL (one host or several), keep the rest readable."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    netloc = f"{userinfo.partition(':')[0]}:***@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def read_env_file(path: str | Path) -> dict[str, str]:
    """Parse systemd ``EnvironmentFile`` syntax: ``KEY=value``, ``#``/``;`` comments."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--env-file={path}: cannot read: {exc}") from None
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"{path}:{number}: expected KEY=value, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key] = value
    return values


def load_settings(
    env_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
) -> Settings:
    """Build the frozen settings; raise ConfigError naming the first bad value.

    ``overrides`` are command-line values keyed by env name (``VEGA_PORT``).
    """
    raw = {spec.env: spec.default for spec in SPECS}
    layers: list[Mapping[str, str]] = []
    if env_file:
        layers.append(read_env_file(env_file))
    layers.append({k: v for k, v in (os.environ if environ is None else environ).items()
                   if k.startswith("VEGA_")})
    layers.append(overrides or {})
    for layer in layers:
        for key, value in layer.items():
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
    if s.shed_watermark > s.normal_watermark:
        raise ConfigError(
            f"VEGA_SHED_WATERMARK={s.shed_watermark} is not allowed: expected a number "
            f"<= VEGA_NORMAL_WATERMARK ({s.normal_watermark})")
    if s.default_deadline_ms > s.max_deadline_ms:
        raise ConfigError(
            f"VEGA_DEFAULT_DEADLINE_MS={s.default_deadline_ms} is not allowed: expected a "
            f"number <= VEGA_MAX_DEADLINE_MS ({s.max_deadline_ms})")
    if s.fallback_model and s.fallback_model == s.model:
        raise ConfigError(
            f"VEGA_FALLBACK_MODEL={s.fallback_model!r} is not allowed: expected a model "
            f"other than VEGA_MODEL")


def length_bounds(configured: tuple[int, ...], max_length: int) -> tuple[int, ...]:
    """The length buckets served: the configured bounds below the model's longest input,
    and that longest input."""
    return tuple(b for b in configured if b < max_length) + (max_length,)


def env_file_text() -> str:
    """The documented env file: every setting with its default (conf/vega.env)."""
    lines = ["# Vega settings. Every line shows the default; uncomment to change.",
             "# Precedence: defaults < this file < VEGA_* environment < flags.", ""]
    for spec in SPECS:
        lines.append(f"# {spec.doc} Allowed: {spec.allowed}.")
        lines.append(f"#{spec.env}={spec.default}")
        lines.append("")
    return "\n".join(lines)


def flag_specs() -> Sequence[Spec]:
    return SPECS
