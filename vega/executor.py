"""The executor: model code runs here, never on the event loop.

Each batch is handed to a worker thread, which runs it on a runner: the model
adapter itself (``thread``: collate, pad, forward and split in this process), or a
lane of a model process (``process``: the thread packs the batch into shared memory and
sleeps while a child runs it, see ``vega.modelproc``; each process has two lanes, so
the batch formed ahead waits in the child, not in this process). Then the loop is woken
once (one ``call_soon_threadsafe``) to resolve all the batch's futures. A model that raises
fails only that batch's items; a model process that dies fails only the batches it held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from vega.config import Settings, length_bounds
from vega.errors import VegaError
from vega.modelproc import ModelProcess, ProcessPlan
from vega.modelproc.affinity import keep_off
from vega.modelproc.slot import ALIGN
from vega.models import ModelAdapter, runs_eagerly
from vega.models.loader import ModelLoadError
from vega.records import Batch

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

    ``auto`` picks a process for an eager torch module, whose forward pass would
    otherwise contend with the loop for the GIL (DESIGN.md rule 12), and a thread for
    TorchScript and other adapters. A process rebuilds the models from their specs
    and takes their samples through shared memory, so both must be there.
    """
    eager = any(runs_eagerly(adapter) for adapter in adapters)
    if s.executor == "thread" or (s.executor == "auto" and (not eager or specs is None)):
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
    top = s.max_batch_size
    warm = tuple((adapter.name, bound, size) for adapter in adapters
                 for bound in length_bounds(s.length_buckets, adapter.max_length)
                 for size in sorted({1, top}))
    return ProcessPlan(specs=specs, device=s.device, torch_threads=s.torch_threads,
                       slot_bytes=slot_bytes, timeout_s=s.model_timeout_s, warm_shapes=warm,
                       cpus=s.model_cpus)


class Runner(Protocol):
    def run(self, model: str, samples: list[Any], pad_to: int) -> tuple[list[Any], float]:
        """The batch's outputs, and the seconds it held the model."""


class InThread:
    """Runs batches in the calling thread, on the adapters themselves."""

    def __init__(self, models: Mapping[str, ModelAdapter]) -> None:
        self.models = models

    def run(self, model: str, samples: list[Any], pad_to: int) -> tuple[list[Any], float]:
        started = time.perf_counter()
        outputs = self.models[model].run(samples, pad_to)
        return outputs, time.perf_counter() - started


class Executor:
    """``threads`` models running batches at once: in worker threads, or with a ``plan``,
    in that many model processes (each driven by a worker thread per lane)."""

    def __init__(self, models: Mapping[str, ModelAdapter], threads: int = 1,
                 torch_threads: int = 0, plan: ProcessPlan | None = None) -> None:
        self.models = dict(models)
        self._torch_threads = torch_threads
        workers = threads * (plan.lanes if plan is not None else 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vega-exec",
                                        initializer=self._init_thread)
        self._running = 0
        self.threads = threads
        self.busy_s = 0.0  # time the models spent on batches so far (utilisation = its rate)
        self._lock = threading.Lock()
        self.kind = "thread" if plan is None else "process"
        self._plan = plan
        self.processes: list[ModelProcess] = []
        # A runner per thread, or per lane of a model process: a batch takes one and
        # gives it back.
        self._runners: queue.SimpleQueue[Runner] = queue.SimpleQueue()
        if plan is None:
            in_thread = InThread(self.models)
            for _ in range(threads):
                self._runners.put(in_thread)

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
            for lane in process.lanes:
                self._runners.put(lane)

    @property
    def available(self) -> bool:
        """False while no model process is up to run a batch (one is restarting)."""
        return self._plan is None or any(process.up for process in self.processes)

    @property
    def restarts(self) -> int:
        return sum(process.restarts for process in self.processes)

    def _init_thread(self) -> None:
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

    def run(self, batch: Batch) -> asyncio.Future[None]:
        """Run ``batch``; the returned future and its items' futures are settled together."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._pool.submit(self._work, loop, batch, done)
        return done

    def _work(self, loop: asyncio.AbstractEventLoop, batch: Batch,
              done: asyncio.Future[None]) -> None:
        with self._lock:
            self._running += 1
        outputs: list[Any] | None = None
        error: BaseException | None = None
        began = time.perf_counter()
        runner = self._runners.get()
        try:
            outputs, batch.infer_s = runner.run(
                batch.model, [item.sample for item in batch.items], batch.pad_to)
            if len(outputs) != batch.size:
                raise RuntimeError(f"{len(outputs)} outputs for {batch.size} inputs")
        except Exception as exc:  # the model's failure is this batch's alone
            error = exc
        finally:
            self._runners.put(runner)
            with self._lock:
                self._running -= 1
                self.busy_s += batch.infer_s or time.perf_counter() - began
        try:
            loop.call_soon_threadsafe(_resolve, batch, outputs, error, done)
        except RuntimeError:  # the loop closed during shutdown; nobody is waiting
            pass

    def run_sync(self, model: str, samples: list[Any], pad_to: int) -> tuple[list[Any], float]:
        """Run in the calling thread (warm-up, profiling); return outputs and seconds."""
        runner = self._runners.get()
        try:
            return runner.run(model, samples, pad_to)
        finally:
            self._runners.put(runner)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for process in self.processes:
            process.close()


def _resolve(batch: Batch, outputs: list[Any] | None, error: BaseException | None,
             done: asyncio.Future[None]) -> None:
    # ``done`` first: every future is settled in this one call, but callbacks run in the
    # order their futures were set, so the batcher starts the next batch on the free
    # thread before the batch's handlers write their answers.
    if not done.done():
        done.set_result(None)
    if error is None and outputs is not None:
        for item, output in zip(batch.items, outputs):
            if not item.future.done():
                item.infer_s = batch.infer_s
                item.future.set_result(output)
        return
    if isinstance(error, VegaError):  # not run at all: no model process is up
        failure = error
    else:
        log.error("model %s failed on batch %d of %d: %r", batch.model, batch.id,
                  batch.size, error)
        failure = VegaError("model_error", f"model raised {type(error).__name__}")
    for item in batch.items:
        if not item.future.done():
            item.future.set_exception(failure)
