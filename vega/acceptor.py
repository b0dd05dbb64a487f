"""Accepting every pending connection at once, where uvloop takes one a loop turn.

libuv accepts a single connection each time a listening socket polls readable (libuv
pull request 3696), so a loop whose turns take 10 ms under load accepts about a hundred
connections a second. A burst opens connections: callers grow their pools, Nginx opens
upstream connections beyond its keep-alive cache. Their requests then wait in the
listen queue, for seconds, where admission cannot see them and no deadline is kept.

Each listening socket gets a second reader, on a duplicate of its descriptor, that
accepts what is pending (up to ``BATCH`` a turn) and hands each connection to the same
HTTP protocol uvicorn uses. uvloop's own watcher stays: whichever runs first in a turn
accepts, and the other finds nothing pending.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger("vega.acceptor")

BATCH = 256  # connections accepted in one callback: bounds the loop time one takes


class BatchAcceptor:
    """A second, greedy accept loop on ``listener`` (which stays open and in use)."""

    def __init__(self, listener: socket.socket,
                 protocol_factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = socket.socket(fileno=os.dup(listener.fileno()))
        self._sock.setblocking(False)
        self._factory = protocol_factory
        self._opening: set[asyncio.Task[object]] = set()
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(BATCH):
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of descriptors, an aborted connection
                log.warning("accept failed: %s", error)
                return
            conn.setblocking(False)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                # As uvloop sets on the connections it accepts: small answers go at once.
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory,
                                                                             conn))
            self._opening.add(task)
            task.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Task[object]) -> None:
        self._opening.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning("could not open an accepted connection: %r", error)

    async def close(self) -> None:
        """Stop accepting; the connections being opened are open when this returns, so a
        shutdown that closes every open connection also closes them."""
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        if self._opening:
            await asyncio.gather(*self._opening, return_exceptions=True)
