"""Vega in this process: the real app and runtime behind httpx's ASGI transport, no socket.

For tests of what Vega answers; a real ``vega serve`` (tests/servers.py) stays where
process behaviour is under test (signals, drain, crashes, sockets, logs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.types import ASGIApp

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
    await runtime.start()
    await runtime.wait_ready()
    try:
        yield app, runtime
    finally:
        await runtime.stop()


@asynccontextmanager
async def in_process(env: dict[str, str], adapters: list[ModelAdapter] | None = None
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime]]:
    """The app built from ``env``, warmed up and ready, and a client."""
    async with app_in_process(env, adapters) as (app, runtime):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://vega", timeout=30) as client:
            yield client, runtime
