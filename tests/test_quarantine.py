"""Inputs that take a model process down: suspected after one crash, run alone, refused
once one crashes alone (vega/quarantine.py, vega/settle.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis

from tests.infra import RedisServer
from tests.models import CRASH_MARK, window
from tests.servers import VegaProcess, metric, wait_until
from tests.test_executor import DEVICE, ECHO, plan
from tests.test_jobs import served, submit, until_final
from tests.test_streams import beats_stopped, ghost, solo_runtime
from vega import quarantine as quarantine_module
from vega.channel.keys import node_key, reply_key
from vega.channel.wire import Reply, encode_reply
from vega.errors import VegaError
from vega.executor import Executor
from vega.modelproc import ModelProcessError, handle
from vega.modelproc.handle import Lane
from vega.models import SequenceModel, load_model
from vega.quarantine import WENT_DOWN, Quarantine, fingerprint
from vega.records import JOB, Batch, Item
from vega.settle import Settler

# -- the record of suspects and refusals --------------------------------------------------


def sample(first: float, length: int = 4) -> np.ndarray:
    x = np.full((length, 8), 0.5, dtype=np.float32)
    x[0, 0] = first
    return x


def items_of(*firsts: float) -> list[Item]:
    loop = asyncio.get_running_loop()
    return [Item(sample=sample(first), length=4, priority=1, deadline=loop.time() + 60,
                 future=loop.create_future()) for first in firsts]


def test_a_fingerprint_tells_model_dtype_shape_and_values_apart() -> None:
    base = fingerprint("m", sample(1.0))
    assert base is not None and base == fingerprint("m", sample(1.0).copy())
    others = {fingerprint("n", sample(1.0)), fingerprint("m", sample(2.0)),
              fingerprint("m", sample(1.0).astype(np.float64)),
              fingerprint("m", sample(1.0, length=5)),
              fingerprint("m", np.asfortranarray(sample(1.0).reshape(8, 4)))}
    assert base not in others and len(others) == 5
    assert fingerprint("m", [[1.0]]) is None  # not an array: never held


async def test_a_batch_that_crashed_makes_suspects_and_one_alone_is_refused() -> None:
    quarantine = Quarantine()
    assert not quarantine
    quarantine.crashed("m", items_of(1.0, 2.0, 3.0))
    clean, suspects, refused = quarantine.sort("m", items_of(2.0, 4.0, 3.0))
    assert [i.sample[0, 0] for i in suspects] == [2.0, 3.0] and len(clean) == 1
    assert refused == [] and quarantine.refused == 0
    quarantine.ran("m", items_of(3.0))  # ran alone, the process lived: cleared
    quarantine.crashed("m", items_of(2.0))  # crashed alone: refused
    clean, suspects, refused = quarantine.sort("m", items_of(1.0, 2.0, 3.0))
    assert [i.sample[0, 0] for i in refused] == [2.0]
    assert [i.sample[0, 0] for i in suspects] == [1.0]
    assert [i.sample[0, 0] for i in clean] == [3.0]
    assert quarantine.refused == 1
    assert quarantine.sort("other", items_of(2.0))[2] == []  # another model's input


async def test_held_inputs_are_forgotten_after_the_hold_and_past_the_most() -> None:
    quarantine = Quarantine(hold_s=0.05, most=3)
    quarantine.crashed("m", items_of(1.0))
    quarantine.crashed("m", items_of(2.0, 3.0, 4.0, 5.0))  # over 3: the oldest forgotten
    _, suspects, refused = quarantine.sort("m", items_of(1.0, 2.0, 3.0, 4.0, 5.0))
    assert len(refused) == 1 and [i.sample[0, 0] for i in suspects] == [3.0, 4.0, 5.0]
    time.sleep(0.06)
    assert quarantine.sort("m", items_of(1.0, 3.0))[1:] == ([], []) and not quarantine


async def test_a_peer_adopts_the_refused_inputs_until_the_same_instant_not_again() -> None:
    ours, theirs = Quarantine(hold_s=0.3), Quarantine(hold_s=0.3)
    ours.crashed("m", items_of(2.0))
    ours.crashed("m", items_of(3.0, 4.0))  # suspects: not shared
    beat = orjson.loads(orjson.dumps(ours.shared()))  # as a heartbeat carries it
    assert list(beat) == ["m"] and len(beat["m"]) == 1
    theirs.adopt("m", beat["m"])
    assert [i.sample[0, 0] for i in theirs.sort("m", items_of(2.0, 3.0))[2]] == [2.0]
    echoed = orjson.loads(orjson.dumps(theirs.shared()))
    assert theirs.refused == 1 and abs(echoed["m"][0][1] - beat["m"][0][1]) <= 1
    time.sleep(0.31)  # both refusals ended at the same instant
    ours.adopt("m", echoed["m"])  # its beat from before the end, read late: not taken back
    theirs.adopt("m", beat["m"])
    assert ours.refused == 0 and theirs.refused == 0 and not ours.shared()


GOOD = ["ab" * 16, 2**60, "<f4", [4, 8]]


@pytest.mark.parametrize("entry", [
    "not a list", ["zz" * 16, *GOOD[1:]], GOOD[:3], ["ab" * 15, *GOOD[1:]], [1, 2, 3, 4],
    ["AB" * 16, *GOOD[1:]], [GOOD[0], "soon", *GOOD[2:]], [GOOD[0], True, *GOOD[2:]],
    [GOOD[0], 2.0**60, *GOOD[2:]], [*GOOD[:2], "f4; drop", GOOD[3]], [*GOOD[:3], [-1, 8]],
    [*GOOD[:3], [1] * 9], [*GOOD[:3], "4x8"], [*GOOD, 5]])
def test_what_a_peer_sends_that_does_not_parse_is_ignored(entry: object) -> None:
    quarantine = Quarantine()
    quarantine.adopt("m", [entry])
    assert not quarantine
    quarantine.adopt("m", [GOOD])  # the same shape, right: taken
    assert quarantine.refused == 1


def test_a_peer_s_refusal_is_held_no_longer_than_the_hold_here() -> None:
    quarantine = Quarantine(hold_s=1.0)
    quarantine.adopt("m", [GOOD])
    [(_, until_ms, _, _)] = quarantine.shared()["m"]
    assert until_ms <= 1000 * time.time() + 1001


async def test_only_windows_of_a_held_dtype_and_shape_are_hashed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    quarantine = Quarantine()
    quarantine.crashed("m", items_of(2.0))  # windows of 4 steps
    hashed: list[tuple[int, ...]] = []
    digest = quarantine_module._digest

    def counted(form: quarantine_module.Form, window: np.ndarray) -> bytes:
        hashed.append(window.shape)
        return digest(form, window)

    monkeypatch.setattr(quarantine_module, "_digest", counted)
    loop = asyncio.get_running_loop()
    longer = [Item(sample=sample(2.0, length=5), length=5, priority=1,
                   deadline=loop.time() + 60, future=loop.create_future())]
    assert quarantine.sort("m", longer) == (longer, [], [])
    assert quarantine.sort("other", items_of(2.0))[2] == []
    assert hashed == []  # neither the other length nor the other model was hashed
    assert len(quarantine.sort("m", items_of(2.0, 1.0))[2]) == 1 and hashed == [(4, 8)] * 2


# -- the settler: what a batch holding one becomes -----------------------------------------


async def test_a_batch_holding_held_inputs_runs_its_suspects_alone_and_fails_its_refused(
        ) -> None:
    ran: list[list[float]] = []
    settler = Settler(lambda part: ran.append([i.sample[0, 0] for i in part.items]),
                      Quarantine())
    settler.quarantine.crashed("m", items_of(7.0, 8.0))
    settler.quarantine.crashed("m", items_of(9.0))
    batch = Batch(model="m", bucket=0, items=items_of(1.0, 7.0, 9.0, 2.0, 8.0), pad_to=4,
                  isolate=True)
    ended: list[Batch] = []
    batch.on_end = ended.append
    done = asyncio.get_running_loop().create_future()
    assert settler.held_back(batch, done)
    assert done.done() and ended == [batch]  # the batcher hears its end
    assert ran == [[1.0, 2.0], [7.0], [8.0]]
    refused = batch.items[2].future.exception()
    assert isinstance(refused, VegaError) and refused.code == "model_error"
    assert "took the model process down" in refused.message
    assert settler.quarantine.refusals == 1
    assert not any(batch.items[k].future.done() for k in (0, 1, 3, 4))  # the parts answer

    alone = Batch(model="m", bucket=0, items=items_of(7.0), pad_to=4, isolate=True)
    assert not settler.held_back(alone, asyncio.get_running_loop().create_future())


async def test_a_peers_batch_holding_a_suspect_is_declined_unrun() -> None:
    settler = Settler(lambda part: pytest.fail("a peer's batch is answered whole"),
                      Quarantine())
    settler.quarantine.crashed("m", items_of(7.0, 8.0))
    batch = Batch(model="m", bucket=0, items=items_of(1.0, 7.0), pad_to=4)
    assert settler.held_back(batch, asyncio.get_running_loop().create_future())
    for item in batch.items:  # not_ready: the thief declines it, and its origin runs it
        error = item.future.exception()
        assert isinstance(error, VegaError) and error.code == "not_ready"


async def test_only_the_batch_a_process_died_running_makes_suspects() -> None:
    settler = Settler(lambda part: None, Quarantine())
    loop = asyncio.get_running_loop()
    waiting = Batch(model="m", bucket=0, items=items_of(1.0, 2.0), pad_to=4, isolate=True)
    settler.ended(waiting, None, ModelProcessError("server stopping"), loop.create_future())
    assert not settler.quarantine
    running = Batch(model="m", bucket=0, items=items_of(1.0, 2.0), pad_to=4, isolate=True)
    settler.ended(running, None, ModelProcessError("died", suspect=True), loop.create_future())
    assert len(settler.quarantine.sort("m", items_of(1.0, 2.0))[1]) == 2


async def test_a_suspect_whose_process_was_killed_from_outside_stays_a_suspect() -> None:
    settler = Settler(lambda part: None, Quarantine())
    loop = asyncio.get_running_loop()
    settler.quarantine.crashed("m", items_of(1.0, 2.0))
    alone = Batch(model="m", bucket=0, items=items_of(1.0), pad_to=4, isolate=True)
    settler.ended(alone, None, ModelProcessError("killed"), loop.create_future())  # OOM kill
    assert isinstance(alone.items[0].future.exception(), VegaError)
    assert len(settler.quarantine.sort("m", items_of(1.0))[1]) == 1  # not cleared
    ran = Batch(model="m", bucket=0, items=items_of(1.0), pad_to=4, isolate=True)
    settler.ended(ran, [[0.0]], None, loop.create_future())
    assert settler.quarantine.sort("m", items_of(1.0))[1] == []  # it ran, and lived: cleared
    assert len(settler.quarantine.sort("m", items_of(2.0))[1]) == 1


def test_only_a_closed_pipe_or_a_hang_blames_the_running_batch() -> None:
    assert handle._blame(EOFError()) is None and handle._blame(ConnectionResetError()) is None
    assert handle._blame(BrokenPipeError()) is None  # as its exit status says
    assert handle._blame(BlockingIOError()) is False  # a payload slow to come: it may live


# -- the executor's lanes: a batch run alone ---------------------------------------------------


class FakeProcess:
    """A model process's handle as the executor's lanes see it: up or restarting, and the
    batches sent to it, answered when the test says."""

    def __init__(self, up: bool) -> None:
        self.up = up
        self.held: list[tuple[Any, Any]] = []
        self.lanes = [Lane(self, 0), Lane(self, 1)]  # type: ignore[arg-type]

    @property
    def in_child(self) -> int:
        return len(self.held)

    def submit(self, lane: int, model: str, samples: list[Any], pad_to: int,
               answered: Any) -> None:
        if not self.up:
            raise VegaError("not_ready", "the model process is restarting")
        self.held.append((samples[0][0, 0], answered))

    def close(self, grace_s: float) -> None:
        pass

    def answer(self) -> None:
        _, answered = self.held.pop(0)
        answered([[1.0]] * 1, 0.001, time.monotonic(), None)


async def test_a_batch_run_alone_waits_for_a_process_that_is_up_not_one_restarting() -> None:
    restarting, up = FakeProcess(up=False), FakeProcess(up=True)
    executor = Executor({}, plan=plan(ECHO, "echo"))
    executor.processes = [restarting, up]  # type: ignore[list-item]
    executor._free = [*restarting.lanes, *up.lanes]
    executor.bind(asyncio.get_running_loop())
    try:
        first = Batch(model="m", bucket=0, items=items_of(1.0), pad_to=4, isolate=True)
        executor.run(first)
        executor.quarantine.crashed("m", items_of(2.0, 9.0))
        suspect = Batch(model="m", bucket=0, items=items_of(2.0), pad_to=4, isolate=True)
        executor.run(suspect)
        after = Batch(model="m", bucket=0, items=items_of(3.0), pad_to=4, isolate=True)
        executor.run(after)
        await asyncio.sleep(0)
        # The suspect waits for the process that is up to empty, and the batch behind it
        # waits too: neither is sent to the restarting one, which would fail it (503).
        assert [value for value, _ in up.held] == [1.0] and restarting.held == []
        assert not suspect.items[0].future.done() and not after.items[0].future.done()
        up.answer()
        assert [value for value, _ in up.held] == [2.0]  # alone in its process
        up.answer()
        assert [value for value, _ in up.held] == [3.0]
        up.answer()
        await asyncio.sleep(0)
        assert all(b.items[0].future.result() == [1.0] for b in (first, suspect, after))
        assert not executor.quarantine.sort("m", items_of(2.0))[1]  # ran: cleared
    finally:
        executor.shutdown()


def fake_executor(*processes: FakeProcess) -> Executor:
    executor = Executor({}, plan=plan(ECHO, "echo"))
    executor.processes = list(processes)  # type: ignore[arg-type]
    executor._free = [lane for process in processes for lane in process.lanes]
    executor.bind(asyncio.get_running_loop())
    return executor


async def test_a_job_batch_s_suspects_run_after_the_inline_work_waiting() -> None:
    """Job items run only when no inline item waits: a dead job batch's suspects, each
    waiting for an empty process, do not hold back the inline batch formed after them."""
    dead, up = FakeProcess(up=False), FakeProcess(up=True)
    executor = fake_executor(dead, up)
    loop = asyncio.get_running_loop()
    try:
        jobs = items_of(11.0, 12.0, 13.0)
        for item in jobs:
            item.priority = JOB
        ran_in_dead = Batch(model="m", bucket=0, items=jobs, pad_to=4, isolate=True)
        executor._settler.ended(ran_in_dead, None, ModelProcessError("died", suspect=True),
                                loop.create_future())
        inline = Batch(model="m", bucket=0, items=items_of(1.0), pad_to=4, isolate=True)
        executor.run(inline)
        sent = []
        for _ in range(8):
            await asyncio.sleep(0)
            if up.held:
                sent.append(float(up.held[0][0]))
                up.answer()
        # The first suspect went at once (nothing inline waited); the inline batch formed
        # while it ran goes next, ahead of the other two.
        assert sent == [11.0, 1.0, 12.0, 13.0]
    finally:
        executor.shutdown()


async def test_a_suspect_whose_caller_left_while_it_waited_is_not_run() -> None:
    up = FakeProcess(up=True)
    executor = fake_executor(up)
    try:
        executor.run(Batch(model="m", bucket=0, items=items_of(1.0), pad_to=4, isolate=True))
        executor.quarantine.crashed("m", items_of(2.0, 9.0))
        suspect = Batch(model="m", bucket=0, items=items_of(2.0), pad_to=4, isolate=True)
        done = executor.run(suspect)  # waits, alone, for the process to empty
        await asyncio.sleep(0)
        suspect.items[0].future.cancel()  # its deadline passed, or its caller hung up
        up.answer()
        await asyncio.sleep(0)
        assert up.held == [] and done.done()  # not sent: it might go down for nobody
    finally:
        executor.shutdown()


def test_a_later_report_of_a_batch_holding_a_refused_input_leaves_it_refused() -> None:
    """Two model processes: X hung alone on one (refused), and with Y on the other, whose
    timeout fires later. X stays refused, not made a suspect that runs again."""
    async def check() -> None:
        held = Quarantine()
        held.crashed("m", items_of(7.0))
        held.crashed("m", items_of(7.0, 8.0))
        _, suspects, refused = held.sort("m", items_of(7.0, 8.0))
        assert len(refused) == 1 and len(suspects) == 1
    asyncio.run(check())


# -- a real model process ------------------------------------------------------------------


def echo_batch(model: SequenceModel, *firsts: float) -> Batch:
    loop = asyncio.get_running_loop()
    items = []
    for first in firsts:
        rows = window(4)
        rows[0][0] = first
        items.append(Item(sample=model.decode(rows)[0], length=4, priority=1,
                          deadline=loop.time() + 60, future=loop.create_future()))
    return Batch(model="echo", bucket=0, items=items, pad_to=4, isolate=True)


def codes(batch: Batch) -> list[str | float]:
    """Each item's error code, or the first value of its answer (the echo's sum)."""
    out: list[str | float] = []
    for item in batch.items:
        error = item.future.exception()
        out.append(error.code if isinstance(error, VegaError) else
                   "raised" if error is not None else float(item.future.result()[0]))
    return out


async def wait_up(executor: Executor) -> None:
    end = asyncio.get_running_loop().time() + 60
    while not executor.available:
        assert asyncio.get_running_loop().time() < end, "the model process came back"
        await asyncio.sleep(0.05)


async def settled(batch: Batch) -> None:
    await asyncio.wait_for(asyncio.wait([item.future for item in batch.items]), 60)


async def test_an_input_that_kills_the_model_process_takes_it_down_twice_at_most(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_SLEEP_MS", "300")  # the second batch is sent while one runs
    model = load_model(ECHO, "echo")
    assert isinstance(model, SequenceModel)
    executor = Executor({"echo": model}, plan=plan(ECHO, "echo"))
    await asyncio.get_running_loop().run_in_executor(None, executor.load, DEVICE)
    try:
        running, waiting = echo_batch(model, 1.0, CRASH_MARK, 2.0), echo_batch(model, 3.0)
        await asyncio.gather(executor.run(running), executor.run(waiting))
        await asyncio.gather(settled(running), settled(waiting))
        assert codes(running) == ["model_error"] * 3  # its callers: it had begun
        assert codes(waiting) == ["not_ready"]  # never begun: 503, Nginx may retry it
        await wait_up(executor)

        again = echo_batch(model, 1.0, CRASH_MARK, 2.0)  # the callers try again
        await executor.run(again)
        await settled(again)
        # Each suspect runs alone, nothing else in the process: the first is answered, the
        # crasher takes the process down again (only its caller fails), and the last,
        # never sent, is refused unrun (503) while the process restarts.
        assert codes(again) == [1.0 + 31 * 0.5, "model_error", "not_ready"]
        assert executor.restarts == 1
        await wait_up(executor)
        assert executor.restarts == 2
        await wait_up(executor)

        third = echo_batch(model, CRASH_MARK, 4.0)
        await executor.run(third)
        await settled(third)
        assert codes(third) == ["model_error", 4.0 + 31 * 0.5]
        assert "refused" in str(third.items[0].future.exception())
        assert executor.restarts == 2 and executor.available  # not run: nothing went down
    finally:
        executor.shutdown()


async def test_a_death_first_seen_by_a_send_on_the_closed_pipe_still_blames_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The child dies running A while the loop packs B for its second lane, and the watcher
    closes the pipe meanwhile: B's send fails ("handle is closed"), and the exit status,
    not that error, says whether A is to blame."""
    model = load_model(ECHO, "echo")
    assert isinstance(model, SequenceModel)
    executor = Executor({"echo": model}, plan=plan(ECHO, "echo"))
    await asyncio.get_running_loop().run_in_executor(None, executor.load, DEVICE)
    pack = handle.ModelProcess._pack

    def slow_pack(self: handle.ModelProcess, lane: int, name: str, samples: list[Any],
                  pad_to: int) -> bytes:
        if float(samples[0][0, 0]) == 3.0:
            time.sleep(0.6)  # a large batch copied into the slot: the child dies meanwhile
        return pack(self, lane, name, samples, pad_to)

    monkeypatch.setattr(handle.ModelProcess, "_pack", slow_pack)
    try:
        crasher, behind = echo_batch(model, CRASH_MARK), echo_batch(model, 3.0)
        executor.run(crasher)
        executor.run(behind)
        await asyncio.gather(settled(crasher), settled(behind))
        assert codes(crasher) == ["model_error"] and codes(behind) == ["not_ready"]
        assert executor.quarantine.refused == 1  # it went down alone: refused
    finally:
        executor.shutdown()


