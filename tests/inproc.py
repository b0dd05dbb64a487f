"""Vega in this process: the real app and runtime behind httpx's ASGI transport, no socket.

For tests of what Vega answers; a real ``vega serve`` (tests/servers.py) stays where
process behaviour is under test (signals, drain, crashes, sockets, logs)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.types import ASGIApp, Message

from vega.config import load_settings
from vega.models import ModelAdapter
from vega.runtime import Runtime
from vega.server import create_app

BASE = {"VEGA_WARMUP_BATCHES": "1", "VEGA_TORCH_THREADS": "1"}


@asynccontextmanager
async def app_in_process(env: dict[str, str], adapters: list[ModelAdapter] | None = None
                         ) -> AsyncIterator[tuple[ASGIApp, Runtime]]:
    """The app built from ``env`` (VEGA_* settings), warmed up and ready, for raw ASGI calls."""
    app, runtime = create_app(load_settings(environ={**BASE, **env}), adapters)
    async with lifespan(app):
        await runtime.wait_ready()
        yield app, runtime


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """The app's ASGI lifespan, as a server runs it: its start, then its whole stop (the
    runtime's, and the clients the app holds beside it, such as the idempotency keys')."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def send(message: Message) -> None:
        await outbox.put(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    async def run() -> None:
        await app(scope, inbox.get, send)

    running = asyncio.create_task(run())
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        await running
        raise RuntimeError(f"the app did not start: {started.get('message')}")
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        stopped = await outbox.get()
        await running
        assert stopped["type"] == "lifespan.shutdown.complete", stopped


@asynccontextmanager
async def in_process(env: dict[str, str], adapters: list[ModelAdapter] | None = None
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime]]:
    """The app built from ``env``, warmed up and ready, and a client."""
    async with app_in_process(env, adapters) as (app, runtime):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://vega", timeout=30) as client:
            yield client, runtime
