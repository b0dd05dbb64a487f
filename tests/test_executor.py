"""Where the model runs: in a thread, or in a model process fed through shared memory."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import uvloop

from tests.infra import unavailable
from tests.models import FAIL_MARK, echo, encoder, per_patch, per_step, window, window_sum
from tests.servers import VegaProcess, metric, served_device, wait_until
from tests.virtual.test_batcher import config, item
from vega import settle
from vega.batcher import Batcher
from vega.config import load_settings
from vega.errors import VegaError
from vega.executor import Executor, driven, process_plan
from vega.modelproc import ModelProcessError, ProcessPlan
from vega.modelproc.child import serve as child_serve
from vega.modelproc.handle import STABLE_AFTER_BATCHES
from vega.models import SequenceModel, load_model
from vega.records import Batch, Item

pytestmark = pytest.mark.slow  # started first (tests/scheduling.py)

ENCODER = "python:tests.models:encoder"
ECHO = "python:tests.models:echo"
DEVICE = served_device()


def plan(spec: str, name: str, timeout_s: float = 30.0) -> ProcessPlan:
    return ProcessPlan(specs=((spec, name),), device=DEVICE, torch_threads=1,
                       slot_bytes=1 << 20, timeout_s=timeout_s)


@pytest.fixture(params=["thread", "process"])
def encoder_executor(request: pytest.FixtureRequest) -> Iterator[tuple[Executor, SequenceModel]]:
    model = encoder("encoder")
    executor = Executor({"encoder": model}, torch_threads=1,
                        plan=plan(ENCODER, "encoder") if request.param == "process" else None)
    executor.load(DEVICE)
    assert executor.kind == request.param
    with driven(executor):  # a model process's batches go through a loop, as when serving
        yield executor, model


@pytest.mark.parametrize("lengths", [[64] * 8, [1, 9, 16, 63, 64, 130, 200, 256]])
def test_each_way_gives_the_models_own_outputs(
        encoder_executor: tuple[Executor, SequenceModel], lengths: list[int]) -> None:
    executor, model = encoder_executor
    reference = encoder("reference")  # the same seed, run directly in this thread
    reference.load(DEVICE)
    rng = np.random.default_rng(len(set(lengths)))
    samples = [model.decode(rng.standard_normal((n, 8)).tolist())[0] for n in lengths]
    outputs, _ = executor.run_sync("encoder", samples, max(lengths))
    assert len(outputs) == len(samples)
    for sample, output in zip(samples, outputs):
        alone = reference.run([sample], sample.shape[0])[0]
        assert output.dtype == np.float32
        np.testing.assert_allclose(output, alone, atol=1e-5)


@pytest.mark.parametrize("way", ["thread", "process"])
def test_each_way_cuts_a_per_step_output_to_each_windows_length(way: str) -> None:
    model = per_step("labeller")
    spec = "python:tests.models:per_step"
    executor = Executor({"labeller": model}, torch_threads=1,
                        plan=plan(spec, "labeller") if way == "process" else None)
    executor.load(DEVICE)
    with driven(executor):
        # A model process found it: this process's metadata says so all the same.
        assert model.outputs[0].shape == (-1, 3)
        reference = per_step("reference")
        reference.load(DEVICE)
        rng = np.random.default_rng(3)
        samples = [model.decode(rng.standard_normal((n, 8)).tolist())[0]
                   for n in (1, 7, 16, 33, 200)]
        outputs, _ = executor.run_sync("labeller", samples, 200)
        for sample, output in zip(samples, outputs):
            assert output.shape == (sample.shape[0], 3)
            np.testing.assert_allclose(output, reference.run([sample], sample.shape[0])[0],
                                       atol=1e-5)


@pytest.mark.parametrize("way", ["thread", "process"])
def test_each_way_answers_one_number_per_window_as_a_number(way: str) -> None:
    model = window_sum("sum")
    executor = Executor({"sum": model}, torch_threads=1,
                        plan=plan("python:tests.models:window_sum", "sum") if way == "process"
                        else None)
    executor.load(DEVICE)
    with driven(executor):
        assert model.outputs[0].shape == ()
        samples = [np.full((n, 8), 0.5, np.float32) for n in (2, 5)]
        outputs, _ = executor.run_sync("sum", samples, 5)
        assert [np.ndim(output) for output in outputs] == [0, 0]  # not [8.0]: JSON says 8.0
        assert [float(output) for output in outputs] == [8.0, 20.0]


@pytest.mark.parametrize("way", ["thread", "process"])
def test_each_way_serves_a_users_module_that_vega_fits(way: str) -> None:
    # Bare modules from a user's factory: one with float64 weights, one taking only x.
    specs = {name: f"python:tests.models:{name}" for name in ("float64", "no_lengths")}
    models = {name: load_model(spec, name) for name, spec in specs.items()}
    executor = Executor(models, torch_threads=1, plan=ProcessPlan(
        specs=tuple((spec, name) for name, spec in specs.items()), device=DEVICE,
        torch_threads=1, slot_bytes=1 << 20, timeout_s=30.0) if way == "process" else None)
    executor.load(DEVICE)
    with driven(executor):
        windows = [np.full((n, 8), float(n), np.float32) for n in (2, 9, 30)]
        outputs, _ = executor.run_sync("float64", windows, 30)  # masked: mixed lengths
        np.testing.assert_allclose(np.stack(outputs),
                                   np.outer([2, 9, 30], np.linspace(0.5, 2.0, 8)), rtol=1e-6)
        outputs, _ = executor.run_sync("no_lengths", windows[1:2] * 2, 9)  # one length
        np.testing.assert_allclose(np.stack(outputs), np.full((2, 8), 18.0))


def test_at_the_defaults_a_model_process_runs_torch_on_one_thread() -> None:
    # A process a core: at torch's default, each of N processes would take all N cores.
    spec = "python:tests.models:torch_threads"
    settings = load_settings(environ={"VEGA_MODEL": spec, "VEGA_DEVICE": DEVICE})
    model = load_model(spec, "threads")
    executor = Executor({"threads": model}, torch_threads=settings.torch_threads,
                        plan=process_plan(settings, [model], ((spec, "threads"),)))
    executor.load(DEVICE)
    with driven(executor):
        assert executor.kind == "process"
        outputs, _ = executor.run_sync("threads", [np.ones((4, 8), np.float32)], 4)
        assert float(outputs[0][0]) == 1.0


def test_a_model_process_runs_nothing_from_a_thread_with_no_loop_to_drive_it() -> None:
    # The loop is the one way to a model process: without one bound, a batch would wait
    # for a lane forever.
    executor = Executor({"echo": echo("echo")}, plan=plan(ECHO, "echo"))
    try:
        with pytest.raises(RuntimeError, match="bind one first"):
            executor.run_sync("echo", [np.ones((4, 8), np.float32)], 4)
    finally:
        executor.shutdown()


def test_model_cpus_for_models_run_in_threads_are_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(environ={"VEGA_EXECUTOR": "thread", "VEGA_MODEL_CPUS": "0"})
    with caplog.at_level("WARNING", logger="vega.executor"):
        assert process_plan(settings, [echo("echo")], ((ECHO, "echo"),)) is None
    assert "VEGA_MODEL_CPUS pins model processes" in caplog.text


def test_a_model_process_refuses_an_output_it_cannot_cut_back() -> None:
    executor = Executor({"patches": per_patch("patches")}, torch_threads=1,
                        plan=plan("python:tests.models:per_patch", "patches"))
    try:
        with pytest.raises(ModelProcessError, match="not one row per step"):
            executor.load(DEVICE)
    finally:
        executor.shutdown()


def test_a_model_process_whose_parent_is_gone_ends_quietly() -> None:
    # The parent closed its end with bytes of ours unread (it died, or failed to start
    # after reading nothing more): the child's read is reset, not ended; it returns.
    ours, theirs = socket.socketpair()
    child = Connection(theirs.detach())
    child.send_bytes(b"{}")  # an answer the parent never reads
    ours.close()
    child_serve({}, [], child)  # returns (the child exits 0); it raised ConnectionResetError


def echo_batch(model: SequenceModel, first: float = 0.5, size: int = 1) -> Batch:
    """A batch of ``size`` echo windows whose first value is ``first`` (FAIL_MARK: raise,
    -FAIL_MARK: hang for TEST_HANG_MS)."""
    loop = asyncio.get_running_loop()
    rows = window(4)
    rows[0][0] = first
    items = [Item(sample=model.decode(rows)[0], length=4, priority=1,
                  deadline=loop.time() + 60, future=loop.create_future()) for _ in range(size)]
    return Batch(model="echo", bucket=0, items=items, pad_to=4)


async def echo_executor() -> tuple[Executor, SequenceModel]:
    """An executor with one model process running ``echo`` (its TEST_* settings from the
    environment, read by the child when it loads the model)."""
    model = load_model(ECHO, "echo")
    assert isinstance(model, SequenceModel)
    executor = Executor({"echo": model}, plan=plan(ECHO, "echo"))
    await asyncio.get_running_loop().run_in_executor(None, executor.load, DEVICE)
    return executor, model


async def executor_running(way: str) -> tuple[Executor, SequenceModel]:
    """The echo model's executor, in a thread or a model process."""
    if way == "process":
        return await echo_executor()
    model = echo("echo")
    model.load(DEVICE)
    return Executor({"echo": model}), model