# -- a served user module, at the defaults -------------------------------------------------


def infer(url: str, first: float, length: int) -> httpx.Response:
    x = np.full((length, 8), 0.5, dtype=np.float32)
    x[0, 0] = first
    return httpx.post(url + "/v1/infer", content=orjson.dumps({"inputs": x.tolist()}),
                      timeout=30)


def test_a_served_module_refuses_an_input_that_took_its_process_down_and_serves_the_rest(
        vega: Callable[..., VegaProcess]) -> None:
    """A user's eager module at the defaults (a model process), windows of mixed lengths:
    the crashing window's caller tries again and again; after it has taken the process
    down alone, it is refused unrun, and every other window is answered."""
    proc = vega(VEGA_MODEL="python:tests.models:crashing_encoder")
    lengths = [16, 40, 64, 100, 256]
    assert all(infer(proc.url, 0.1, n).status_code == 200 for n in lengths)
    first = infer(proc.url, CRASH_MARK, 64)
    assert first.status_code == 500 and first.json()["error"] == {
        "code": "model_error", "message": WENT_DOWN}
    wait_until(lambda: httpx.get(proc.url + "/readyz", timeout=5).status_code == 200, 60,
               "ready after the restart")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda k: infer(proc.url, *k), [
            (CRASH_MARK, 64) if k % 4 == 0 else (0.01 * k, lengths[k % 5])
            for k in range(40)]))
    crashers = [a for k, a in enumerate(answers) if k % 4 == 0]
    assert all(a.status_code == 500 and "refused" in a.json()["error"]["message"]
               for a in crashers)
    assert all(a.status_code == 200 for k, a in enumerate(answers) if k % 4)
    assert metric(proc, "vega_model_process_restarts_total") == 1  # it crashed alone
    assert metric(proc, "vega_quarantined_inputs") == 1
    assert metric(proc, "vega_quarantine_refusals_total") == len(crashers)
    status = httpx.get(proc.url + "/v1/status", timeout=5).json()
    assert status["executor"]["quarantined_inputs"] == 1
    assert "died during a batch (EOFError), killed by SIGSEGV" in proc.log() or \
        "(ConnectionResetError), killed by SIGSEGV" in proc.log()


