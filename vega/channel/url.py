"""``VEGA_REDIS_URL``: which Redis, as an operator writes it (docs/cluster.md "Which Redis").

- ``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS), ``unix:///path``:
  one Redis server (redis-py's own URL format, query options included).
- ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster`` for
  TLS): a Redis Cluster, given by one or more seed nodes; the rest are discovered.
- ``redis+sentinel://[user:password@]host:port[,host:port...]/primary[/db]``
  (``rediss+sentinel``): the primary that these Sentinels name ``primary``; the
  password is the data nodes', the Sentinels are asked without one.

Parsing only (no redis import), so that config validation can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

STANDALONE, CLUSTER, SENTINEL = "standalone", "cluster", "sentinel"
SCHEMES = {"redis": STANDALONE, "rediss": STANDALONE, "unix": STANDALONE,
           "redis+cluster": CLUSTER, "rediss+cluster": CLUSTER,
           "redis+sentinel": SENTINEL, "rediss+sentinel": SENTINEL}
DEFAULT_PORT = {CLUSTER: 6379, SENTINEL: 26379}
_HOST = re.compile(r"\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9_.-]+)")
_SERVICE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True)
class RedisTarget:
    mode: str  # STANDALONE, CLUSTER or SENTINEL
    url: str  # as given (standalone: handed to redis-py as is)
    nodes: tuple[tuple[str, int], ...] = ()  # cluster seeds, or the Sentinels
    service: str = ""  # the Sentinel-managed primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse_redis_url(url: str) -> RedisTarget:
    """The target ``url`` names; ValueError saying what is wrong when it names none."""
    parts = urlsplit(url.strip())
    mode = SCHEMES.get(parts.scheme)
    if mode is None:
        raise ValueError(f"unknown scheme {parts.scheme!r}")
    if mode == STANDALONE:
        from redis.connection import parse_url  # redis-py reads it: its own check, at start

        parse_url(url.strip())  # type: ignore[no-untyped-call]  # ValueError: bad port or db
        return RedisTarget(STANDALONE, url.strip())
    if parts.query or parts.fragment:
        raise ValueError("no ?options or #fragment in cluster or sentinel URLs")
    userinfo, at, hosts = parts.netloc.rpartition("@")
    username = password = None
    if at:
        name, colon, secret = userinfo.partition(":")
        username = unquote(name) or None
        password = unquote(secret) if colon else None
    nodes = tuple(_node(part, DEFAULT_PORT[mode]) for part in hosts.split(","))
    path = [unquote(p) for p in parts.path.split("/")[1:]] if parts.path else []
    tls = parts.scheme.startswith("rediss")
    if mode == CLUSTER:
        if path not in ([], [""], ["0"]):
            raise ValueError("a cluster has database 0 only: no path")
        return RedisTarget(CLUSTER, url, nodes, username=username, password=password, tls=tls)
    if not path or not _SERVICE.fullmatch(path[0]) or len(path) > 2:
        raise ValueError("a sentinel URL ends in /primary-name[/db]")
    db = path[1] if len(path) == 2 else "0"
    if not db.isdigit():
        raise ValueError(f"bad database {db!r}")
    return RedisTarget(SENTINEL, url, nodes, service=path[0], db=int(db), username=username,
                       password=password, tls=tls)


def _node(text: str, default_port: int) -> tuple[str, int]:
    host, colon, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not colon:
        host, port = text, str(default_port)
    match = _HOST.fullmatch(host)
    if match is None or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad host:port {text!r}")
    return match.group(1) or match.group(2), int(port)
