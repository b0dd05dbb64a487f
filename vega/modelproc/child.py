"""The model process's own loop: load the models, then answer batches until the pipe closes.

Started as ``python -m vega.modelproc FD SLOT_FD``, so it shares nothing with
the parent but a socket (FD) and the shared-memory slot (SLOT_FD, a memfd); the first
message on the socket is its configuration: the model specs, the device and threads. It
then imports torch and waits for the second, GO, before building the models (a standby
waits there until a restart needs it; see spawn.py).
Each request is a header (orjson) naming the model, ``pad_to``, the slot (one of
``lanes``) and the samples' layout in it; the answer is a header with the outputs'
layout, written over the samples, or carried in the message when they do not fit.
Requests are answered in the order they came. A model that raises
answers an error for that batch and the process goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import orjson

from vega import LOG_FORMAT
from vega.modelproc import slot
from vega.modelproc.affinity import pin_process
from vega.models.digest import identity

log = logging.getLogger("vega.modelproc")
SAID_CHARS = 1000  # of a model's error message, in a reply and in the log
GO = b"go"  # the parent's second message: build the models now (see spawn.py)


@dataclass(frozen=True)
class ChildConfig:
    specs: tuple[tuple[str, str], ...]  # (VEGA_MODEL-style spec, served name) per model
    device: str
    torch_threads: int
    slot_bytes: int
    lanes: int = 1  # slots in the shared memory, slot_bytes each
    warm_shapes: tuple[tuple[str, int, int], ...] = ()  # (model, length, size) untimed passes
    cpus: tuple[int, ...] = ()  # run only on these (VEGA_MODEL_CPUS); empty = anywhere
    log_level: int = logging.INFO  # the serving process's (VEGA_LOG_LEVEL)
    parent: int = 0  # the serving process's pid: this one exits when it is gone


def main(argv: list[str]) -> int:
    """Entry point of the child process."""
    # The parent drains on SIGTERM and Ctrl-C and closes this process when done; a
    # signal meant for the service must not take the model away from admitted work.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    raw = orjson.loads(conn.recv_bytes())
    config = ChildConfig(**{**raw, "specs": tuple(tuple(s) for s in raw["specs"]),
                            "warm_shapes": tuple(tuple(w) for w in raw["warm_shapes"]),
                            "cpus": tuple(raw["cpus"])})
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    if config.parent:
        _exit_with(config.parent)
    if config.cpus:
        pin_process(config.cpus)  # before torch starts its threads
    memory = memoryview(mmap.mmap(int(argv[1]), config.slot_bytes * config.lanes))
    slots = [memory[k * config.slot_bytes:(k + 1) * config.slot_bytes]  # freed at exit
             for k in range(config.lanes)]
    _import_torch()
    try:
        if conn.recv_bytes() != GO:  # a standby waits here until its life is needed
            return 1
    except (EOFError, ConnectionResetError):
        return 0  # closed while waiting: the server stopped, or this life was not needed
    try:
        models = _load(config)
    except Exception as error:  # a model that cannot load: say why, then exit
        conn.send_bytes(orjson.dumps({"ready": False, "error": said(error)}))
        return 1
    # What loading found of each model's outputs (one row per step or not), for the
    # serving process's metadata: it never runs the models itself.
    outputs = {name: [list(spec.shape) for spec in adapter.outputs]
               for name, adapter in models.items()}
    # What it built, which the serving process compares with what it advertises (peers and
    # the response cache key on it): a model file overwritten since then is another model.
    identities = {name: identity(adapter) for name, adapter in models.items()}
    conn.send_bytes(orjson.dumps({"ready": True, "pid": os.getpid(), "outputs": outputs,
                                  "identities": identities}))
    serve(models, slots, conn)
    return 0


def encode_config(config: ChildConfig) -> bytes:
    return orjson.dumps(dataclasses.asdict(config))


def changed(expected: tuple[tuple[str, str], ...], hello: dict[str, Any]) -> str | None:
    """Why a child that built models other than ``expected`` ((name, identity) pairs, what
    the serving process advertises) must not serve, or None when it built the same."""
    built = hello.get("identities") or {}
    for name, known in expected:
        if built.get(name) != known:
            return (f"model {name!r} is not the one this process serves (identity {known}, "
                    f"built now {built.get(name)}): it changed on disk? Restart the process "
                    "to serve it")
    return None


def _exit_with(parent: int) -> None:
    """Exit as soon as the serving process is gone (killed, say): the pipe's end is read
    only between batches, and a batch that never ends would keep this process, its memory
    and its device for as long as it hangs. A pidfd turns readable when it exits."""
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:  # gone before we looked
        os._exit(1)
    except OSError as error:  # no pidfds (Linux < 5.3): its pipe's end alone stops it
        log.warning("model process: cannot watch the serving process: %s", error)
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="vega-parent-watch", daemon=True).start()


def _import_torch() -> None:
    """The slow part of a start (about a second on a CPU), done before GO."""
    import torch  # noqa: F401

    import vega.models  # noqa: F401


def _load(config: ChildConfig) -> dict[str, Any]:
    import torch

    from vega.models import load_model

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    models = {}
    for spec, name in config.specs:
        adapter = load_model(spec, name)
        identity(adapter)  # as built, as the serving process has it: on the CPU, unscripted
        adapter.load(config.device)
        models[adapter.name] = adapter
    for name, length, size in config.warm_shapes:
        adapter = models[name]
        adapter.run([adapter.example(length)] * size, length)
    return models


def serve(models: dict[str, Any], slots: list[memoryview], conn: Connection) -> None:
    while True:
        try:
            request = orjson.loads(conn.recv_bytes())
        except (EOFError, ConnectionResetError):
            return  # the parent closed the pipe, or died (reset: with our answer unread)
        started = time.perf_counter()
        try:
            adapter = models[request["model"]]
            buffer = slots[int(request["slot"])]
            samples = slot.unpack(buffer, request, copy=False)
            outputs = adapter.run(samples, int(request["pad_to"]))
            del samples  # views into the slot, about to be overwritten
            outputs = [_as_array(output) for output in outputs]
            infer_s = time.perf_counter() - started
            # When it ended on the host's monotonic clock, which the parent's loop reads too.
            done = {"ok": True, "infer_s": infer_s, "ended_at": time.monotonic()}
            try:
                header = slot.pack(buffer, outputs)
                conn.send_bytes(orjson.dumps({**done, **header}))
            except slot.SlotOverflow:
                payload = bytearray(sum(o.nbytes for o in outputs) + slot.ALIGN * len(outputs))
                header = slot.pack(memoryview(payload), outputs)
                conn.send_bytes(orjson.dumps({**done, "inline": True, **header}))
                conn.send_bytes(payload[: slot.nbytes(header)])
        except (BrokenPipeError, ConnectionResetError):
            return  # the parent died while the batch ran: nobody left to answer
        except Exception as error:  # the model's failure is this batch's alone (the parent logs it)
            log.debug("model %s raised: %s", request.get("model"), said(error))
            conn.send_bytes(orjson.dumps({
                "ok": False, "infer_s": time.perf_counter() - started,
                "ended_at": time.monotonic(), "error": said(error)}))


def said(error: BaseException) -> str:
    """``Type: message``, cut to SAID_CHARS: a message may quote the whole input, and the
    parent reads a reply whole in one turn of its loop."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= SAID_CHARS else text[:SAID_CHARS] + "... (cut)"


def _as_array(output: Any) -> Any:
    import numpy as np

    array = np.asarray(output, order="C")  # not ascontiguousarray: a scalar stays 0-d
    if array.dtype.kind not in "biuf":
        raise TypeError(f"model output of dtype {array.dtype} cannot leave a model process")
    return array
