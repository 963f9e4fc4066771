"""An API app on a real loopback socket with settings a test chooses (page size, stream caps)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
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
from tests.conftest import LAB_BMC_ENV, Tokens, seed
from tests.waiting import eventually


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
            **LAB_BMC_ENV,
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
    """Wait for a condition (``tests.waiting.eventually``; the timeout only bounds a failing
    test, it decides nothing)."""
    await eventually(what, cond, timeout)


#: Adjusts the config and fills the store before the app starts (after the seed).
Prepare = Callable[[Any, Store, Tokens], None]


class LoopbackApi:
    """The metald app served on 127.0.0.1 from a thread with its own event loop."""

    def __init__(self, url: str, tmp_path: Path, prepare: Prepare | None = None) -> None:
        self.url, self.tmp_path, self.prepare = url, tmp_path, prepare
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.base = ""
        self.port = 0
        self.tokens: Tokens | None = None
        self.error: BaseException | None = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            self.error = e
            self.ready.set()
            return
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.store.close()

    async def _start(self) -> None:
        from aiohttp import web

        from api.app import create_app, server_settings
        from api.context import AppContext
        from metald.config import load_config
        from metald.events import EventBus
        from metald.secrets import SecretBox
        from metald.store import Store

        cfg = load_config(
            None,
            environ={
                "METALD_STATE_DIR": str(self.tmp_path / "state"),
                "METALD_STORE__URL": self.url,
                **LAB_BMC_ENV,
            },
        )
        self.store = Store(self.url)
        self.store.migrate()
        self.tokens = seed(self.store)
        if self.prepare is not None:
            self.prepare(cfg, self.store, self.tokens)
        ctx = AppContext(
            cfg=cfg,
            store=self.store,
            secrets=SecretBox.from_file(cfg.secrets_key_path),
            bus=EventBus(),
        )
        self.ctx = ctx
        self.runner = web.AppRunner(create_app(ctx), access_log=None, **server_settings())
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LoopbackApi:
        self.thread.start()
        self.ready.wait(60)
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *_exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def use_services(ctx: AppContext, **services: Any) -> None:
    """Give a test's running app these services (``api.context.Services`` fields), as a
    daemon would have built them."""
    ctx.services = dataclasses.replace(ctx.services, **services)


async def drain_steps(client: TestClient[Any, Any]) -> None:
    """Wait for every boot the app under ``client`` started in the background (its provision
    service's runner)."""
    from api.app import CTX_KEY
    from api.workflows import provisioner

    await provisioner(client.app[CTX_KEY]).steps.drain()


async def link_redfish(
    client: TestClient[Any, Any],
    tokens: Tokens,
    port: int,
    mid: str | None = None,
    *,
    username: str = "admin",
    password: str = "unused",
) -> str:
    """Register the Redfish BMC listening on 127.0.0.1:``port`` over the API (as a
    technician), linked to machine ``mid`` (the seed's free machine unless told); its id."""
    mid = mid or tokens.machine_free
    body = {
        "address": "http://127.0.0.1",
        "port": port,
        "protocol": "redfish",
        "username": username,
        "password": password,
        "machine_id": mid,
    }
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 201, await r.text()
    return mid
