"""An API app on a real loopback socket with settings a test chooses (page size, stream caps)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from api.app import create_app
from api.context import AppContext
from metald.config import load_config
from metald.events import EventBus
from metald.secrets import SecretBox
from metald.store import Store
from tests.conftest import Tokens, seed


@dataclass
class LiveApi:
    client: TestClient
    tokens: Tokens
    ctx: AppContext
    #: Every request the app received, in order (for tests that watch the server's side).
    requests: list[web.Request]
    #: The requests the app has answered.
    answered: list[web.Request]

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def port(self) -> int:
        assert self.client.server.port is not None
        return self.client.server.port


async def live_api(
    aiohttp_client: Any,
    store: Store,
    tmp_path: Path,
    *,
    env: dict[str, str] | None = None,
    bus: EventBus | None = None,
) -> LiveApi:
    cfg = load_config(
        None,
        environ={
            "METALD_STATE_DIR": str(tmp_path / "state"),
            "METALD_STORE__URL": store.url,
            **(env or {}),
        },
    )
    ctx = AppContext(
        cfg=cfg,
        store=store,
        secrets=SecretBox.from_file(cfg.secrets_key_path),
        bus=bus or EventBus(),
    )
    tokens = seed(store)
    seen: list[web.Request] = []
    answered: list[web.Request] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request)
        try:
            return await handler(request)
        finally:
            answered.append(request)

    app = create_app(ctx)
    app.middlewares.append(record)
    client = await aiohttp_client(app)
    return LiveApi(client, tokens, ctx, seen, answered)


async def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Wait for a condition (the timeout only bounds a failing test; it decides nothing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
