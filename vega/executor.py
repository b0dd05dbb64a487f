"""The executor: model code runs here, never on the event loop.

``thread``: each batch is handed to a worker thread, which runs it on the model adapter
itself (collate, pad, forward and split in this process); then the loop is woken once
(one ``call_soon_threadsafe``) to resolve all the batch's futures. ``process``: the loop
itself packs each batch into a free lane of a model process (shared memory, see
``vega.modelproc``) and resolves the futures when the child's answer turns the pipe
readable; no thread of this process wakes for a batch, so none contends with the loop
for the GIL. Each process has two lanes, so the batch formed ahead waits in the child;
more wait here, in order. A model that raises fails only that batch's items; a model
process that dies fails only the batches it held.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import uvloop

from vega.buckets import length_bounds
from vega.config import Settings
from vega.errors import VegaError, drain_ran_out
from vega.modelproc import ModelProcess, ProcessPlan
from vega.modelproc.affinity import keep_off
from vega.modelproc.handle import Answered, Lane
from vega.modelproc.slot import ALIGN
from vega.models import ModelAdapter, adopt, holds_the_gil, identity, min_length, release
from vega.models.loader import ModelLoadError
from vega.quarantine import Quarantine
from vega.records import JOB, Batch
from vega.settle import Settler

STOP_WAIT_S = 2.0  # at a stop, how long a batch still running may take to end

log = logging.getLogger("vega.executor")


def pick_device(setting: str) -> str:
    """Resolve ``auto`` to cuda when torch sees a GPU."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def process_plan(s: Settings, adapters: Sequence[ModelAdapter],
                 specs: tuple[tuple[str, str], ...] | None) -> ProcessPlan | None:
    """How model processes are started, or None to run the models in threads.

    ``auto`` picks a process for an eager torch module or a compiled package, whose
    forward pass would otherwise contend with the loop for the GIL (docs/executor.md),
    and a thread for TorchScript and other adapters. A process rebuilds the models from
    their specs and takes their samples through shared memory, so both must be there.
    """
    # Not holds_the_gil: an eager module, which it counts too, lets the loop in between calls.
    if s.executor == "thread" and any(getattr(a, "holds_gil", False) for a in adapters):
        log.warning("VEGA_EXECUTOR=thread: a compiled package holds the GIL for each whole "
                    "forward pass, stalling the event loop meanwhile; auto runs it in a process")
    if s.executor == "thread" or (s.executor == "auto" and (
            specs is None or not any(holds_the_gil(adapter) for adapter in adapters))):
        if s.model_cpus:
            log.warning("VEGA_MODEL_CPUS pins model processes, and these models run in "
                        "threads (VEGA_EXECUTOR=%s): it pins nothing", s.executor)
        return None
    if specs is None:
        raise ModelLoadError("VEGA_EXECUTOR=process needs models given by VEGA_MODEL specs")
    widest = 0
    for adapter in adapters:
        sample = adapter.example(adapter.max_length)
        if not isinstance(sample, np.ndarray):
            raise ModelLoadError(f"VEGA_EXECUTOR=process: model {adapter.name!r} decodes to "
                                 f"{type(sample).__name__}, not numpy arrays")
        widest = max(widest, sample.nbytes)
    slot_bytes = max(1 << 20, s.max_batch_size * (widest + ALIGN))
    warm = tuple((a.name, bound, size) for a in adapters
                 for bound in length_bounds(s.length_buckets, a.max_length, min_length(a))
                 for size in sorted({1, s.max_batch_size}))
    return ProcessPlan(specs=specs, device=s.device, torch_threads=s.torch_threads,
                       slot_bytes=slot_bytes, timeout_s=s.model_timeout_s, warm_shapes=warm,
                       cpus=s.model_cpus, start_timeout_s=s.model_start_timeout_s)


class InThread:
    """Runs batches in the calling thread, on the adapters themselves."""

    def __init__(self, models: Mapping[str, ModelAdapter]) -> None:
        self.models = models

    def run(self, model: str, samples: list[Any], pad_to: int) -> tuple[list[Any], float]:
        """The batch's outputs, and the seconds it held the model."""
        started = time.perf_counter()
        outputs = self.models[model].run(samples, pad_to)
        return outputs, time.perf_counter() - started