@pytest.mark.parametrize("way", ["thread", "process"])
async def test_the_runner_tells_of_a_batch_end_first_and_when_it_ended(way: str) -> None:
    executor, model = await executor_running(way)
    try:
        batch = echo_batch(model, 0.5, size=2)
        told: list[tuple[float, list[bool], float | None]] = []
        batch.on_end = lambda ran: told.append(
            (time.monotonic(), [i.future.done() for i in ran.items], ran.ended_at))
        sent = time.monotonic()
        await executor.run(batch)
        [(at, answered, ended_at)] = told
        assert answered == [False, False]  # told before its items were answered
        assert ended_at is not None and sent <= ended_at <= at  # the runner's own clock
        assert [i.future.result()[2] for i in batch.items] == [2.0, 2.0]
    finally:
        executor.shutdown()


async def test_a_raising_model_fails_only_its_batch_in_a_model_process() -> None:
    executor, model = await echo_executor()
    try:
        failing, fine = echo_batch(model, FAIL_MARK), echo_batch(model, 0.5)
        await executor.run(failing)
        await executor.run(fine)
        with pytest.raises(VegaError) as failed:
            failing.items[0].future.result()
        # Named as in a thread: what the module raised, not how the child reported it.
        assert (failed.value.code, failed.value.message) == ("model_error",
                                                             "model raised ValueError")
        assert fine.items[0].future.result()[1] == 4.0  # echo: [sum, length, batch size]
        assert executor.available and executor.restarts == 0
    finally:
        executor.shutdown()


