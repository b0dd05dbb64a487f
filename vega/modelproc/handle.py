"""The parent's side of one model process: start it, run batches on it, restart it.

A handle has ``lanes`` shared-memory slots (``ModelProcess.lanes``). A batch is packed
into a free lane's slot and its header sent down the pipe; the child answers in the
order it was sent. With two lanes the batch formed ahead is already in the child's pipe
when the running one ends, so the child goes from one forward pass to the next without
waiting on the parent.

It is driven from the event loop (``submit``): the loop packs, sends, and reads the
answers when the pipe turns readable, so no thread wakes for a batch; work from a thread
(warm-up, ``vega profile``) is queued onto that loop by the executor. A child that dies or
runs past ``timeout_s`` fails the batches it held; the handle then restarts it in the
background with backoff and is unavailable until it is warm.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import orjson

from vega.errors import VegaError
from vega.modelproc import slot
from vega.modelproc.child import GO, ChildConfig, changed
from vega.modelproc.spawn import Child, Standby, ended, exit_status, start_child, stop_child

log = logging.getLogger("vega.modelproc")

BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
STABLE_AFTER_S = 60.0  # a child that lived this long resets the backoff
STABLE_AFTER_BATCHES = 16  # ... or answered this many batches
EXIT_WAIT_S = 0.2  # at a child's loss, how long the loop waits for its exit status
INLINE_WAIT_S = 10  # the longest one recv of a payload being written may block (SO_RCVTIMEO)


def _read_whole(reader: Connection) -> bytes:
    """An inline payload read to its end, blocking while the child writes it (a copy; each
    recv at most INLINE_WAIT_S). The loop's reader does not block (uvloop makes it so), and a read
    of megabytes not all written yet failed half-way, taken for the child's death."""
    fd = reader.fileno()
    os.set_blocking(fd, True)
    try:
        return reader.recv_bytes()
    finally:
        os.set_blocking(fd, False)


def _blame(error: BaseException) -> bool | None:
    """Whether a read or write that failed with ``error`` blames the running batch: None
    (as its exit status says) for a closed pipe, the child exiting; False otherwise (a
    payload slow to come), as the child may live."""
    return None if isinstance(error, (EOFError, ConnectionResetError, BrokenPipeError)) \
        else False


class ModelProcessError(RuntimeError):
    """The model process died, hung or could not start; the message says which.
    ``suspect``: it died or hung running the batch this error fails, not killed from
    outside (the kernel's OOM killer, an operator), so that batch's inputs may be why."""

    def __init__(self, message: str, suspect: bool = False) -> None:
        super().__init__(message)
        self.suspect = suspect


class ModelRaised(Exception):
    """The model raised in its process: the child's report, "Type: message"."""

    @property
    def kind(self) -> str:
        """The type of what the model raised (what a caller's model_error names)."""
        return str(self).partition(":")[0] or "Exception"


@dataclass(frozen=True)
class ProcessPlan:
    """What a model process is started with (one per executor thread)."""

    specs: tuple[tuple[str, str], ...]
    device: str
    torch_threads: int
    slot_bytes: int
    timeout_s: float  # a batch running longer is taken to hang
    start_timeout_s: float = 300.0  # VEGA_MODEL_START_TIMEOUT_S
    warm_shapes: tuple[tuple[str, int, int], ...] = ()  # run after a restart, before ready
    cpus: tuple[int, ...] = ()  # VEGA_MODEL_CPUS: where the child runs; empty = anywhere
    lanes: int = 2  # batches the child may hold at once: one running, one waiting in its pipe
    identities: tuple[tuple[str, str], ...] = ()  # (model, identity()) a child must have built


# Called on the loop with a batch's outputs, the seconds it held the child and when it ended
# (time.monotonic()), or its error.
Answered = Callable[[list[Any] | None, float, float, BaseException | None], None]


@dataclass
class _Sent:
    """A batch sent from the loop, not answered yet."""

    lane: int
    answered: Answered
    sent_at: float


@dataclass
class _Life:
    """One life of the child: its pipe, and the batches it holds."""

    process: subprocess.Popen[bytes]
    conn: Connection
    answered_at: float = 0.0  # perf_counter when the last answer was read
    served: int = 0  # batches it answered with outputs
    # From its first batch on: the pipe's reading end on the loop (a dup, so that the
    # watcher thread closing ``conn`` never closes an fd the loop's selector holds), the
    # batches in the child in sending order, and the timer on the oldest.
    reader: Connection | None = None
    loop: asyncio.AbstractEventLoop | None = None
    in_child: deque[_Sent] = field(default_factory=deque)
    timer: asyncio.TimerHandle | None = None


