"""The text settings come in: systemd ``EnvironmentFile`` syntax, the error a bad setting
raises, and a secret URL as messages show it."""

from __future__ import annotations

import re
from pathlib import Path


class ConfigError(ValueError):
    """A setting has a value that is not allowed; the message names both."""


def mask_url(url: str) -> str:
    """Hide the password of a URL (one host or several), in its user info or its query
    (``?password=``, as redis-py reads it), and keep the rest readable. The user info
    ends at the last ``@``: a malformed URL (a ``#``, ``?`` or ``/`` in the password)
    is shown in error messages too."""
    url = re.sub(r"(://[^:/@]*:).*@", r"\1***@", url)
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", url, flags=re.IGNORECASE)


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
