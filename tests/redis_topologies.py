"""Fixtures for Redis as operators run it past one server: a Cluster, and Sentinel.

Registered through ``pytest_plugins`` in conftest.py. ``redis_cluster``: three
primaries (``redis-server --cluster-enabled yes`` joined by ``redis-cli --cluster
create``), shared by a module. ``redis_sentinel``: a primary, a replica and one
Sentinel watching them (quorum 1, down after 1 s), fresh per test since tests kill
the primary. Everything runs under tmp_path on free ports and is killed afterwards.
"""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.infra import _answers, require, start_redis
from tests.servers import wait_until

SERVICE = "vega-primary"  # the name the Sentinel gives the primary


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# Its own generator: a test that seeds the global one must not make two workers draw alike.
_PORTS = random.Random()


def cluster_ports(count: int) -> list[int]:
    """Distinct free ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        port = _PORTS.randrange(20000, 30000)
        if port not in ports and _bindable(port) and _bindable(port + 10000):
            ports.append(port)
    return ports


def _info(port: int, *command: str) -> str:
    done = subprocess.run(["redis-cli", "-p", str(port), *command], capture_output=True,
                          text=True, timeout=10, check=False)
    return done.stdout


class Servers:
    """Redis processes started from argument lists; all killed at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, port: int, *args: str) -> None:
        assert port not in self.procs or self.procs[port].poll() is not None, port
        self.procs[port] = start_redis(args, cwd=self.workdir)
        wait_until(lambda: _answers(port), 10, f"redis on {port}")

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        if proc.poll() is None:
            proc.kill()  # as a crash would
            proc.wait()

    def stop_all(self) -> None:
        for port in self.procs:
            self.kill(port)


def _data_args(port: int, workdir: Path) -> list[str]:
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]


class Cluster(Servers):
    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        super().__init__(workdir)
        self.ports = cluster_ports(primaries)
        # Two seeds: the client discovers the third.
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2])

    def up(self) -> Cluster:
        for port in self.ports:
            self.start(port, *_data_args(port, self.workdir), "--cluster-enabled", "yes",
                       "--cluster-config-file", f"nodes-{port}.conf",
                       "--cluster-node-timeout", "2000")
        created = subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=False)
        assert created.returncode == 0, created.stdout + created.stderr
        wait_until(lambda: all("cluster_state:ok" in _info(p, "cluster", "info")
                               for p in self.ports), 20, "the cluster to be ok")
        return self

    def node_of(self, key: str) -> int:
        """The port of the primary that holds ``key``'s slot."""
        slot = int(_info(self.ports[0], "cluster", "keyslot", key))
        for line in _info(self.ports[0], "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            for span in fields[8:]:
                low, _, high = span.partition("-")
                if int(low) <= slot <= int(high or low):
                    return int(fields[1].split(":")[1].split("@")[0])
        raise AssertionError(f"no primary holds slot {slot}")


class SentinelSet(Servers):
    """A primary, its replica, and one Sentinel that fails over when the primary dies."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.primary, self.replica, self.sentinel = cluster_ports(3)
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel}/{SERVICE}"

    def up(self) -> SentinelSet:
        self.start(self.primary, *_data_args(self.primary, self.workdir))
        self.start(self.replica, *_data_args(self.replica, self.workdir),
                   "--replicaof", "127.0.0.1", str(self.primary))
        wait_until(lambda: "master_link_status:up" in _info(self.replica, "info", "replication"),
                   20, "the replica to sync")
        conf = self.workdir / "sentinel.conf"
        conf.write_text(f"port {self.sentinel}\nbind 127.0.0.1\ndir {self.workdir}\n"
                        f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary} 1\n"
                        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                        f"sentinel failover-timeout {SERVICE} 5000\n")
        self.start(self.sentinel, str(conf), "--sentinel")
        # It can fail over only once it has found the replica (through the primary's INFO).
        wait_until(lambda: str(self.replica) in _info(
            self.sentinel, "sentinel", "replicas", SERVICE), 20, "the sentinel to see the replica")
        return self

    def primary_port(self) -> int:
        lines = _info(self.sentinel, "sentinel", "get-master-addr-by-name", SERVICE).split()
        return int(lines[1])

    def fail_over(self) -> None:
        """Kill the primary; wait until the Sentinel names the replica instead."""
        self.kill(self.primary)
        wait_until(lambda: self.primary_port() == self.replica, 30, "the failover")
        wait_until(lambda: "role:master" in _info(self.replica, "info", "replication"), 10,
                   "the replica to be promoted")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require("redis-server", "redis-cli")
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.up()
    finally:
        cluster.stop_all()


@pytest.fixture
def redis_sentinel(tmp_path: Path) -> Iterator[SentinelSet]:
    require("redis-server", "redis-cli")
    sentinels = SentinelSet(tmp_path)
    try:
        yield sentinels.up()
    finally:
        sentinels.stop_all()


def spread(cluster: Cluster, keys: Sequence[str]) -> set[int]:
    """The primaries that hold ``keys``: more than one shows a test crossed slots."""
    return {cluster.node_of(key) for key in keys}
