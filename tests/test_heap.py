"""What a waiting request keeps alive on the server's heap, checked in this process.

Held refusals and queued requests wait for a batch time or far longer, hundreds at once
under load. Whatever they keep reachable, every garbage collection rescans while it holds
the GIL the model thread needs; garbage in cycles waits for a full collection.
"""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest

from tests.models import echo
from vega.cli import YOUNG_COLLECTION_THRESHOLD, settle_heap
from vega.config import load_settings
from vega.errors import VegaError
from vega.server import create_app

MARK = 4321.5  # the first value of the test window: finds its parsed rows on the heap
V1_BODY = b'{"inputs": [[4321.5, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]}'
V1_INSTANCES_BODY = b'{"instances": [[[4321.5, 0, 0, 0, 0, 0, 0, 0]], [[2, 2, 2, 2, 2, 2, 2, 2]]]}'
V2_BODY = (b'{"inputs": [{"name": "INPUT__0", "shape": [1, 2, 8], "datatype": "FP32",'
           b' "data": [[[4321.5, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]]}]}')


def _parsed_rows_alive() -> bool:
    return any(type(o) is list and o and type(o[0]) is float and o[0] == MARK
               for o in gc.get_objects())


@pytest.mark.parametrize("path, body", [("/v1/infer", V1_BODY),
                                        ("/v2/models/echo/infer", V2_BODY)],
                         ids=["v1", "v2"])
async def test_a_held_refusal_keeps_nothing_of_its_request_alive(path: str, body: bytes) -> None:
    # Refused by the token bucket once it is spent (after the body is parsed) and paced
    # at one refusal a second: the second refusal is held ~1 s. Under a flood hundreds
    # are held at once; each one's parsed window would be live objects that every
    # collection rescans.
    settings = load_settings(environ={
        "VEGA_RATE_LIMIT": "1", "VEGA_BURST": "1", "VEGA_REFUSAL_RATE": "1",
        "VEGA_WARMUP_BATCHES": "1", "VEGA_TORCH_THREADS": "1"})
    app, runtime = create_app(settings, [echo("echo")])
    await runtime.start()
    await runtime.wait_ready()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://vega") as client:
            assert (await client.post(path, content=body)).status_code == 200  # the bucket's
            first = await client.post(path, content=body)
            # /v1 and /v2 word their error bodies differently; both name the reason.
            assert first.status_code == 429 and b"rate" in first.content
            held = asyncio.ensure_future(client.post(path, content=body))
            await asyncio.sleep(0.3)
            assert not held.done(), "the second refusal should be held by the pacer"
            assert not _parsed_rows_alive()
            second = await held
            assert second.status_code == 429 and "retry-after" in second.headers
    finally:
        await runtime.stop()


@pytest.mark.parametrize("path, body", [("/v1/infer", V1_BODY),
                                        ("/v1/infer", V1_INSTANCES_BODY),
                                        ("/v2/models/echo/infer", V2_BODY)],
                         ids=["v1-inputs", "v1-instances", "v2"])
async def test_admitted_work_keeps_no_parsed_json_while_it_waits(
        path: str, body: bytes) -> None:
    # Admitted requests wait a batch time or more: under load, hundreds at once. Once
    # decoded into arrays, the lists their bodies parsed into must be gone, or every
    # collection rescans them while the model thread waits for the GIL.
    settings = load_settings(environ={"VEGA_WARMUP_BATCHES": "1", "VEGA_TORCH_THREADS": "1"})
    model = echo("echo")
    app, runtime = create_app(settings, [model])
    await runtime.start()
    await runtime.wait_ready()
    model.module.sleep_s = 0.6  # each forward pass from now on (warm-up is done)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://vega") as client:
            running = asyncio.ensure_future(client.post(path, content=body))
            await asyncio.sleep(0.3)
            assert not running.done(), "the request should still be in its forward pass"
            assert runtime.executor.busy == 1
            assert not _parsed_rows_alive()
            answer = await running
            assert answer.status_code == 200, answer.text
    finally:
        await runtime.stop()


async def test_a_request_shed_from_the_queue_leaves_no_cycle_for_the_collector() -> None:
    # A shed item's future holds its error. Raising that same object in the request's
    # frames would tie them into a cycle with it (frame -> items -> future -> error ->
    # traceback -> frame): garbage that only a collection frees, one per shed request.
    settings = load_settings(environ={
        "VEGA_MAX_BATCH_SIZE": "1", "VEGA_MAX_INFLIGHT_BATCHES": "1",
        "VEGA_WARMUP_BATCHES": "1", "VEGA_TORCH_THREADS": "1"})
    model = echo("echo")
    app, runtime = create_app(settings, [model])
    await runtime.start()
    await runtime.wait_ready()
    model.module.sleep_s = 0.4  # the queue behind the first request stands past 100 ms
    transport = httpx.ASGITransport(app=app)
    body = b'{"inputs": [[1, 0, 0, 0, 0, 0, 0, 0]]}'
    gc.collect()
    gc.disable()
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://vega") as client:
            first = asyncio.ensure_future(client.post("/v1/infer", content=body))
            await asyncio.sleep(0.05)
            queued = await asyncio.gather(*(client.post("/v1/infer", content=body)
                                            for _ in range(3)))
            assert [r.json()["error"]["code"] for r in queued] == ["shed"] * 3
            assert (await first).status_code == 200
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        assert not [o for o in gc.garbage if isinstance(o, VegaError)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await runtime.stop()


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


def test_once_warm_request_churn_runs_no_collection_but_cycles_are_still_freed() -> None:
    runs: list[tuple[int, int]] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            runs.append((info["generation"], info["collected"]))

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    try:
        settle_heap()
        runs.clear()  # its own full collection
        # What ~20 waiting requests hold (a few hundred containers each), then let go:
        # under the default threshold of 700 this alone ran several collections.
        held = [[{"row": [float(i)]}] for i in range(2000)]
        del held
        assert runs == []
        # Garbage in cycles still goes, once enough of it has piled up.
        for _ in range(YOUNG_COLLECTION_THRESHOLD):
            a, b = _Node(), _Node()
            a.peer, b.peer = b, a
        del a, b
        assert runs and sum(collected for _, collected in runs) > 0
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()
        gc.set_threshold(*threshold)