@dataclass(eq=False)  # taken from the waiting line by identity
class _Job:
    """Work for a model process's lane, waiting for one to free."""

    model: str
    samples: list[Any]
    pad_to: int
    answered: Answered
    batch: Batch | None = None  # the served batch it runs; None: warm-up, profiling

    @property
    def alone(self) -> bool:  # sent only to a model process holding no other batch
        return self.batch is not None and self.batch.alone

    @property
    def of_jobs(self) -> bool:  # waits while inline work does (its suspects alone too)
        return self.batch is not None and self.batch.items[0].priority == JOB


class Executor:
    """``threads`` models running batches at once: in worker threads, or with a ``plan``,
    in that many model processes, driven from the loop that ``bind`` names or ``run`` is
    first called on (``run_sync`` from a thread queues onto it: warm-up, ``vega profile``)."""

    def __init__(self, models: Mapping[str, ModelAdapter], threads: int = 1,
                 torch_threads: int = 0, plan: ProcessPlan | None = None) -> None:
        self.models = dict(models)
        self._torch_threads = torch_threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vega-exec",
                                        initializer=self._init_thread)
        self._workers: list[threading.Thread] = []  # the pool's, as each starts
        self._running = 0
        # Batches handed to the pool and not begun: a stop answers them (the pool drops them).
        self._queued: dict[Batch, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self.threads = threads
        self.busy_s = 0.0  # time the models spent on batches so far (utilisation = its rate)
        self._lock = threading.Lock()
        self.kind = "thread" if plan is None else "process"
        self._plan = plan
        self.processes: list[ModelProcess] = []
        # Without a plan, a runner per thread: a batch takes one and gives it back.
        self._runners: queue.SimpleQueue[InThread] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None  # driving the model processes
        self._free: list[Lane] = []  # lanes of the model processes with no batch in them
        self._waiting: deque[_Job] = deque()
        self._alone_in: set[ModelProcess] = set()  # running a batch to itself (Batch.alone)
        # Inputs that took a model process down (only model processes go down alone).
        self.quarantine = Quarantine()
        self._settler = Settler(self.run, self.quarantine)  # answers items, or runs parts
        if plan is None:
            in_thread = InThread(self.models)
            for _ in range(threads):
                self._runners.put(in_thread)
        else:
            for adapter in self.models.values():
                release(adapter)  # a copy of the weights per model process is enough

    def load(self, device: str) -> None:
        """Put the models on ``device`` (blocking): here, or in freshly started model processes."""
        if self._plan is None:
            for adapter in self.models.values():
                self._pool.submit(adapter.load, device).result()
            return
        plan = dataclasses.replace(self._plan, device=device)
        if plan.cpus:
            mine = keep_off(plan.cpus)
            log.info("model processes on CPU(s) %s, this process on %s",
                     ",".join(map(str, plan.cpus)), ",".join(map(str, sorted(mine))))
        for index in range(self.threads):
            process = ModelProcess(plan, index)
            self.processes.append(process)
            process.start()
            if index == 0:  # what it built is what this process serves, and every later start
                plan = dataclasses.replace(plan, identities=self._adopt_identities(
                    process.built.get("identities") or {}))
                process.plan = plan
                self._adopt_output_shapes(process.built.get("outputs") or {})
            self._free.extend(process.lanes)

    def _adopt_identities(self, built: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
        """The identities a model process started later, or again, must have built, or it
        is not used (a model file changed on disk). A model the first model process built
        otherwise than this process draws its weights (no seed): its copy is served under
        its identity, and each start draws again, so that model is not checked."""
        checked = []
        for name, adapter in self.models.items():
            known = built.get(name, identity(adapter))
            if known == identity(adapter):
                checked.append((name, known))
                continue
            log.warning("model %s: the model process built other weights or code than this "
                        "process (drawn without a seed?): serving its own, identity %s; a "
                        "restarted model process draws again", name, known)
            adopt(adapter, known)
        return tuple(checked)

    def _adopt_output_shapes(self, shapes: Mapping[str, list[list[int]]]) -> None:
        """The output shapes the model processes found (one row per step?), for metadata."""
        for name, model_shapes in shapes.items():
            adapter = self.models.get(name)
            if adapter is not None and len(model_shapes) == len(adapter.outputs):
                adapter.outputs = tuple(
                    dataclasses.replace(spec, shape=tuple(int(n) for n in shape))
                    for spec, shape in zip(adapter.outputs, model_shapes))

    @property
    def available(self) -> bool:
        """False while no model process is up to run a batch (one is restarting)."""
        return self._plan is None or any(process.up for process in self.processes)

    @property
    def restarts(self) -> int:
        return sum(process.restarts for process in self.processes)

    @property
    def exits(self) -> int:
        """Model process lives ended unasked, counted as they end (restarts once warm)."""
        return sum(process.exits for process in self.processes)

    def warm(self) -> None:
        """Warm-up ran: start the standbys (their imports would slow its timed passes)."""
        for process in self.processes:
            process.standby.arm()

    def _init_thread(self) -> None:
        self._workers.append(threading.current_thread())
        if self._torch_threads:
            import torch

            torch.set_num_threads(self._torch_threads)

    @property
    def busy(self) -> int:
        """Batches handed to the models right now: running, or (in a model process's
        second lane) sent to wait behind the running one."""
        return self._running

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run any blocking model work (loading, warm-up) on the executor threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Drive the model processes from ``loop`` from now on (call on it, after ``load``)."""
        if self._plan is not None:
            self._loop = loop

    def run(self, batch: Batch) -> asyncio.Future[None]:
        """Run ``batch``; the returned future settles as it ends, with its items' futures,
        except a failed batch's that runs again in parts (vega.settle): settled later."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        # In a thread too: an input that took a peer's model process down would take all
        # of this process down.
        if self.quarantine and self._settler.held_back(batch, done):
            return done
        if self._plan is None:
            with self._lock:
                self._queued[batch] = (loop, done)
            try:
                self._pool.submit(self._work, loop, batch, done)
            except RuntimeError:  # stopped: the pool takes nothing more
                self._never_run([batch])
            return done
        if self._loop is None:
            self.bind(loop)
        samples = [item.sample for item in batch.items]
        self._waiting.append(_Job(batch.model, samples, batch.pad_to,
                                  partial(self._ran, batch, done), batch))
        self._feed()
        return done

    def _feed(self) -> None:
        """Send waiting work to free lanes, those of a model process that is up first. A
        job to run alone waits for an empty model process, and holds it to itself."""
        up = any(process.up for process in self.processes)
        while self._waiting and self._free:
            job = next((job for job in self._waiting if not job.of_jobs), self._waiting[0])
            if job.batch is not None and not any(item.live for item in job.batch.items):
                self._waiting.remove(job)  # its callers left while it waited: not run
                asyncio.get_running_loop().call_soon(job.answered, None, 0.0, time.monotonic(),
                                                     VegaError("not_ready", "callers left"))
                continue
            # A restarting process's lane fails a batch at once (503): only while none is up.
            lanes = [free for free in self._free if free.process not in self._alone_in
                     and (free.process.up or not up)
                     and not (job.alone and free.process.in_child)]
            if not lanes:
                return  # until a batch ends in a process that is up (every end feeds again)
            lane = min(lanes, key=lambda free: (not free.process.up, free.process.in_child))
            self._free.remove(lane)
            self._waiting.remove(job)
            if job.alone:
                self._alone_in.add(lane.process)
            self._running += 1
            answered = partial(self._answered, lane, job)
            try:
                lane.process.submit(lane.index, job.model, job.samples, job.pad_to, answered)
            except Exception as exc:  # not sent: not up, or samples that cannot cross
                # Failed on the next turn, as a sent batch is: never inside run().
                asyncio.get_running_loop().call_soon(answered, None, 0.0, time.monotonic(), exc)

    def _answered(self, lane: Lane, job: _Job, outputs: list[Any] | None, held_s: float,
                  ended_at: float, error: BaseException | None) -> None:
        self._free.append(lane)
        self._running -= 1
        if job.alone:
            self._alone_in.discard(lane.process)
        self._feed()  # the next batch into the child before this one's answers are written
        job.answered(outputs, held_s, ended_at, error)

    def _ran(self, batch: Batch, done: asyncio.Future[None], outputs: list[Any] | None,
             held_s: float, ended_at: float, error: BaseException | None) -> None:
        batch.ended_at = ended_at
        self.busy_s += held_s
        miscount = None if outputs is None else _miscount(outputs, batch.size)
        if miscount is not None:
            error, outputs = miscount, None
        if error is None:  # a failed batch's time is no batch time to predict from
            batch.infer_s = held_s
        self._settler.ended(batch, outputs, error, done)

    def _work(self, loop: asyncio.AbstractEventLoop, batch: Batch,
              done: asyncio.Future[None]) -> None:
        with self._lock:
            if self._queued.pop(batch, None) is None:
                return  # answered by a stop before it began
            self._running += 1
        outputs: list[Any] | None = None
        error: BaseException | None = None
        began = time.perf_counter()
        held_s = 0.0
        runner = self._runners.get()
        try:
            outputs, held_s = runner.run(
                batch.model, [item.sample for item in batch.items], batch.pad_to)
            miscount = _miscount(outputs, batch.size)
            if miscount is not None:
                raise miscount
            batch.infer_s = held_s  # as in _ran: only a batch that ran trains the predictor
        except Exception as exc:  # the model's failure is this batch's alone
            error = exc
        finally:
            batch.ended_at = time.monotonic()
            self._runners.put(runner)
            with self._lock:
                self._running -= 1
                self.busy_s += held_s or time.perf_counter() - began
        try:
            loop.call_soon_threadsafe(self._settler.ended, batch, outputs, error, done)
        except RuntimeError:  # the loop closed during shutdown; nobody is waiting
            pass

    def run_sync(self, model: str, samples: list[Any], pad_to: int) -> tuple[list[Any], float]:
        """Run and wait (warm-up, profiling; not on the loop); return outputs and seconds. A
        model process's batch goes through the loop that ``bind`` named, as served ones do."""
        loop = self._loop
        if loop is not None:  # the loop drives the model processes: queue it there
            result: concurrent.futures.Future[tuple[list[Any], float]] = \
                concurrent.futures.Future()

            def answered(outputs: list[Any] | None, held_s: float, _ended_at: float,
                         error: BaseException | None) -> None:
                if error is not None or outputs is None:
                    result.set_exception(error or RuntimeError("no outputs"))
                else:
                    result.set_result((outputs, held_s))

            def enqueue() -> None:
                self._waiting.append(_Job(model, samples, pad_to, answered))
                self._feed()

            loop.call_soon_threadsafe(enqueue)
            return result.result()
        if self._plan is not None:
            raise RuntimeError("model processes are driven from an event loop: bind one first")
        runner = self._runners.get()
        try:
            return runner.run(model, samples, pad_to)
        finally:
            self._runners.put(runner)

    async def stop(self) -> None:
        """``shutdown`` from the loop: the model processes' pipes are let go of here first
        (``ModelProcess.stop_reading``), then the threads and processes end in a thread."""
        waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:  # never sent to a model process: answered as never begun
            job.answered(None, 0.0, time.monotonic(), drain_ran_out())
        for process in self.processes:
            process.stop_reading()
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def shutdown(self) -> None:
        """End the threads and model processes, waiting STOP_WAIT_S at most for a batch
        still running: a thread still in one after that (a hung model) is left behind
        (``hung``), and the server exits without it. A batch queued for a thread and not
        begun is answered as never begun (503 draining)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            queued = list(self._queued)
        self._never_run(queued)
        end = time.monotonic() + STOP_WAIT_S
        for process in self.processes:  # first: a thread waiting on one is let go
            process.close(grace_s=max(0.0, end - time.monotonic()))
        for worker in self._workers:
            worker.join(max(0.0, end - time.monotonic()))

    def _never_run(self, batches: list[Batch]) -> None:
        """Answer ``batches`` as never begun, on their loop, unless a thread began them."""
        for batch in batches:
            with self._lock:
                claimed = self._queued.pop(batch, None)
            if claimed is None:
                continue
            loop, done = claimed
            try:
                loop.call_soon_threadsafe(self._settler.ended, batch, None, drain_ran_out(), done)
            except RuntimeError:  # the loop closed during shutdown; nobody is waiting
                pass

    @property
    def hung(self) -> bool:
        """A worker thread is still in a batch after ``shutdown``."""
        return any(worker.is_alive() for worker in self._workers)


@contextlib.contextmanager
def driven(executor: Executor) -> Iterator[Executor]:
    """``executor`` driven from a uvloop, as `vega serve` drives it, run in a helper thread
    for a caller with none (``vega profile``): ``run_sync`` queues onto it as warm-up does.
    Leaving, even on an error or Ctrl-C, stops the executor there, then the loop and thread."""
    loop = uvloop.new_event_loop()
    executor.bind(loop)  # before the loop runs anything: no other thread reads it yet
    thread = threading.Thread(target=loop.run_forever, name="vega-loop", daemon=True)
    thread.start()
    try:
        yield executor
    finally:
        try:
            asyncio.run_coroutine_threadsafe(executor.stop(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


def _miscount(outputs: list[Any], size: int) -> RuntimeError | None:
    """The error for a model that gave other than one output an input, else None."""
    if len(outputs) == size:
        return None
    return RuntimeError(f"{len(outputs)} outputs for {size} inputs")
