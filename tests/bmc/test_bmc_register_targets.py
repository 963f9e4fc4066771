"""BMC registration is neither a request forger nor a port scanner (issue 24 item 2).

``POST /api/v1/bmcs`` connects only where ``[bmc] networks`` allows, never to loopback,
link-local or metald's own listeners unless configured (the production default refuses them);
a failed verification answers one fixed sentence naming the step, never the peer's text, and
only once ``[bmc] verify_s`` has passed, whatever the port did (refused, silent, or a hostile
service answering). ``verify: false`` stages a BMC that does not answer yet; its owner verifies
it later. Real parts: ipmi_sim, TCP listeners on loopback that record who connects.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from api.app import create_app
from api.context import AppContext, Services
from metald.bmc.service import BmcService
from metald.config import load_config
from metald.events import EventBus
from metald.secrets import SecretBox
from metald.store import Store
from tests.bmc.peers import IpmiSim, free_port
from tests.conftest import LAB_BMC_ENV, seed

PEER_TEXT = "PEER-CONTROLLED-TEXT-0451"


async def _api(aiohttp_client, store: Store, tmp_path: Path, env: dict[str, str]):  # type: ignore[no-untyped-def]
    cfg = load_config(
        None,
        environ={
            "METALD_STATE_DIR": str(tmp_path / "state"),
            "METALD_STORE__URL": store.url,
            "METALD_BMC__MIN_INTERVAL_MS": "0",
            "METALD_BMC__TIMEOUT_S": "1",
            "METALD_BMC__RETRIES": "0",
            **env,
        },
    )
    secrets = SecretBox.from_file(cfg.secrets_key_path)
    svc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    ctx = AppContext(
        cfg=cfg, store=store, secrets=secrets, bus=EventBus(), services=Services(bmc=svc)
    )
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    return client, tokens, svc, cfg


class _Listener:
    """A TCP port on loopback that records every connection: answers per ``mode``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.port = 0
        self.server: asyncio.AbstractServer | None = None
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        if self.mode == "hostile":  # a Redfish-looking service that errors with its own text

            async def answer(request: web.Request) -> web.Response:
                return web.json_response(
                    {"error": {"code": "Base.1.0.GeneralError", "message": PEER_TEXT}}, status=500
                )

            @web.middleware
            async def count(request: web.Request, handler: Any) -> web.StreamResponse:
                self.connections += 1
                return await handler(request)

            app = web.Application(middlewares=[count])
            app.router.add_route("*", "/{tail:.*}", answer)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return

        async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            await reader.read()  # silent: never answers
            writer.close()

        self.server = await asyncio.start_server(held, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def listeners() -> AsyncIterator[dict[str, _Listener]]:
    out = {m: _Listener(m) for m in ("silent", "hostile")}
    for lst in out.values():
        await lst.start()
    yield out
    for lst in out.values():
        await lst.stop()


def _body(address: str, port: int | None, protocol: str = "redfish", **kw: Any) -> dict[str, Any]:
    body = {"address": address, "protocol": protocol, "username": "admin", "password": "pw", **kw}
    if port is not None:
        body["port"] = port
    return body


async def test_the_default_refuses_loopback_link_local_and_metalds_own_listeners(
    aiohttp_client, store: Store, tmp_path: Path, listeners: dict[str, _Listener]
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, svc, cfg = await _api(aiohttp_client, store, tmp_path, {})
    try:
        tech = tokens.header("technician")
        api_port = client.server.port
        for body, why in (
            (_body("http://127.0.0.1", listeners["hostile"].port), "loopback"),
            (_body("127.0.0.1", listeners["silent"].port, "ipmi"), "loopback"),
            (_body("localhost", listeners["silent"].port, "auto"), "loopback"),
            (_body("https://[::1]", listeners["silent"].port), "loopback"),
            (_body("[::ffff:127.0.0.1]", listeners["silent"].port), "loopback"),
            (_body("169.254.169.254", 80), "link-local"),
            (_body("0.0.0.0", listeners["silent"].port), "unspecified"),
            (_body("127.0.0.1", api_port), "loopback"),
        ):
            r = await client.post("/api/v1/bmcs", json=body, headers=tech)
            got = await r.json()
            assert r.status == 422 and got["step"] == "target", (body, got)
            assert why in got["detail"] and "[bmc] networks" in got["detail"], got
        assert listeners["hostile"].connections == 0 and listeners["silent"].connections == 0
        assert await svc.list() == []
    finally:
        await svc.stop()


async def test_networks_restrict_targets_and_own_listeners_stay_refused(
    aiohttp_client, store: Store, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    env = {"METALD_BMC__NETWORKS": '["10.20.0.0/16"]', "METALD_BMC__VERIFY_S": "0.2"}
    client, tokens, svc, cfg = await _api(aiohttp_client, store, tmp_path, env)
    try:
        r = await client.post(
            "/api/v1/bmcs", json=_body("192.0.2.7", 443), headers=tokens.header("technician")
        )
        got = await r.json()
        assert r.status == 422 and "outside [bmc] networks (10.20.0.0/16)" in got["detail"]
    finally:
        await svc.stop()
    from metald.bmc import targets

    ip = ipaddress.ip_address
    net = ipaddress.ip_network
    # The pure rule: 0.0.0.0/0 does not let loopback in, 127.0.0.0/8 does; own listeners never.
    assert "loopback" in str(targets.refusal([ip("127.0.0.1")], [623], [net("0.0.0.0/0")], []))
    assert targets.refusal([ip("127.0.0.1")], [623], [net("127.0.0.0/8")], []) is None
    assert "link-local" in str(targets.refusal([ip("fe80::1")], [443], [net("::/0")], []))
    own = [([ip("127.0.0.1")], 5432)]
    assert "own listeners" in str(
        targets.refusal([ip("127.0.0.1")], [5432], [net("127.0.0.0/8")], own)
    )
    assert targets.refusal([ip("10.20.3.4")], [443], [net("10.20.0.0/16")], own) is None
    # The store's server and the listeners come from the config.
    cfg.store.url = "postgresql+psycopg://m@db.example:6543/metald"
    cfg.boot.http_listen = "10.9.0.1:8081"
    assert ("db.example", 6543) in targets.own_listeners(cfg)
    assert ("10.9.0.1", 8081) in targets.own_listeners(cfg)


async def test_a_failed_verification_is_one_fixed_sentence_at_one_time(
    aiohttp_client, store: Store, tmp_path: Path, listeners: dict[str, _Listener]
) -> None:  # type: ignore[no-untyped-def]
    verify_s = 1.5
    env = {**LAB_BMC_ENV, "METALD_BMC__VERIFY_S": str(verify_s)}
    client, tokens, svc, _ = await _api(aiohttp_client, store, tmp_path, env)
    try:
        tech = tokens.header("technician")
        answers = {}
        for what, port in (
            ("closed", free_port()),
            ("silent", listeners["silent"].port),
            ("hostile", listeners["hostile"].port),
        ):
            started = time.monotonic()
            r = await client.post(
                "/api/v1/bmcs", json=_body("http://127.0.0.1", port), headers=tech
            )
            took = time.monotonic() - started
            got = await r.json()
            assert r.status == 422, got
            assert took >= verify_s, (what, took)  # the floor: never earlier than the deadline
            answers[what] = {k: v for k, v in got.items() if k != "instance"}
        assert listeners["hostile"].connections > 0  # it was asked, and what it said...
        assert PEER_TEXT not in str(answers)  # ...is never shown
        assert answers["closed"] == answers["silent"] == answers["hostile"], answers
        detail = answers["closed"]["detail"]
        assert detail.startswith("could not verify the BMC at http://127.0.0.1: the identify step")
        assert answers["closed"]["step"] == "identify" and await svc.list() == []
    finally:
        await svc.stop()


async def test_verify_false_stages_a_bmc_its_owner_verifies_once_it_answers(
    aiohttp_client, store: Store, tmp_path: Path, ipmi_sim: IpmiSim
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, svc, _ = await _api(aiohttp_client, store, tmp_path, LAB_BMC_ENV)
    try:
        tech = tokens.header("technician")
        # auto needs the BMC to answer: a staged one names its protocol.
        r = await client.post(
            "/api/v1/bmcs", json=_body("127.0.0.1", free_port(), "auto", verify=False), headers=tech
        )
        assert r.status == 422 and "needs its protocol" in (await r.json())["detail"]
        # Not cabled yet: stored as unreachable, at once (nothing is connected to).
        dark_port = free_port()
        r = await client.post(
            "/api/v1/bmcs", json=_body("127.0.0.1", dark_port, "ipmi", verify=False), headers=tech
        )
        dark = await r.json()
        assert r.status == 201 and dark["health"] == "unreachable" and dark["last_seen_at"] is None
        # The target rule still applies to a staged BMC.
        r = await client.post(
            "/api/v1/bmcs", json=_body("169.254.0.9", 623, "ipmi", verify=False), headers=tech
        )
        assert r.status == 422 and (await r.json())["step"] == "target"
        # One that answers (ipmi_sim), staged the same way: the owner's power sync verifies it.
        body = _body("127.0.0.1", ipmi_sim.port, "ipmi", verify=False)
        body.update(username=ipmi_sim.username, password=ipmi_sim.password)
        r = await client.post("/api/v1/bmcs", json=body, headers=tech)
        staged = await r.json()
        assert r.status == 201 and staged["system_uuid"] is None
        await svc.sync_power_once()
        rows = {
            b["id"]: b
            for b in (await (await client.get("/api/v1/bmcs", headers=tech)).json())["items"]
        }
        assert rows[staged["id"]]["health"] == "ok" and rows[staged["id"]]["system_uuid"]
        assert rows[staged["id"]]["last_seen_at"] is not None
        assert (
            rows[dark["id"]]["health"] == "unreachable" and rows[dark["id"]]["system_uuid"] is None
        )
        r = await client.get("/api/v1/events?kind=bmc.verified", headers=tech)
        assert [e["data"]["bmc_id"] for e in (await r.json())["items"]] == [staged["id"]]
    finally:
        await svc.stop()