# -- peers serving the same model, through a real Redis ------------------------------------


async def test_an_input_refused_by_one_process_is_refused_by_its_peers(
        redis_server: RedisServer) -> None:
    async with solo_runtime(redis_server.url, VEGA_NODE_ID="a") as a, \
            solo_runtime(redis_server.url, VEGA_NODE_ID="b") as b:
        # Told, not run: these runtimes run the model in a thread (this test's process).
        crasher = echo_batch(a.models["echo"].adapter, 5.0)  # type: ignore[arg-type]
        a.executor.quarantine.crashed("echo", crasher.items)  # it took a's process down alone
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            for _ in range(100):  # b's next beats read a's
                if b.executor.quarantine.refused:
                    break
                await asyncio.sleep(0.05)
            beat = orjson.loads((await client.hgetall(node_key("a")))[b"quarantined"])
        finally:
            await client.aclose()
        assert list(beat) == ["echo"] and len(beat["echo"]) == 1
        again = echo_batch(b.models["echo"].adapter, 5.0, 0.5)  # type: ignore[arg-type]
        await b.executor.run(again)
        await settled(again)
        assert codes(again)[0] == "model_error" and "refused" in str(
            again.items[0].future.exception())
        assert codes(again)[1] == 0.5 + 31 * 0.5
        a.executor.quarantine.crashed("other", echo_batch(
            a.models["echo"].adapter, 9.0).items)  # type: ignore[arg-type]
        await asyncio.sleep(0.5)  # a model b does not serve: not taken in
        assert b.executor.quarantine.refused == 1


