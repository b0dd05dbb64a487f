"""``vega cluster``: N Vega processes, a Redis, and Nginx in front, on this machine.

For trying the cluster mode out and for benchmarks; production runs the same pieces
under systemd (``conf/vega@.service``, ``nginx.conf``, docs/cluster.md). Nginx's
configuration is the repository's ``nginx.conf``, rendered with this run's upstreams,
listen address and paths (the lines marked ``# vega:``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vega.config import ConfigError, load_settings
from vega.listening import port_unusable
from vega.outpath import unwritable

TEMPLATE = Path(__file__).resolve().parent / "nginx.conf"  # the repository's nginx.conf links here


def render_nginx(upstreams: Sequence[str], listen: str, prefix: Path, *,
                 body_bytes: int = 4194304, max_deadline_ms: float = 30000,
                 template: str | None = None) -> str:
    """``nginx.conf`` for ``upstreams`` (``unix:/path`` or ``host:port``), rooted at ``prefix``."""
    text = template if template is not None else TEMPLATE.read_text()
    timeout_s = int(max_deadline_ms / 1000) + 5
    out: list[str] = []
    for line in text.splitlines():
        marker = re.search(r"#\s*vega:\s*(\w+)", line)
        if marker is None:
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        key = marker.group(1)
        if key == "servers":
            if any(s.lstrip().startswith("server ") for s in out[-1:]):
                continue  # written once, for all upstreams
            options = line.split("#")[0].split(";")[0].split()[2:]  # the template's own
            out += [" ".join([f"{indent}server", u, *options]) + ";" for u in upstreams]
        elif key == "pid":
            out.append(f"{indent}pid {prefix / 'nginx.pid'};")
        elif key == "error_log":
            out.append(f"{indent}error_log {prefix / 'nginx-error.log'} warn;")
        elif key == "temp":
            directive = line.split()[0]
            out.append(f"{indent}{directive} {prefix / directive.replace('_path', '')};")
        elif key == "listen":
            out.append(f"{indent}listen {listen} backlog=4096;")
        elif key == "body":
            out.append(f"{indent}client_max_body_size {body_bytes};")
        elif key == "timeout":
            out.append(f"{indent}{line.split()[0]} {timeout_s}s;")
    return "\n".join(out) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--processes", type=int, default=os.cpu_count() or 1,
                        help="Vega processes to start (default: one per core)")
    parser.add_argument("--listen", default="127.0.0.1:8080",
                        help="where Nginx listens (default 127.0.0.1:8080)")
    parser.add_argument("--dir", help="folder for sockets, configs and logs (default: a temp dir)")
    parser.add_argument("--env-file", help="VEGA_* settings for every process")


def run(args: argparse.Namespace) -> int:
    """Start everything, print where it listens, stop it all on Ctrl-C or SIGTERM."""
    try:
        settings = load_settings(env_file=args.env_file)
    except ConfigError as error:
        print(f"vega cluster: {error}", file=sys.stderr)
        return 2
    if args.processes < 1:
        print(f"vega cluster: -n {args.processes}: expected >= 1", file=sys.stderr)
        return 2
    problem = unwritable(Path(args.dir), directory=True) if args.dir else None
    if problem is not None:
        print(f"vega cluster: --dir {args.dir}: {problem}", file=sys.stderr)
        return 2
    if shutil.which("nginx") is None:
        print("vega cluster: nginx not found on PATH", file=sys.stderr)
        return 3
    why = _listen_unusable(args.listen)
    if why is not None:
        print(f"vega cluster: --listen {args.listen}: {why}", file=sys.stderr)
        return 3
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="vega-cluster-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # Nginx's workers run as an unprivileged user: they must be able to reach the sockets.
    workdir.chmod(0o755)
    procs: list[subprocess.Popen[bytes]] = []
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        redis_url = settings.redis_url or _start_redis(workdir, procs)
        sockets = [workdir / f"vega-{i}.sock" for i in range(1, args.processes + 1)]
        for i, path in enumerate(sockets, 1):
            procs.append(_start_vega(i, path, redis_url, workdir, args.env_file))
        conf = workdir / "nginx.conf"
        conf.write_text(render_nginx([f"unix:{p}" for p in sockets], args.listen, workdir,
                                     body_bytes=settings.max_body_bytes,
                                     max_deadline_ms=settings.max_deadline_ms))
        procs.append(_spawn(["nginx", "-p", str(workdir), "-c", str(conf), "-g",
                             "daemon off;"], workdir / "nginx.out"))
        # Two builds of the models (this one's, its model process's) and the warm-up.
        _wait_ready(sockets, procs, 300 + settings.model_start_timeout_s)
        print(f"vega cluster: {args.processes} process(es) behind http://{args.listen} "
              f"(redis {'given' if settings.redis_url else 'local'}; logs in {workdir}); "
              "Ctrl-C stops", flush=True)
        def start(index: int) -> subprocess.Popen[bytes]:
            return _start_vega(index, sockets[index - 1], redis_url, workdir, args.env_file)
        return _supervise(procs, start)
    except KeyboardInterrupt:
        return 0
    except StartFailed as error:
        print(f"vega cluster: {error} (logs in {workdir})", file=sys.stderr)
        return 3
    finally:
        _stop(procs)


def _listen_unusable(listen: str) -> str | None:
    """Why Nginx cannot listen on ``listen`` (another server does?), or None. Checked before
    anything starts: Nginx tells only once Redis and the processes are up, in a last line
    that says only "still could not bind()"."""
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or not port.isdigit():
        return None
    return port_unusable(host.strip("[]") or "0.0.0.0", int(port))


class StartFailed(Exception):
    """A part of the cluster exited or never came up while it started."""


RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)
DRAIN_S = 35.0  # a Vega process drains for at most VEGA_DRAIN_TIMEOUT_S (30) on SIGTERM
HURRIED_S = 1.0  # after a second signal: what is still running is killed
CRASH_LOOP = (5, 60.0)  # this many unexpected exits within this many seconds: give up


def _supervise(procs: list[subprocess.Popen[bytes]],
               start: Callable[[int], subprocess.Popen[bytes]]) -> int:
    """Restart a ``vega serve`` that exits, with backoff, until Ctrl-C or SIGTERM.

    Nginx keeps serving through the others meanwhile (a dead socket fails over at once:
    ``proxy_next_upstream error``; a restarting one answers 503 ``not_ready`` until warm).
    A process exiting CRASH_LOOP[0] times within CRASH_LOOP[1] seconds is left down, and
    said so. Nginx or Redis exiting, or every Vega process given up, stops the cluster.
    """
    vegas = {index: proc for index, proc in enumerate(
        (p for p in procs if _is_vega(p)), 1)}
    others = [p for p in procs if not _is_vega(p)]
    exits: dict[int, list[float]] = {index: [] for index in vegas}
    due: dict[int, float] = {}  # process index -> when it is restarted
    while True:
        now = time.monotonic()
        for proc in others:
            if proc.poll() is not None:
                name = proc.args[0] if isinstance(proc.args, list) else proc.args
                print(f"vega cluster: {name!s} exited with {proc.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
        for index, proc in vegas.items():
            if index in due or proc.poll() is None:
                continue
            recent = [t for t in exits[index] if now - t < CRASH_LOOP[1]] + [now]
            exits[index] = recent
            if len(recent) >= CRASH_LOOP[0]:
                print(f"vega cluster: process {index} exited {len(recent)} times within "
                      f"{CRASH_LOOP[1]:g} s (last status {proc.returncode}); not restarting it "
                      f"(see vega-{index}.log)", file=sys.stderr, flush=True)
                due[index] = float("inf")
                continue
            wait_s = RESTART_BACKOFF_S[min(len(recent), len(RESTART_BACKOFF_S)) - 1]
            print(f"vega cluster: process {index} exited with status {proc.returncode}; "
                  f"restarting in {wait_s:g} s", file=sys.stderr, flush=True)
            due[index] = now + wait_s
        if all(due.get(index) == float("inf") for index in vegas):
            print("vega cluster: no Vega process left; stopping", file=sys.stderr, flush=True)
            return 1
        for index, when in list(due.items()):
            if when <= now:
                del due[index]
                old = vegas[index]
                vegas[index] = procs[procs.index(old)] = start(index)
                print(f"vega cluster: process {index} restarted (pid {vegas[index].pid})",
                      file=sys.stderr, flush=True)
        time.sleep(0.2)


def _is_vega(proc: subprocess.Popen[bytes]) -> bool:
    return isinstance(proc.args, list) and proc.args[1:3] == ["-m", "vega"]


def _interrupt(signum: int, frame: object) -> None:
    """The first Ctrl-C or SIGTERM stops the cluster; later ones only hurry the stop."""
    _Hurry.install()
    raise KeyboardInterrupt


class _Hurry:
    """Signals that come while the cluster stops: from the first, the stop waits less."""

    at: float | None = None

    @classmethod
    def install(cls) -> None:
        signal.signal(signal.SIGTERM, cls._signalled)
        signal.signal(signal.SIGINT, cls._signalled)

    @classmethod
    def _signalled(cls, signum: int, frame: object) -> None:
        if cls.at is None:
            cls.at = time.monotonic()

    @classmethod
    def until(cls, end: float) -> float:
        """When to stop waiting for a process whose unhurried wait ends at ``end``."""
        return end if cls.at is None else min(end, cls.at + HURRIED_S)


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:  # a restart's output after that of the life that died
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # Ctrl-C is ours to pass on
    _LOGS[proc.pid] = log
    return proc


_LOGS: dict[int, Path] = {}  # each process's output, by pid: what to quote when it fails


def _exited(proc: subprocess.Popen[bytes]) -> str:
    """What a process that exited while starting said last, as one line."""
    name = "vega serve" if _is_vega(proc) else Path(str(
        proc.args[0] if isinstance(proc.args, list) else proc.args)).name
    log = _LOGS.get(proc.pid)
    lines = log.read_text(errors="replace").strip().splitlines() if log is not None else []
    return f"{name} exited with {proc.returncode}" + (f": {lines[-1][:300]}" if lines else "")


def _start_redis(workdir: Path, procs: list[subprocess.Popen[bytes]]) -> str:
    path = workdir / "redis.sock"
    procs.append(_spawn(["redis-server", "--port", "0", "--unixsocket", str(path),
                         "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                         "--dir", str(workdir)], workdir / "redis.log"))
    _wait_for(lambda: _connects(path), "redis-server")
    return f"unix://{path}"


def _start_vega(index: int, path: Path, redis_url: str, workdir: Path,
                env_file: str | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, VEGA_UDS=str(path), VEGA_REDIS_URL=redis_url,
               VEGA_NODE_ID=f"{socket.gethostname()}-{index}"[:64])
    argv = [sys.executable, "-m", "vega", "serve"] + (["--env-file", env_file] if env_file else [])
    return _spawn(argv, workdir / f"vega-{index}.log", env)


def _wait_ready(sockets: list[Path], procs: list[subprocess.Popen[bytes]],
                timeout_s: float) -> None:
    def ready() -> bool:
        for proc in procs:
            if proc.poll() is not None:
                raise StartFailed(_exited(proc))
        return all(_ready(path) for path in sockets)
    _wait_for(ready, "vega processes to warm up", timeout_s=timeout_s)


def _ready(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(1)
            sock.connect(str(path))
            sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: vega\r\nConnection: close\r\n\r\n")
            return sock.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _connects(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(path))
            return True
    except OSError:
        return False


def _wait_for(check: object, what: str, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > end:
            raise StartFailed(f"timed out waiting for {what}")
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the Vega processes (they drain: what they admitted is answered, what
    reaches them meanwhile gets 503) and SIGQUIT Nginx with them (its graceful stop: it
    accepts no more connections, and sends the answers on their way out; SIGTERM would
    close every client connection at once, and Nginx outliving the processes would
    answer 502 from their closed sockets), then SIGTERM Redis; kill what does not exit.

    A Ctrl-C or SIGTERM meanwhile hurries the stop (what is left gets HURRIED_S, then
    SIGKILL) instead of cutting it short, which would leave the children running."""
    _Hurry.install()
    redis = [p for p in procs if isinstance(p.args, list) and p.args[0] == "redis-server"]
    nginx = [p for p in procs if isinstance(p.args, list) and p.args[0] == "nginx"]
    vegas = [p for p in procs if p not in redis and p not in nginx]
    stages = ([(p, signal.SIGTERM) for p in vegas] + [(p, signal.SIGQUIT) for p in nginx],
              [(p, signal.SIGTERM) for p in redis])
    for stage in stages:
        for proc, stop in stage:
            if proc.poll() is None:
                proc.send_signal(stop)
        end = time.monotonic() + DRAIN_S
        for proc, _ in stage:
            while proc.poll() is None and time.monotonic() < _Hurry.until(end):
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # Each child leads its own process group: sweep them for what a leader killed outright
    # left behind (Nginx's workers outlive a SIGKILLed master, holding the listen port).
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
