"""The batcher on the loop `vega serve` runs (uvloop), where the order of a loop turn matters.

The tests in tests/virtual/ run the batcher on a virtual clock; this one checks what
only a real loop shows: when a batch falls due by time while the loop is behind with
handlers that socket reads queued, the batch is formed before those handlers run.
"""

from __future__ import annotations

import asyncio
import socket
import time

import uvloop

from vega.batcher import Batcher, BatcherConfig
from vega.records import NORMAL, Batch, Item

WAIT_S = 0.05


def test_a_batch_due_by_time_is_formed_before_handlers_already_queued() -> None:
    order = uvloop.run(_formed_or_handled_first())
    assert order.index("batch") < order.index("handler 0"), order
    assert order.count("batch") == 1 and len(order) == 4, order


async def _formed_or_handled_first() -> list[str]:
    loop = asyncio.get_running_loop()
    order: list[str] = []

    def sink(batch: Batch) -> asyncio.Future[None]:
        # As the executor does: the batch leaves within the call (a model process has it).
        order.append("batch")
        for item in batch.items:
            item.future.set_result(None)
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return done

    config = BatcherConfig(model="m", buckets=(512,), max_batch_size=8, max_wait_s=WAIT_S,
                           max_inflight=1)
    batcher = Batcher(config, sink)
    task = asyncio.create_task(batcher.run())
    reader, writer = socket.socketpair()
    try:
        await asyncio.sleep(0)  # the batcher is waiting for work
        item = Item(sample=None, length=10, priority=NORMAL,
                    deadline=loop.time() + 10, future=loop.create_future())
        batcher.enqueue(item)  # due by its wait at WAIT_S from now

        def readable() -> None:
            # A socket read that takes the loop past the batch's due time and queues
            # handlers, as a burst of requests does.
            reader.recv(1)
            time.sleep(WAIT_S)
            for number in range(3):
                loop.call_soon(order.append, f"handler {number}")

        loop.add_reader(reader.fileno(), readable)
        loop.call_later(WAIT_S / 2, writer.send, b"x")
        await asyncio.wait_for(item.future, 5)
        until = loop.time() + 5
        while len(order) < 4 and loop.time() < until:  # the handlers, one turn later
            await asyncio.sleep(0.001)
    finally:
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return order