class ModelProcess:
    def __init__(self, plan: ProcessPlan, index: int = 0) -> None:
        self.plan = plan
        self.index = index
        self.restarts = 0
        self.exits = 0  # lives that ended unasked (died, hung, killed), counted as they end
        self.pid: int | None = None
        # What the child found loading its models, by name: "outputs" (shapes), "identities".
        self.built: dict[str, Any] = {}
        # A memfd: no name to leak, freed once both processes have closed it.
        self._slot_fd = os.memfd_create(f"vega-slot-{index}")
        os.ftruncate(self._slot_fd, plan.slot_bytes * plan.lanes)
        self._mmap = mmap.mmap(self._slot_fd, plan.slot_bytes * plan.lanes)
        self._buffer = memoryview(self._mmap)
        self._slots = [self._buffer[k * plan.slot_bytes:(k + 1) * plan.slot_bytes]
                       for k in range(plan.lanes)]
        self.lanes = [Lane(self, k) for k in range(plan.lanes)]
        self._life: _Life | None = None
        self._send_lock = threading.Lock()  # the loop sends, the watcher closes: one at a time
        self._up = threading.Event()
        self._closed = False
        self._started_at = 0.0
        self._failures = 0  # consecutive failed lives, for the backoff
        self.standby = Standby(lambda: start_child(self._config(restart=True), self._slot_fd))

    @property
    def up(self) -> bool:
        """True while a warm child is there to run batches."""
        return self._up.is_set()

    def start(self) -> None:
        """Start the child and wait until its models are loaded (raises ModelProcessError)."""
        self._spawn(restart=False)

    def _pack(self, lane: int, model: str, samples: list[Any], pad_to: int) -> bytes:
        """Write the samples into slot ``lane``; the header that sends them to the child."""
        header = slot.pack(self._slots[lane], samples)
        return orjson.dumps({"model": model, "pad_to": pad_to, "slot": lane, **header})

    def submit(self, lane: int, model: str, samples: list[Any], pad_to: int,
               answered: Answered) -> None:
        """Send one batch through slot ``lane`` from the running loop; ``answered`` is
        called on the loop once the child answers or fails it (never before this returns).

        Raises VegaError(not_ready) while the child restarts or once its pipe is gone, and
        the slot's errors for samples that cannot cross (nothing was sent, either way)."""
        life = self._life
        if self._up.is_set() and life is not None and life.loop is None:
            self._attach(life, asyncio.get_running_loop())  # this life's first batch
        # (A life lost to the loop has no reader; its watcher has not replaced it yet.)
        if not self._up.is_set() or life is None or life.reader is None:
            raise self._restarting()
        message = self._pack(lane, model, samples, pad_to)
        try:
            # A few hundred bytes, at most ``lanes`` unread: the socket buffer takes it
            # without blocking the loop.
            with self._send_lock:
                life.conn.send_bytes(message)
        except OSError as error:  # not sent, so not held: the caller fails it, _lost the rest
            asyncio.get_running_loop().call_soon(  # (its exit status says who is to blame)
                self._lost, life, f"died during a batch ({type(error).__name__})", None)
            raise self._restarting() from None
        life.in_child.append(_Sent(lane, answered, time.perf_counter()))
        if len(life.in_child) == 1:
            self._arm(life)

    @property
    def in_child(self) -> int:
        """Batches sent from the loop and not answered yet."""
        life = self._life
        return len(life.in_child) if life is not None else 0

    def _attach(self, life: _Life, loop: asyncio.AbstractEventLoop) -> None:
        life.loop = loop
        life.reader = Connection(os.dup(life.conn.fileno()), writable=False)
        with socket.socket(fileno=os.dup(life.reader.fileno())) as sock:  # see _read_whole
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                            struct.pack("ll", int(INLINE_WAIT_S), 0))
        loop.add_reader(life.reader.fileno(), self._readable, life)

    def _arm(self, life: _Life) -> None:
        assert life.loop is not None
        life.timer = life.loop.call_later(
            self.plan.timeout_s, self._lost, life,
            f"gave no answer within {self.plan.timeout_s:g} s", True)

    def _readable(self, life: _Life) -> None:
        # Every answer the child has written, not one: a turn of the loop under a flood of
        # cheap requests outlasts several batches, and an answer a turn would feed the
        # child a batch a turn (docs/executor.md).
        for _ in range(max(1, len(life.in_child))):  # what it held when the loop came
            if not self._answer(life):
                return
            reader = life.reader
            if reader is None or not life.in_child or not reader.poll(0):
                return

    def _answer(self, life: _Life) -> bool:
        """Read one answer and hand it over; False once this life is lost."""
        reader = life.reader
        if reader is None:
            return False  # lost within this turn of the loop
        if self._closed or not life.in_child:
            self._lost(life, "exited")  # EOF: it wrote nothing unasked
            return False
        try:
            reply = orjson.loads(reader.recv_bytes())
            # The child writes an inline payload right after its header.
            payload = _read_whole(reader) if reply.get("inline") else None
        except (EOFError, OSError) as gone:
            self._lost(life, f"died during a batch ({type(gone).__name__})", _blame(gone))
            return False
        now = time.perf_counter()
        sent = life.in_child.popleft()
        started = max(sent.sent_at, life.answered_at)  # it waited behind the one before
        life.answered_at = now
        if life.timer is not None:
            life.timer.cancel()
            life.timer = None
        if life.in_child:
            self._arm(life)
        outputs: list[Any] | None = None
        error: BaseException | None = None
        if not reply.get("ok"):
            error = ModelRaised(str(reply.get("error", "model failed")))
        else:
            try:
                buffer = self._slots[sent.lane] if payload is None else payload
                outputs = slot.unpack(buffer, reply, copy=True)
                life.served += 1
            except (slot.SlotOverflow, TypeError, KeyError, ValueError) as bad:
                error = bad
        # The child's own clock: read here, the time would also count how late the
        # loop came to the pipe, and the batch-time predictor would learn that lateness.
        held_s = reply.get("infer_s")
        if not isinstance(held_s, (int, float)) or held_s < 0:
            held_s = now - started
        ended_at = reply.get("ended_at")
        if not isinstance(ended_at, (int, float)):
            ended_at = time.monotonic()
        sent.answered(outputs, float(held_s), float(ended_at), error)
        return True

    def _lost(self, life: _Life, why: str, blame: bool | None = False) -> None:
        """This life of the child is over for the loop: fail what it held, stop reading.
        ``blame``: whether the batch it was running may be why (it hung: True); None: its
        pipe closed, so unless its exit status says it was killed from outside."""
        if life.reader is None:
            return  # already lost
        if life is self._life:
            self._up.clear()
        held = self._let_go(life)
        if blame is None and held:
            status = exit_status(life.process, EXIT_WAIT_S)
            blame, why = status != -signal.SIGKILL, why + ended(status)
        if life.process.poll() is None:
            life.process.kill()  # its watcher sees it go and restarts it
        if held:  # one that died idle is logged by its watcher
            log.error("model process %d (pid %s) %s", self.index, life.process.pid, why)
        for position, sent in enumerate(held):
            # The child runs its batches in the order sent: only the first had begun. The
            # one waiting behind it is refused as never run (503), and may be sent elsewhere.
            error = ModelProcessError(f"model process {why}", suspect=bool(blame)) \
                if position == 0 else self._restarting()
            sent.answered(None, 0.0, time.monotonic(), error)

    def stop_reading(self) -> None:
        """On the loop, before ``close``: stop reading the child's pipe there. The loop's
        dup of it would keep the pipe open after ``close`` closes ``conn``, so the child
        would never see its end and be killed after the grace period instead of exiting."""
        life = self._life
        if life is None or life.reader is None:
            return
        for sent in self._let_go(life):  # none, after a drain
            sent.answered(None, 0.0, time.monotonic(), ModelProcessError("server stopping"))

    def _let_go(self, life: _Life) -> list[_Sent]:
        """Stop reading ``life``'s pipe on the loop; the batches it held, taken from it."""
        assert life.loop is not None and life.reader is not None
        if life.timer is not None:
            life.timer.cancel()
        life.loop.remove_reader(life.reader.fileno())
        life.reader.close()
        life.reader = None  # a timer and the pipe's EOF may both report the one loss
        held, life.in_child = list(life.in_child), deque()
        return held

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the child and its standby (killed past ``grace_s``); free the slot."""
        self._closed = True
        self._up.clear()
        end = time.monotonic() + grace_s
        self._stop_child(grace_s=grace_s)
        self.standby.close(grace_s=max(0.0, end - time.monotonic()))
        for view in self._slots:
            view.release()
        self._buffer.release()
        self._mmap.close()
        os.close(self._slot_fd)

    # -- one life of the child -------------------------------------------------------

    def _config(self, restart: bool) -> ChildConfig:
        """A life's configuration: a restart warms itself up (the server warms the first)."""
        plan = self.plan
        return ChildConfig(specs=plan.specs, device=plan.device,
                           torch_threads=plan.torch_threads, slot_bytes=plan.slot_bytes,
                           lanes=plan.lanes, warm_shapes=plan.warm_shapes if restart else (),
                           cpus=plan.cpus, log_level=logging.getLogger().getEffectiveLevel(),
                           parent=os.getpid())

    def _spawn(self, restart: bool) -> None:
        """Start a life of the child (a restart takes the standby, torch imported)."""
        plan = self.plan
        child = self.standby.take() if restart \
            else start_child(self._config(restart=False), self._slot_fd)
        if child is None or self._closed:  # stopping: its shared memory may be freed
            if child is not None:
                stop_child(child, grace_s=0.0)
            raise ModelProcessError("stopping")
        process, conn = child.process, child.conn
        self._life = _Life(process, conn)
        # A build may take minutes: the log says what the process waits for meanwhile.
        log.info("model process %d (pid %d): building the model(s), %g s at most", self.index,
                 process.pid, plan.start_timeout_s)
        try:
            conn.send_bytes(GO)
            if not conn.poll(plan.start_timeout_s):
                raise ModelProcessError(f"model process did not load within "
                                        f"{plan.start_timeout_s:g} s")
            hello = orjson.loads(conn.recv_bytes())
        except (EOFError, OSError):  # its end of the pipe closed: it is exiting, or gone
            try:
                status: int | str | None = process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                status = "unknown (still running)"
            hello = {"ready": False, "error": f"exited with status {status}"}
        except ModelProcessError:
            self._stop_child(grace_s=0.0)
            raise
        why = changed(plan.identities, hello) if hello.get("ready") else str(hello.get("error"))
        if why is not None:
            self._stop_child(grace_s=1.0)
            raise ModelProcessError(f"model process failed to start: {why}")
        self.pid = process.pid
        self.built = hello
        self._started_at = time.monotonic()
        if restart:  # counted before it is seen up, so whoever sees it up sees the count
            self.restarts += 1
        self._up.set()
        log.info("model process %d ready (pid %d)", self.index, process.pid)
        threading.Thread(target=self._watch, args=(process,), daemon=True,
                         name=f"vega-model-{self.index}-watch").start()
        self.standby.refill()

    def _watch(self, process: subprocess.Popen[bytes]) -> None:
        """Wait for this life of the child to end; unless closing, start the next."""
        process.wait()
        self._up.clear()
        life = self._life
        if self._closed or life is None or process is not life.process:
            return
        self.exits += 1
        log.error("model process %d (pid %s) ended%s; restarting", self.index, process.pid,
                  ended(process.returncode))
        # A life that served is no crash loop: one input took it down, and every caller
        # waits out the backoff, so the next life starts at the shortest.
        if time.monotonic() - self._started_at > STABLE_AFTER_S or \
                life.served >= STABLE_AFTER_BATCHES:
            self._failures = 0
        self._stop_child(grace_s=0.0)
        while not self._closed:
            time.sleep(self._backoff_s())
            if self._closed:  # stopped during the backoff: no life to start, nothing to log
                return
            self._failures += 1
            try:
                self._spawn(restart=True)
            except (ModelProcessError, OSError) as error:  # OSError: out of fds, processes
                if self._closed:  # stopped while it started (its pipe closed under it)
                    return
                self.exits += 1  # a life that did not start ended too
                log.error("model process %d: %s; trying again", self.index, error)
                continue
            if self._closed:  # closed while this life was starting
                self._stop_child(grace_s=0.0)
            return

    def _backoff_s(self) -> float:
        return BACKOFF_S[min(self._failures, len(BACKOFF_S) - 1)]

    def _restarting(self) -> VegaError:
        """What a batch gets while no warm child is there: 503, retry after the backoff."""
        return VegaError("not_ready", "the model process is restarting",
                         retry_after_ms=1000.0 * self._backoff_s())

    def _stop_child(self, grace_s: float) -> None:
        life, self._life = self._life, None
        if life is None:
            return
        with self._send_lock:  # not while the loop sends on it: os.write(None) raised there
            life.conn.close()  # the child's recv sees EOF and it returns
        stop_child(Child(life.process, life.conn), grace_s)


class Lane:
    """One slot of a model process, which the executor hands one batch at a time."""

    def __init__(self, process: ModelProcess, index: int) -> None:
        self.process = process
        self.index = index
