"""vega.acceptor on uvloop (the loop `vega serve` runs): connections pending on a
listening socket are all accepted within a few loop turns, not one a turn."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import uvloop

from vega.acceptor import BatchAcceptor

PENDING = 64
TURNS = 8  # loop turns given to accept them: uvloop alone takes one connection a turn


class Counted(asyncio.Protocol):
    """Appends each connection it is made for to ``made``."""

    def __init__(self, made: list[asyncio.Transport]) -> None:
        self.made = made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)  # type: ignore[arg-type]


def counting() -> tuple[list[asyncio.Transport], Callable[[], Counted]]:
    made: list[asyncio.Transport] = []
    return made, lambda: Counted(made)


async def turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def connect_unix(path: Path, count: int) -> list[socket.socket]:
    """Connections that complete into the listen queue at once, before any is accepted."""
    clients = []
    for _ in range(count):
        client = socket.socket(socket.AF_UNIX)
        client.setblocking(False)
        client.connect(str(path))
        clients.append(client)
    return clients


def test_connections_pending_at_once_are_accepted_within_a_few_turns(tmp_path: Path) -> None:
    accepted: dict[str, int] = {}

    async def main() -> None:
        for name, greedy in (("uvloop alone", False), ("with the acceptor", True)):
            made, protocol = counting()
            path = tmp_path / f"{greedy}.sock"
            server = await asyncio.get_running_loop().create_unix_server(protocol, str(path),
                                                                          backlog=1024)
            acceptor = BatchAcceptor(server.sockets[0], protocol) if greedy else None
            clients = connect_unix(path, PENDING)
            await turns(TURNS)
            accepted[name] = len(made)
            if acceptor is not None:
                await acceptor.close()
            server.close()
            for client in clients:
                client.close()
            for transport in made:
                transport.close()

    uvloop.run(main())
    assert accepted["with the acceptor"] == PENDING
    # What the acceptor is for; if uvloop ever accepts greedily, vega.acceptor can go.
    assert accepted["uvloop alone"] <= TURNS


def test_tcp_connections_are_accepted_with_nodelay() -> None:
    delays: list[int] = []

    async def main() -> None:
        made, protocol = counting()
        server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)
        acceptor = BatchAcceptor(server.sockets[0], protocol)
        port = server.sockets[0].getsockname()[1]
        clients = []
        for _ in range(16):
            client = socket.socket()
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", port))
            clients.append(client)
        for _ in range(200):
            if len(made) == len(clients):
                break
            await asyncio.sleep(0.005)
        for transport in made:
            sock = transport.get_extra_info("socket")
            delays.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()
        await acceptor.close()
        for client in clients:
            client.close()
        server.close()

    uvloop.run(main())
    assert len(delays) == 16
    assert all(delays)  # small answers are not held back by Nagle's algorithm


def test_closed_acceptor_leaves_the_listener_to_uvloop(tmp_path: Path) -> None:
    counts: list[int] = []

    async def main() -> None:
        made, protocol = counting()
        path = tmp_path / "l.sock"
        server = await asyncio.get_running_loop().create_unix_server(protocol, str(path))
        acceptor = BatchAcceptor(server.sockets[0], protocol)
        await acceptor.close()
        clients = connect_unix(path, 3)
        for _ in range(200):
            if len(made) == 3:
                break
            await asyncio.sleep(0.005)
        counts.append(len(made))
        for transport in made:
            transport.close()
        for client in clients:
            client.close()
        server.close()

    uvloop.run(main())
    assert counts == [3]  # still listening: uvloop's own watcher accepts them
