"""Whether a server could listen on an address: checked before anything starts, so that
a port or socket in use is one clear line, not a failure after the models are built."""

from __future__ import annotations

import errno
import os
import socket
import stat


def port_unusable(host: str, port: int) -> str | None:
    """Why a server cannot listen on ``host:port`` (another process does?), or None. Bound
    as the event loop binds it: each address the host resolves to, IPv6 ones IPv6-only,
    one whose family the host lacks skipped."""
    probes: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            probe = socket.socket(family, kind, proto)
            probes.append(probe)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno != errno.EADDRNOTAVAIL:
                    raise
    except OSError as error:
        return error.strerror or str(error)
    finally:
        for probe in probes:
            probe.close()
    return None


def uds_unusable(path: str) -> str | None:
    """Why a server cannot listen on the unix socket ``path``, or None. A live socket there
    is another server's: the event loop would remove it and take its place, silently."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    if not os.path.lexists(path):
        return None
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        return "it exists and is not a socket"
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return None  # left by a process that is gone: the loop replaces it
    except OSError as error:
        return f"cannot be checked: {error.strerror}"
    finally:
        probe.close()
    return "another process is listening on it"
