"""``vega serve|config``: argv -> Settings -> uvicorn on uvloop and httptools
(vega.transport: one socket write per response; vega.acceptor: every pending
connection accepted in one loop turn).

Exit status: 0 after a clean stop (SIGTERM drains first), 2 for a bad setting,
3 when the process could not start (model failed to load, port taken).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from vega import LOG_FORMAT
from vega.acceptor import BatchAcceptor
from vega.config import SPECS, ConfigError, Settings, load_settings
from vega.listening import port_unusable, uds_unusable
from vega.logs import Repeats

EXIT_CONFIG = 2
EXIT_STARTUP = 3
# After the drain, what uvicorn still waits for (a caller that stopped sending its body
# halfway) gets this long before its task is cancelled: a stop stays bounded.
SHUTDOWN_GRACE_S = 2

if TYPE_CHECKING:
    from vega.runtime import Runtime

log = logging.getLogger("vega")


# Tools that share the `vega` command but not the server's settings; each module has
# configure(parser) and run(args), and is imported only when its command is used.
TOOLS = {
    "bench": ("vega.lab.loadgen", "drive a server with open- or closed-loop load; report and plot"),
    "profile": ("vega.lab.profile", "measure the model's batch latency per bucket and size"),
    "simulate": ("vega.lab.simulate", "replay a traffic profile through the real policy code"),
    "cluster": ("vega.lab.cluster", "run N processes, Redis and Nginx on this machine"),
    "export": ("vega.models.export", "compile a model ahead of time into a package (aoti:PATH)"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vega", description="Vega inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("serve", "run the server"), ("config", "print the effective settings")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--env-file", help="systemd EnvironmentFile with VEGA_* settings")
        for spec in SPECS:
            sub.add_argument(spec.flag, dest=spec.env, metavar="VALUE",
                             help=f"{spec.doc} [{spec.env}, default {spec.default!r}]")
    for name, (module, text) in TOOLS.items():
        sub = commands.add_parser(name, help=text)
        if name in argv[:1]:  # only the tool asked for is imported
            importlib.import_module(module).configure(sub)
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    flags = {spec.env: getattr(args, spec.env) for spec in SPECS
             if getattr(args, spec.env) is not None}
    return load_settings(env_file=args.env_file, overrides=flags)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if args.command in TOOLS:
        return int(importlib.import_module(TOOLS[args.command][0]).run(args))
    try:
        settings = settings_from(args)
    except ConfigError as error:
        print(f"vega: {error}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "config":
        try:
            for spec in SPECS:
                value = settings.public()[spec.name]
                shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
                print(f"{spec.env}={str(shown).lower() if isinstance(shown, bool) else shown}")
            sys.stdout.flush()
        except BrokenPipeError:  # `vega config | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return serve(settings)


def serve(settings: Settings) -> int:
    from vega.models.loader import ModelLoadError
    from vega.server import create_app
    from vega.transport import OneWriteProtocol

    # An executor thread needs the GIL back from the event loop after each torch call
    # and waits up to the switch interval for it (5 ms by default); the loop is asked to
    # yield only while a thread is waiting (docs/tuning.md has the measurements).
    sys.setswitchinterval(0.0001)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    warn_oversubscribed(settings)
    # Checked before the model is built: a start that cannot listen fails in a second.
    why = uds_unusable(settings.uds) if settings.uds else port_unusable(settings.host,
                                                                          settings.port)
    if why is not None:
        where = f"VEGA_UDS={settings.uds}" if settings.uds else \
            f"VEGA_HOST={settings.host} VEGA_PORT={settings.port}"
        print(f"vega: {where}: {why}", file=sys.stderr)
        return EXIT_STARTUP
    log.info("building the model(s) %s: it listens once they are built", settings.model)
    try:
        app, runtime = create_app(settings)
    except ModelLoadError as error:
        print(f"vega: {error}", file=sys.stderr)
        return EXIT_STARTUP
    options: dict[str, Any] = {"uds": settings.uds} if settings.uds else {
        "host": settings.host, "port": settings.port}
    # uvicorn's lines in the server's format (log_config=None), its floods thinned.
    config = uvicorn.Config(app, loop="uvloop", http=OneWriteProtocol, lifespan="on",
                            access_log=settings.access_log, log_level=settings.log_level,
                            log_config=None, timeout_keep_alive=75, proxy_headers=False,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, **options)
    logging.getLogger("uvicorn.error").addFilter(Repeats())
    server = DrainingServer(config, runtime)
    server.run()
    code = EXIT_STARTUP if not server.started or runtime.failed is not None else 0
    if runtime.failed is not None:  # the log has it too; this is the line an operator reads
        print(f"vega: {runtime.failed}", file=sys.stderr)
    if runtime.executor.hung:  # the interpreter would wait for its thread at exit
        log.warning("a model thread is still in a batch (a hung model): exiting without it")
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


def warn_oversubscribed(settings: Settings) -> None:
    """A torch thread count past the machine's CPUs is accepted (a container may be given
    more later) but costs much: at 256 threads on 2 CPUs a batch took 29x as long."""
    cpus = os.cpu_count() or 1
    if settings.torch_threads > cpus:
        log.warning("VEGA_TORCH_THREADS=%d is more than the %d CPUs here: each batch's "
                    "threads wait for each other (1 a process is the default)",
                    settings.torch_threads, cpus)


# Collect the youngest generation after this many net new container objects, not 700:
# a waiting request holds a few hundred and they die by reference count, so the default
# ran hundreds of collections under load that held the GIL and freed nothing. Cycles are
# still found; a young generation of 10,000 takes a few ms.
YOUNG_COLLECTION_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once warm: keep the collector to what requests leave behind.

    What exists now (torch, the model, ~200k objects) lives as long as the process, so
    it leaves the collector's view: every collection rescanned it.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, but the first SIGTERM/SIGINT drains before exiting (exit 0).

    uvicorn would stop listening at once and re-raise the signal after shutdown;
    Vega first answers 503 ``draining`` (so Nginx moves new work elsewhere) while
    everything admitted finishes, bounded by VEGA_DRAIN_TIMEOUT_S. A second signal
    stops at once.
    """

    def __init__(self, config: uvicorn.Config, runtime: Runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._acceptors: list[BatchAcceptor] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.runtime.on_start.append(self._on_runtime_start)
        await super().startup(sockets)
        config = self.config

        def protocol() -> asyncio.Protocol:  # what uvicorn's own server makes
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state)
        self._acceptors = [BatchAcceptor(listener, protocol)
                           for server in self.servers for listener in server.sockets]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self._acceptors:
            await acceptor.close()
        await super().shutdown(sockets)

    def _on_runtime_start(self, error: BaseException | None) -> None:
        if error is None:
            settle_heap()
            notify_systemd("READY=1")  # systemd: only once the model is warm
        else:
            self.should_exit = True  # nothing to serve; exit status 3

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or not self.started:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        log.info("%s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        notify_systemd("STOPPING=1")
        task = asyncio.ensure_future(self.runtime.drain())
        task.add_done_callback(lambda _task: setattr(self, "should_exit", True))


def notify_systemd(message: str) -> None:
    """sd_notify without libsystemd: one datagram to $NOTIFY_SOCKET, if systemd set one."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as error:
            log.warning("sd_notify %s failed: %s", message, error)


if __name__ == "__main__":
    raise SystemExit(main())
