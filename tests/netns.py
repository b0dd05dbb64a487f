"""Test hosts: network namespaces joined by a bridge, made and removed by the tests.

Each host is a namespace with one veth into a switch namespace that holds a bridge;
the test process (in the root namespace) gets a veth into the switch too, so it can
reach every host. Addresses are the test's own (10.213.77.0/24, inside these
namespaces only). ``cut(host)`` takes a host's link down as a pulled cable would.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence

import pytest

from tests.infra import unavailable

SUBNET = "10.213.77"
CLIENT = f"{SUBNET}.100"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    def __init__(self, names: Sequence[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.switch = f"vsw{self.tag}"
        self.names = list(names)
        self.address = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self._ns = {name: f"v{self.tag}{name}" for name in names}
        self._port = {name: f"p{self.tag}{i}" for i, name in enumerate(names)}
        self._client = f"v{self.tag}c"

    def prefix(self, name: str) -> list[str]:
        """Argv prefix that runs a command on host ``name``."""
        return ["ip", "netns", "exec", self._ns[name]]

    def up(self) -> Hosts:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ns, port, inner = self._ns[name], self._port[name], f"i{self.tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", port)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._attach(port)
        client_port = f"p{self.tag}c"
        _ip("link", "add", self._client, "type", "veth", "peer", "name", client_port)
        _ip("addr", "add", f"{CLIENT}/24", "dev", self._client)
        _ip("link", "set", self._client, "up")
        self._attach(client_port)
        return self

    def _attach(self, port: str) -> None:
        _ip("link", "set", port, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")

    def cut(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port[name], "down")

    def mend(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self._port[name], "up")

    def down(self) -> None:
        for ns in [*self._ns.values(), self.switch]:  # removing a namespace removes its veths
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self._client], capture_output=True, check=False)


def namespaces_allowed() -> str:
    """Empty when this machine lets the tests make namespaces, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"vprobe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


@pytest.fixture
def hosts() -> Iterator[type[Hosts]]:
    """Hosts(names).up() builds test hosts; all are removed after the test."""
    why = namespaces_allowed()
    if why:
        unavailable(f"multi-host tests need network namespaces: {why}")
    made: list[Hosts] = []

    class Tracked(Hosts):
        def up(self) -> Hosts:
            made.append(self)
            return super().up()

    yield Tracked
    for topology in made:
        topology.down()