def mixed_batch(model: SequenceModel, firsts: list[float], isolate: bool = True) -> Batch:
    """One batch of echo windows, item ``i`` starting with ``firsts[i]`` (FAIL_MARK: the
    model raises on the whole batch holding it), each of its own length."""
    loop = asyncio.get_running_loop()
    items = []
    for length, first in enumerate(firsts, start=2):
        rows = window(length)
        rows[0][0] = first
        items.append(Item(sample=model.decode(rows)[0], length=length, priority=1,
                          deadline=loop.time() + 60, future=loop.create_future()))
    return Batch(model="echo", bucket=0, items=items, pad_to=len(firsts) + 1, isolate=isolate)


async def settled(batch: Batch) -> list[Any]:
    """Each item's answer, or the code of the VegaError it got."""
    await asyncio.wait_for(asyncio.gather(*(i.future for i in batch.items),
                                          return_exceptions=True), 20)
    return [i.future.exception().code if i.future.exception() else  # type: ignore[union-attr]
            i.future.result()[:2].tolist() for i in batch.items]


@pytest.mark.parametrize("way", ["thread", "process"])
async def test_only_the_input_the_model_raises_on_fails_its_batch_mates_are_answered(
        way: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    passes = tmp_path / "passes"
    monkeypatch.setenv("TEST_FORWARD_LOG", str(passes))  # read as the model is built
    executor, model = await executor_running(way)

    def ran() -> list[str]:  # the batch sizes run since the load's own passes
        return passes.read_text().split()[loaded:]

    loaded = len(passes.read_text().split())
    try:
        batch = mixed_batch(model, [0.5, 0.5, 0.5, FAIL_MARK, 0.5, 0.5])
        await executor.run(batch)
        answers = await settled(batch)
        # echo answers [sum of the window, its length]: each its own, as if run alone
        alone = [[0.5 * (8 * n - 1) + 0.5, float(n)] for n in range(2, 8)]
        assert answers == alone[:3] + ["model_error"] + alone[4:]
        # 6 fails; 3 | 3 fail, run; then 2 | 1 and 1 | 1: the input alone in the end
        assert ran() == ["6", "3", "3", "2", "1", "1", "1"]
        broken = mixed_batch(model, [FAIL_MARK] * 4)  # every input: 2N - 1 passes at most
        await executor.run(broken)
        assert await settled(broken) == ["model_error"] * 4
        assert ran()[7:] == ["4", "2", "2", "1", "1", "1", "1"]
        peers = mixed_batch(model, [0.5, FAIL_MARK], isolate=False)  # a peer's: answered whole
        await executor.run(peers)
        assert await settled(peers) == ["model_error"] * 2
        assert ran()[14:] == ["2"]
    finally:
        executor.shutdown()


async def test_a_window_left_alone_by_its_batch_mate_s_caller_runs_again_alone() -> None:
    # The input the model raised on was its caller's, and that caller has gone: the other
    # window is still answered.
    model = echo("echo")
    model.load(DEVICE)
    executor = Executor({"echo": model})
    try:
        batch = mixed_batch(model, [0.5, FAIL_MARK])
        done = executor.run(batch)
        batch.items[1].future.cancel()  # its deadline passed, say
        await done
        answer = await asyncio.wait_for(batch.items[0].future, 20)
        assert answer[:2].tolist() == [0.5 * 15 + 0.5, 2.0]
    finally:
        executor.shutdown()


async def test_a_failure_that_follows_the_length_stays_with_the_long_window() -> None:
    # Positions for 100 steps only: a batch padded to 120 fails; run again, the short
    # windows are padded to their own length and answered.
    model = load_model("python:tests.models:positions_of_100", "echo")
    assert isinstance(model, SequenceModel)
    model.load(DEVICE)
    executor = Executor({"echo": model})
    loop = asyncio.get_running_loop()
    try:
        items = [Item(sample=model.decode(window(n))[0], length=n, priority=1,
                      deadline=loop.time() + 60, future=loop.create_future()) for n in (10, 120)]
        batch = Batch(model="echo", bucket=0, items=items, pad_to=120, isolate=True)
        await executor.run(batch)
        await asyncio.wait_for(asyncio.gather(*(i.future for i in items),
                                              return_exceptions=True), 20)
        assert items[0].future.result().tolist() == [0.5 * 10] * 8
        assert isinstance(items[1].future.exception(), VegaError)
    finally:
        executor.shutdown()


async def test_a_model_error_quoting_a_huge_input_fails_its_input_not_the_model_process(
        caplog: pytest.LogCaptureFixture) -> None:
    # A reply past the pipe's buffer was read half, and the process taken for dead: killed.
    spec = "python:tests.models:loud"
    model = load_model(spec, "loud")
    assert isinstance(model, SequenceModel)
    executor = Executor({"loud": model}, plan=plan(spec, "loud"))
    await asyncio.get_running_loop().run_in_executor(None, executor.load, DEVICE)
    try:
        batch = mixed_batch(model, [0.5, FAIL_MARK])
        batch.model = "loud"
        with caplog.at_level("ERROR", logger="vega.executor"):
            await executor.run(batch)
            answers = await settled(batch)
        assert answers[1] == "model_error" and answers[0] != "model_error"
        assert executor.available and executor.restarts == 0
        [line] = [r.getMessage() for r in caplog.records if "raised on a batch" in r.getMessage()]
        assert "ValueError: bad input: 0.5" in line and line.endswith("... (cut)")
        assert len(line) < 1200
    finally:
        executor.shutdown()


async def test_a_model_s_failures_are_logged_once_a_second_with_a_count(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    model = echo("echo")
    model.load(DEVICE)
    executor = Executor({"echo": model})
    clock = [100.0]
    monkeypatch.setattr(settle, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    try:
        with caplog.at_level("ERROR", logger="vega.executor"):
            for _ in range(3):  # a flood of inputs it raises on, each alone
                await executor.run(mixed_batch(model, [FAIL_MARK]))
            clock[0] += 1.0
            await executor.run(mixed_batch(model, [FAIL_MARK]))
        lines = [r.getMessage() for r in caplog.records if "raised on a batch" in r.getMessage()]
        assert len(lines) == 2 and "more batch" not in lines[0]
        assert lines[1].endswith("(and on 2 more batch(es) since the last line)")
    finally:
        executor.shutdown()


@pytest.mark.parametrize("way", ["thread", "process"])
async def test_a_failed_batch_teaches_the_batch_time_predictor_nothing(way: str) -> None:
    """Its time is how long the model took to raise (in a model process, measured here it
    was also how late the loop came to the pipe): no batch time to predict from."""
    model = load_model(ECHO, "m")
    assert isinstance(model, SequenceModel)
    if way == "process":
        executor = Executor({"m": model}, plan=plan(ECHO, "m"))
        await asyncio.get_running_loop().run_in_executor(None, executor.load, DEVICE)
    else:
        model.load(DEVICE)
        executor = Executor({"m": model})
    batcher = Batcher(config(max_wait_s=0.001), executor.run)
    task = asyncio.create_task(batcher.run())
    try:
        failing = item(batcher, length=4, sample=model.decode(
            [[FAIL_MARK] * 8, *window(3)])[0])
        with pytest.raises(VegaError):
            await asyncio.wait_for(failing.future, 10)
        assert batcher.times.line(0) is None and executor.busy_s > 0
        fine = item(batcher, length=4, sample=model.decode(window(4))[0])
        await asyncio.wait_for(fine.future, 10)
        assert batcher.times.line(0) is not None  # a batch that ran is measured
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        executor.shutdown()


def test_an_answer_too_large_for_the_slot_crosses_whole_in_a_model_process() -> None:
    # 32 windows of 512 steps, 24 values a step: 1.5 MB of float32, past the 1-MiB slot
    # its inputs fit, so it comes inline. On uvloop, as `vega serve` runs, the loop's
    # reader does not block: read as it came, it failed half-way and the child was taken
    # for dead.
    spec = "python:tests.models:wide_steps"
    model = load_model(spec, "steps")
    executor = Executor({"steps": model}, plan=ProcessPlan(
        specs=((spec, "steps"),), device=DEVICE, torch_threads=1, slot_bytes=1 << 20,
        timeout_s=30.0))
    executor.load(DEVICE)
    rows = [window(512, 0.1 * n) for n in range(32)]

    async def run() -> list[Item]:
        loop = asyncio.get_running_loop()
        items = [Item(sample=model.decode(r)[0], length=512, priority=1,
                      deadline=loop.time() + 60, future=loop.create_future()) for r in rows]
        await executor.run(Batch(model="steps", bucket=0, items=items, pad_to=512))
        return items

    try:
        items = uvloop.run(run())
        [alone] = load_model(spec, "steps").run([model.decode(rows[5])[0]], 512)
        assert [i.future.result().shape for i in items] == [(512, 24)] * 32
        assert np.allclose(items[5].future.result(), alone, atol=1e-5)
        assert executor.restarts == 0
    finally:
        executor.shutdown()


async def test_a_model_process_holds_the_next_batch_while_one_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch sent while another runs waits in the child (two lanes), each gets its own
    outputs, and the time it waited there is not counted as its model time."""
    monkeypatch.setenv("TEST_SLEEP_MS", "300")
    executor, model = await echo_executor()
    try:
        first, second = echo_batch(model, 0.5, size=3), echo_batch(model, 0.25, size=2)
        began = asyncio.get_running_loop().time()
        running = asyncio.gather(executor.run(first), executor.run(second))
        await asyncio.sleep(0.1)
        assert executor.busy == 2  # both handed to the one model process
        await running
        elapsed = asyncio.get_running_loop().time() - began
        assert [item.future.result()[2] for item in first.items] == [3.0] * 3  # batch sizes
        assert [item.future.result()[2] for item in second.items] == [2.0] * 2
        assert first.items[0].future.result()[0] == pytest.approx(16.0)  # sum of its window
        assert second.items[0].future.result()[0] == pytest.approx(15.75)
        # Run one after the other: their model times add up to the time both took, not
        # more (the second's wait behind the first is not model time).
        assert first.infer_s + second.infer_s <= 1.1 * elapsed
        assert executor.busy_s == pytest.approx(first.infer_s + second.infer_s)
    finally:
        executor.shutdown()


async def test_the_loop_drives_the_model_process_with_no_thread_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches past the two lanes wait here and go in order as lanes free; none wakes an
    executor thread (there is none), and warm-up from a thread is served through the loop."""
    monkeypatch.setenv("TEST_SLEEP_MS", "100")
    executor, model = await echo_executor()
    try:
        batches = [echo_batch(model, float(k), size=k + 1) for k in range(4)]
        running = asyncio.gather(*(executor.run(batch) for batch in batches))
        await asyncio.sleep(0.05)
        assert executor.busy == 2  # two in the child, two waiting here
        await running
        for k, batch in enumerate(batches):
            assert [item.future.result()[2] for item in batch.items] == [k + 1.0] * (k + 1)
            assert batch.items[0].future.result()[0] == pytest.approx(15.5 + k)
        ends = [batch.infer_s for batch in batches]
        assert all(0.09 < s < 1.0 for s in ends), ends  # each its own 100 ms, not a wait
        assert not [t.name for t in threading.enumerate() if t.name.startswith("vega-exec")]
        sample = batches[0].items[0].sample
        outputs, _ = await asyncio.to_thread(executor.run_sync, "echo", [sample], 4)
        assert outputs[0][2] == 1.0
    finally:
        executor.shutdown()


async def test_a_loop_that_comes_late_takes_every_answer_waiting_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a turn of the loop outlasts the batches in the child (a flood of cheap
    requests), one wake-up takes all their answers: one a wake-up would feed the child a
    batch a turn, its windows ageing in the queue while it idles."""
    monkeypatch.setenv("TEST_SLEEP_MS", "50")
    executor, model = await echo_executor()
    try:
        handle = executor.processes[0]
        wakeups: list[int] = []
        readable = handle._readable

        def counted(life: object) -> None:
            wakeups.append(executor.busy)
            readable(life)  # type: ignore[arg-type]

        monkeypatch.setattr(handle, "_readable", counted)  # before the pipe is watched
        first, second = echo_batch(model, 0.5, size=2), echo_batch(model, 0.25)
        running = asyncio.gather(executor.run(first), executor.run(second))
        while executor.busy < 2:
            await asyncio.sleep(0.001)
        time.sleep(0.4)  # the loop elsewhere while the child answers both (50 ms each)
        await running
        assert wakeups == [2]  # both answers at the one wake-up
        assert [item.future.result()[2] for item in first.items] == [2.0, 2.0]
        assert second.items[0].future.result()[0] == pytest.approx(15.75)
    finally:
        executor.shutdown()


async def test_a_pipe_closed_by_the_watcher_during_a_send_answers_the_batch_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher thread stops the child while the loop is in a send: it waits for the
    send to end. Closed under it, the send raised TypeError (os.write on None) with the
    batch already held; failed by the executor and again at the loss, its lane was freed
    twice and two batches came to share one slot."""
    executor, model = await echo_executor()
    handle = executor.processes[0]
    stopper = threading.Thread(target=handle._stop_child, args=(0.0,))
    try:
        await executor.run(echo_batch(model))  # the loop drives this life from now on
        assert handle._life is not None
        conn = handle._life.conn
        send = conn._send  # type: ignore[attr-defined]

        def racing(buffer: bytes) -> None:
            stopper.start()
            stopper.join(0.2)
            send(buffer)

        monkeypatch.setattr(conn, "_send", racing)
        batch = echo_batch(model)
        await asyncio.wait_for(executor.run(batch), 10)
        await asyncio.sleep(0.3)  # the child's loss, read on later turns of the loop
        assert batch.items[0].future.done()
        batch.items[0].future.exception()  # answered, once: run or failed with the child
        assert executor.busy == 0
        assert sorted(lane.index for lane in executor._free) == [0, 1]
    finally:
        stopper.join(10)
        executor.shutdown()


async def test_a_killed_model_process_fails_both_batches_it_held_and_comes_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The running batch's callers get model_error; the one waiting behind it never began,
    so its callers get 503 not_ready, which Nginx may retry on another process."""
    monkeypatch.setenv("TEST_HANG_MS", "5000")
    executor, model = await echo_executor()
    try:
        hanging, waiting = echo_batch(model, -FAIL_MARK), echo_batch(model, 0.5)
        running = asyncio.gather(executor.run(hanging), executor.run(waiting))
        await asyncio.sleep(0.2)
        assert executor.busy == 2
        pid = executor.processes[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await running
        for batch, code in ((hanging, "model_error"), (waiting, "not_ready")):
            with pytest.raises(VegaError) as failed:
                batch.items[0].future.result()
            assert failed.value.code == code
        deadline = asyncio.get_running_loop().time() + 60
        while not executor.available and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        after = echo_batch(model, 0.5)
        await executor.run(after)
        assert after.items[0].future.result()[1] == 4.0
        assert executor.restarts == 1 and executor.processes[0].pid != pid
        assert not executor.quarantine  # killed from outside: its inputs are not suspected
    finally:
        executor.shutdown()


@pytest.mark.parametrize("way", ["thread", "process"])
async def test_a_stop_answers_the_batches_that_never_began(
        way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a drain runs out, the batch queued behind the running ones (one thread; two
    lanes of a model process) is answered 503 draining: the pool dropped it unanswered."""
    monkeypatch.setenv("TEST_SLEEP_MS", "300")
    executor, model = await executor_running(way)
    batches = [echo_batch(model, 0.5) for _ in range(3 if way == "process" else 2)]
    running = [executor.run(batch) for batch in batches]
    await asyncio.sleep(0.1)
    await executor.stop()
    await asyncio.wait_for(asyncio.gather(*running), 5)
    failures = [batch.items[0].future.exception() for batch in batches]  # each answered
    assert isinstance(failures[-1], VegaError) and failures[-1].code == "draining"


def infer(url: str, first: float = 0.5, deadline_ms: int = 10_000) -> httpx.Response:
    rows = window(8)
    rows[0][0] = first
    return httpx.post(url + "/v1/infer", content=orjson.dumps(
        {"inputs": rows, "deadline_ms": deadline_ms}), timeout=30)


def model_pid(proc: VegaProcess) -> int:
    status = httpx.get(proc.url + "/v1/status", timeout=5).json()
    assert status["executor"]["kind"] == "process"
    return int(status["executor"]["pids"][0] or 0)  # null while it restarts


def ready(proc: VegaProcess) -> bool:
    return httpx.get(proc.url + "/readyz", timeout=5).status_code == 200


@pytest.fixture
def echo_process(vega: Callable[..., VegaProcess]) -> Callable[..., VegaProcess]:
    def start(**env: str) -> VegaProcess:
        return vega(VEGA_MODEL=ECHO, VEGA_EXECUTOR="process", TEST_HANG_MS="4000", **env)
    return start


def test_a_model_process_killed_mid_batch_fails_that_batch_and_comes_back(
        echo_process: Callable[..., VegaProcess]) -> None:
    proc = echo_process()
    assert infer(proc.url).status_code == 200
    first = model_pid(proc)
    with ThreadPoolExecutor(1) as pool:
        hanging = pool.submit(infer, proc.url, -FAIL_MARK)  # its batch sleeps 4 s
        wait_until(lambda: metric(proc, "vega_inflight_batches") >= 1, 10, "a batch running")
        os.kill(first, signal.SIGKILL)
        answer = hanging.result(timeout=20)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "model_error"
    assert model_pid(proc) != first  # /v1/status shows no dead pid (null while it restarts)
    # Not ready while no model process is up; ready again after the restart's warm-up.
    wait_until(lambda: ready(proc) and model_pid(proc) not in (0, first), 60, "the restart")
    assert infer(proc.url).status_code == 200
    assert metric(proc, "vega_model_process_restarts_total") == 1
    assert metric(proc, "vega_model_processes_up") == 1


def test_a_hung_model_process_is_killed_after_the_timeout_and_restarted(
        echo_process: Callable[..., VegaProcess]) -> None:
    proc = echo_process(VEGA_MODEL_TIMEOUT_S="0.5")
    first = model_pid(proc)
    answer = infer(proc.url, -FAIL_MARK)
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "model_error"
    wait_until(lambda: ready(proc) and model_pid(proc) != first, 60, "the restart")
    assert infer(proc.url).status_code == 200


def test_a_hung_batch_turns_the_process_not_ready_until_it_ends(
        vega: Callable[..., VegaProcess]) -> None:
    # The batch sleeps 8 s, predicted at a millisecond: hung after 2 s, long before
    # VEGA_MODEL_TIMEOUT_S (30 s) would kill it. Meanwhile Nginx gets 503s, which it
    # retries on another process, not 429s.
    proc = vega(VEGA_MODEL=ECHO, VEGA_EXECUTOR="process", TEST_HANG_MS="8000")
    assert infer(proc.url).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        hanging = pool.submit(infer, proc.url, -FAIL_MARK, 20_000)
        wait_until(lambda: not ready(proc), 10, "not ready while the batch hangs")
        refused = infer(proc.url)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
        assert hanging.result(timeout=30).status_code == 200  # it ended, late: answered
    wait_until(lambda: ready(proc), 10, "ready once it ended")
    assert infer(proc.url).status_code == 200


def restarting(echo_process: Callable[..., VegaProcess]) -> VegaProcess:
    """A server whose model process was just killed, not ready for 3 s while the next
    one warms up."""
    proc = echo_process(TEST_LOAD_SLEEP_MS="3000")  # a slow warm-up, after the first too
    os.kill(model_pid(proc), signal.SIGKILL)
    wait_until(lambda: not ready(proc), 10, "not ready")
    return proc


def test_requests_while_the_model_process_restarts_get_503_not_ready(
        echo_process: Callable[..., VegaProcess]) -> None:
    proc = restarting(echo_process)
    answer = infer(proc.url)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "not_ready"
    assert int(answer.headers["retry-after"]) >= 1
    # The exit is counted as it happens; the restart once the next life is warm.
    assert metric(proc, "vega_model_process_exits_total") == 1
    assert metric(proc, "vega_model_process_restarts_total") == 0
    wait_until(lambda: ready(proc), 60, "ready again")
    assert infer(proc.url).status_code == 200
    assert metric(proc, "vega_model_process_restarts_total") == 1


def test_jobs_queued_through_a_model_process_restart_run_after_it_not_dead_lettered(
        echo_process: Callable[..., VegaProcess]) -> None:
    # One job a batch, 200 ms each: most are still queued when the model process dies.
    proc = echo_process(TEST_SLEEP_MS="200", TEST_LOAD_SLEEP_MS="2000",
                        VEGA_MAX_BATCH_SIZE="1")
    first = model_pid(proc)
    body = orjson.dumps({"inputs": window(8)})
    ids = [httpx.post(proc.url + "/v1/jobs", content=body, timeout=5).json()["id"]
           for _ in range(12)]
    wait_until(lambda: metric(proc, "vega_inflight_batches") >= 1, 10, "a job running")
    os.kill(first, signal.SIGKILL)

    def states() -> list[str]:
        return [httpx.get(f"{proc.url}/v1/jobs/{i}", timeout=5).json()["status"] for i in ids]
    wait_until(lambda: all(s in ("done", "failed") for s in states()), 60, "every job ended")
    assert states() == ["done"] * len(ids)  # not one refused while no model could run it
    assert metric(proc, "vega_jobs_dead_letters") == 0


def test_a_job_submitted_while_the_model_process_restarts_is_taken_and_runs_after(
        echo_process: Callable[..., VegaProcess]) -> None:
    # A job is stored, not run at once: while inference gets 503, a submit gets 202.
    proc = restarting(echo_process)
    submitted = httpx.post(proc.url + "/v1/jobs", content=orjson.dumps(
        {"inputs": window(8)}), timeout=5)
    assert submitted.status_code == 202, submitted.text
    assert infer(proc.url).status_code == 503  # inline work is still refused meanwhile
    job = submitted.json()["id"]
    wait_until(lambda: httpx.get(f"{proc.url}/v1/jobs/{job}", timeout=5).json()["status"]
               == "done", 60, "the job ran after the restart")


def test_a_stopped_server_lets_its_model_process_exit_not_killed(
        echo_process: Callable[..., VegaProcess], tmp_path: Path) -> None:
    # The loop reads the child's pipe through a dup of it: left open, the child never saw
    # the pipe close, and was killed after the grace period instead.
    exits = tmp_path / "exits"
    proc = echo_process(TEST_EXIT_LOG=str(exits))
    assert infer(proc.url).status_code == 200
    child = model_pid(proc)
    assert proc.stop() == 0
    assert exits.exists() and str(child) in exits.read_text().split()


def test_auto_runs_an_eager_module_in_a_process_and_torchscript_in_a_thread(
        vega: Callable[..., VegaProcess]) -> None:
    eager = vega(VEGA_MODEL=ENCODER)
    status = httpx.get(eager.url + "/v1/status", timeout=5).json()
    assert status["executor"]["kind"] == "process" and status["executor"]["processes_up"] == 1
    assert infer(eager.url).status_code == 200
    # Its buckets were cut again from its measured costs, and the padding it paid is
    # reported. How many there are depends on timings taken on a shared machine (the
    # planner's own tests fix the costs), so only the cut is asserted here.
    model = httpx.get(eager.url + "/v1/status", timeout=5).json()["models"]["encoder"]
    buckets = model["length_buckets"]
    assert buckets != [16, 32, 64, 128, 256, 512] and buckets[-1] == 512, buckets
    assert buckets == sorted(set(buckets)) and all(b % 8 == 0 for b in buckets), buckets
    assert 0.0 <= model["padding_share"] < 1.0
    assert metric(eager, "vega_length_bucket_upper_steps", model="encoder",
                  bucket=str(len(buckets) - 1)) == 512
    assert metric(eager, "vega_batch_steps_total", model="encoder") > 0
    builtin = vega()
    assert httpx.get(builtin.url + "/v1/status", timeout=5).json()["executor"]["kind"] == "thread"


def cpus_of(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process ``pid``."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def test_model_cpus_pin_the_model_process_and_keep_the_loop_off_them(
        vega: Callable[..., VegaProcess]) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        unavailable("pinning needs two CPUs")
    model_cpu = max(os.sched_getaffinity(0))
    server = vega(VEGA_MODEL=ENCODER, VEGA_MODEL_CPUS=str(model_cpu))
    assert infer(server.url).status_code == 200
    child = httpx.get(server.url + "/v1/status", timeout=5).json()["executor"]["pids"][0]
    assert server.proc is not None
    assert cpus_of(child) == {frozenset({model_cpu})}  # torch's threads included
    assert cpus_of(server.proc.pid) == {frozenset(os.sched_getaffinity(0)) - {model_cpu}}


async def test_a_freed_thread_gets_the_held_batch_before_the_answers_are_handled() -> None:
    """With the real executor: the batch held while the thread was busy is dispatched in
    the finished batch's own callback, ahead of the handlers that batch wakes; queued
    behind them it waited out their work with the thread idle."""
    model = echo("m")
    model.load(DEVICE)
    executor = Executor({"m": model})
    dispatched: list[int] = []

    def sink(batch: Batch) -> asyncio.Future[None]:
        dispatched.append(batch.size)
        return executor.run(batch)

    batcher = Batcher(config(max_batch_size=4, max_wait_s=60.0, dispatch_when_idle=True), sink)
    task = asyncio.create_task(batcher.run())
    try:
        sample, length = model.decode(window(10))
        first = [item(batcher, sample=sample) for _ in range(4)]
        while not dispatched:
            await asyncio.sleep(0.001)
        held = [item(batcher, sample=sample) for _ in range(2)]  # partial: kept while busy
        seen_by_first_handler: list[int] = []
        first[0].future.add_done_callback(lambda _: seen_by_first_handler.append(len(dispatched)))
        await asyncio.wait_for(asyncio.gather(*(i.future for i in first + held)), 10)
        assert seen_by_first_handler == [2]
        assert dispatched == [4, 2]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        executor.shutdown()


async def test_a_model_process_that_served_restarts_at_the_shortest_backoff() -> None:
    """One input taking a serving model process down is no crash loop: the next life
    starts after the shortest backoff. Lives that die having answered few batches or
    none (a model that cannot serve, or dies every other batch) back off longer each time."""
    executor, model = await echo_executor()
    process = executor.processes[0]

    async def killed_and_back(served: int) -> int:
        for _ in range(served):
            batch = echo_batch(model, 0.5)
            await executor.run(batch)
            assert batch.items[0].future.result()[1] == 4.0
        restarts, pid = executor.restarts, process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        end = asyncio.get_running_loop().time() + 60
        while not (executor.available and executor.restarts == restarts + 1):
            assert asyncio.get_running_loop().time() < end, "the model process came back"
            await asyncio.sleep(0.05)
        return process._failures

    try:
        assert await killed_and_back(served=STABLE_AFTER_BATCHES) == 1  # from the shortest
        assert await killed_and_back(served=0) == 2  # served nothing: longer
        assert await killed_and_back(served=1) == 3  # one batch is no sign of health
        assert await killed_and_back(served=STABLE_AFTER_BATCHES) == 1
    finally:
        executor.shutdown()