async def test_a_batch_a_peer_went_down_running_runs_here_an_input_at_a_time(
        redis_server: RedisServer) -> None:
    """A peer's model process went down running a batch of ours: taken back, its inputs
    run here one at a time, so that the one to blame takes no batch mate down with it."""
    async with solo_runtime(redis_server.url) as runtime:
        streams = await beats_stopped(runtime, [ghost("peer", 1)])
        batch = echo_batch(runtime.models["echo"].adapter, 5.0, 6.0)  # type: ignore[arg-type]
        assert await streams.offer(batch, local_wait_s=2.0)
        [key] = list(streams._pending)
        await streams.cmd.xadd(reply_key("solo"), encode_reply(Reply(  # type: ignore[arg-type]
            key, "peer", 1.0, (), "model_error", WENT_DOWN)))
        await settled(batch)
        # [sum, length, batch size]: each ran in a batch of one.
        assert [item.future.result()[2] for item in batch.items] == [1.0, 1.0]
        assert streams.metrics.overflow_events.labels("taken_back")._value.get() == 1


async def test_a_batch_holding_a_suspect_is_not_handed_to_a_peer(
        redis_server: RedisServer) -> None:
    """Its suspect runs here, alone; at a peer it would run with the rest of the batch."""
    async with solo_runtime(redis_server.url) as runtime:
        streams = await beats_stopped(runtime, [ghost("peer", 1)])
        adapter = runtime.models["echo"].adapter
        runtime.executor.quarantine.crashed(
            "echo", echo_batch(adapter, 5.0, 7.0).items)  # type: ignore[arg-type]
        batch = echo_batch(adapter, 5.0, 6.0)  # type: ignore[arg-type]
        runtime._local_wait_s = lambda batch: 10.0  # type: ignore[method-assign]
        assert streams.worth_handing_off(batch, 10.0)  # it would go, but for its suspect
        await runtime._sink(batch)
        await settled(batch)
        assert streams._pending == {} and streams.counts["offered"] == 0
        assert [item.future.result()[2] for item in batch.items] == [1.0, 1.0]


async def test_a_job_whose_input_is_refused_fails_at_once_its_attempts_unspent() -> None:
    async with served(VEGA_MAX_ATTEMPTS="3") as (client, runtime, model):
        rows = window(4)
        rows[0][0] = 5.0  # told, not run: this runtime runs the model in this process
        loop = asyncio.get_running_loop()
        runtime.executor.quarantine.crashed("echo", [Item(
            sample=model.decode(rows)[0], length=4, priority=1, deadline=loop.time() + 60,
            future=loop.create_future())])
        refused = (await submit(client, {"inputs": rows})).json()["id"]
        clean = (await submit(client, {"inputs": window(4)})).json()["id"]
        final = await until_final(client, refused)
        assert final["status"] == "failed" and final["error"]["code"] == "model_error"
        assert "refused" in final["error"]["message"]
        assert (await until_final(client, clean))["status"] == "done"
        metrics = (await client.get("/metrics")).text
        assert 'vega_jobs_retried_total{model="echo"} 0.0' in metrics
        assert 'vega_jobs_dead_letters{model="echo"} 0.0' in metrics
