"""The console WebSocket over HTTP, with the real console and BMC services behind it and
ipmi_sim's Serial-over-LAN wired to a TCP socket this test serves as the host's serial port."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sqlmodel import select

from metald.bmc.console import ConsoleService
from metald.bmc.console_links import BmcLinks
from metald.bmc.service import BmcService
from metald.config import Config
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Event
from tests.bmc.peers import PASSWORD
from tests.bmc.test_sol_ipmi_sim import SolSim, running_sol_sim
from tests.conftest import seed


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[SolSim]:
    async with running_sol_sim(tmp_path) as s:
        yield s


@pytest.fixture
async def console_api(request, cfg: Config, store: Store, aiohttp_client, sim: SolSim):  # type: ignore[no-untyped-def]
    """(client, tokens, consoles); ``indirect`` parametrization passes ConsoleService caps."""
    from api.app import create_app
    from api.context import AppContext, Services
    from metald.events import EventBus

    secrets = SecretBox.from_file(cfg.secrets_key_path)
    cfg.bmc.min_interval_ms = 0
    cfg.bmc.timeout_s = 3
    cfg.bmc.retries = 1
    bmc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    caps = getattr(request, "param", {})
    consoles = ConsoleService(store, cfg.instance, BmcLinks(bmc, secrets), linger_s=0.0, **caps)
    services = Services(bmc=bmc, console=consoles)
    ctx = AppContext(cfg=cfg, store=store, secrets=secrets, bus=EventBus(), services=services)
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    body = {
        "address": "127.0.0.1",
        "port": sim.port,
        "protocol": "ipmi",
        "username": "admin",
        "password": PASSWORD,
        "machine_id": tokens.machine_free,
    }
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 201, await r.text()
    yield client, tokens, consoles
    await consoles.stop()
    await bmc.stop()


async def _read_until(ws: Any, needle: bytes, seen: bytearray, notes: list[dict]) -> None:
    async with asyncio.timeout(15):
        while needle not in seen:
            msg = await ws.receive()
            if msg.type.name == "BINARY":
                seen += msg.data
            elif msg.type.name == "TEXT":
                notes.append(json.loads(msg.data))
            else:
                raise AssertionError(f"socket ended: {msg}")


async def _note(ws: Any, kind: str, notes: list[dict]) -> dict:
    async with asyncio.timeout(15):
        while True:
            for n in notes:
                if n.get("type") == kind or n.get("state") == kind:
                    return n
            msg = await ws.receive()
            if msg.type.name == "TEXT":
                notes.append(json.loads(msg.data))


async def test_console_carries_boot_text_and_keys_one_writer(
    console_api, sim: SolSim, store: Store
) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = console_api
    mid = tokens.machine_free
    url = f"/api/v1/machines/{mid}/console"
    tech = await client.ws_connect(url, headers=tokens.header("technician"))
    notes: list[dict] = []
    seen = bytearray()
    hello = json.loads((await tech.receive()).data)
    assert hello["type"] == "hello" and hello["mode"] == "write"
    await _note(tech, "connected", notes)

    await sim.serial.send(b"SeaBIOS (version 1.16)\r\nBooting from ROM...\r\n")
    await _read_until(tech, b"Booting from ROM", seen, notes)
    await tech.send_bytes(b"reboot\r")
    await sim.serial.wait_for(b"reboot\r")

    # A late viewer gets what was printed before it came, and reads only.
    admin = await client.ws_connect(url, headers=tokens.header("admin"))
    hello2 = json.loads((await admin.receive()).data)
    assert hello2["mode"] == "read" and hello2["buffered"] > 0
    assert hello2["writer"] == hello["writer"] or hello2["writer"]
    seen2 = bytearray()
    notes2: list[dict] = []
    await _read_until(admin, b"Booting from ROM", seen2, notes2)
    await admin.send_bytes(b"rm -rf /\r")
    err = await _note(admin, "error", notes2)
    assert "read-only" in err["detail"]
    # Both see new output.
    await sim.serial.send(b"login: ")
    await _read_until(tech, b"login: ", seen, notes)
    await _read_until(admin, b"login: ", seen2, notes2)
    assert b"rm -rf" not in sim.serial.received

    # A second writer is refused before any upgrade, naming who writes.
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect(url + "?mode=write", headers=tokens.header("admin"))
    assert refused.value.status == 409

    await admin.close()
    await tech.close()

    def events(s: Any) -> list[tuple[str, str, str]]:
        rows = s.exec(
            select(Event).where(Event.machine_id == mid, Event.kind.startswith("console."))
        ).all()
        return [(e.kind, e.actor, (e.data or {}).get("mode")) for e in rows]

    async with asyncio.timeout(10):
        while len(got := await store.run(events)) < 4:
            await asyncio.sleep(0.05)
    kinds = [(k, m) for k, _a, m in got]
    assert kinds[:2] == [("console.attached", "write"), ("console.attached", "read")]
    assert sorted(kinds[2:]) == [("console.detached", "read"), ("console.detached", "write")]
    assert all(a for _k, a, _m in got)


async def test_orchestrators_and_plain_http_are_refused(console_api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = console_api
    mid = tokens.machine_free
    url = f"/api/v1/machines/{mid}/console"
    r = await client.get(url, headers={**tokens.header("orchestrator"), "Upgrade": "websocket"})
    assert r.status == 403
    r = await client.get(url, headers=tokens.header("technician"))
    assert r.status == 426
    assert "WebSocket" in (await r.json())["detail"]
    # A machine without a BMC: a problem before any upgrade.
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        await client.ws_connect(
            f"/api/v1/machines/{tokens.machine_a}/console", headers=tokens.header("technician")
        )
    assert e.value.status == 404


async def test_metalctl_attach_types_and_leaves_on_tilde_dot(console_api, sim: SolSim) -> None:  # type: ignore[no-untyped-def]
    """metalctl's attach loop against the real API: keys from a pipe reach the serial line,
    output reaches the terminal, ``~.`` after Enter leaves (and is not sent)."""
    import io
    import os

    from metald.metalctl.console import attach

    client, tokens, _ = console_api
    url = str(client.make_url(f"/api/v1/machines/{tokens.machine_free}/console"))
    notes: list[str] = []
    connected = asyncio.Event()

    def heard(text: str) -> None:
        notes.append(text)
        if "connected" in text:
            connected.set()

    r, w = os.pipe()
    out = io.BytesIO()
    loop = asyncio.get_running_loop()

    def note(text: str) -> None:  # called on attach's thread
        loop.call_soon_threadsafe(heard, text)

    task = asyncio.create_task(asyncio.to_thread(attach, url, tokens.technician, r, out, note=note))
    try:
        await asyncio.wait_for(connected.wait(), 15)
        await sim.serial.send(b"host-says-hi\r\n")
        os.write(w, b"uname -a\r")
        await sim.serial.wait_for(b"uname -a\r")
        os.write(w, b"~.")
        assert await asyncio.wait_for(task, 15) == 0
    finally:
        os.close(w)
        os.close(r)
    assert b"~" not in sim.serial.received
    assert any("attached (write" in n for n in notes)


async def test_metalctl_on_a_real_terminal(console_api, sim: SolSim) -> None:  # type: ignore[no-untyped-def]
    """``metalctl machines console`` as a user runs it: a pseudo-terminal for stdin (raw mode),
    keys reach the serial line, ``~.`` leaves with status 0 and the terminal is restored."""
    import os
    import pty
    import sys
    import termios

    client, tokens, _ = console_api
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    env = {**os.environ, "METALD_TOKEN": tokens.technician}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "metald.metalctl",
        "--url",
        str(client.make_url("")).rstrip("/"),
        "machines",
        "console",
        "node2",
        stdin=slave,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        # Keys typed before the BMC link is up are dropped (metalctl says so): wait for it.
        err = b""
        async with asyncio.timeout(20):
            while b"console connected" not in err:
                err += await proc.stderr.read(4096)  # type: ignore[union-attr]
        assert not termios.tcgetattr(slave)[3] & termios.ICANON  # raw mode
        os.write(master, b"whoami\r")
        await sim.serial.wait_for(b"whoami\r")
        os.write(master, b"~.")
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        err += await proc.stderr.read()  # type: ignore[union-attr]
        assert b"attached (write" in err and b"left the console" in err
        assert termios.tcgetattr(slave) == before
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)
        os.close(slave)


@pytest.mark.parametrize(
    "console_api",
    [{"viewers_per_token": 3, "viewers_per_machine": 4, "viewers_max": 5}],
    indirect=True,
)
async def test_viewers_are_capped_per_token_machine_and_instance(console_api, store: Store) -> None:  # type: ignore[no-untyped-def]
    """Past a cap (per token, per machine, per instance) the attach is a 429 with Retry-After
    before any WebSocket opens, and no ``console.attached`` event is written for it."""
    client, tokens, consoles = console_api
    mid = tokens.machine_free
    url = f"/api/v1/machines/{mid}/console?mode=read"

    def attached(s: Any) -> int:
        rows = s.exec(
            select(Event).where(Event.machine_id == mid, Event.kind == "console.attached")
        ).all()
        return len(rows)

    async def refused(role: str) -> tuple[int, str, str]:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await client.ws_connect(url, headers=tokens.header(role))
        # The handshake error keeps the status and headers; read the problem itself too.
        r = await client.get(
            url,
            headers={
                **tokens.header(role),
                "Connection": "Upgrade",
                "Upgrade": "websocket",
                "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            },
        )
        assert r.status == e.value.status
        return e.value.status, e.value.headers.get("Retry-After", ""), (await r.json())["detail"]

    open_ws = [await client.ws_connect(url, headers=tokens.header("technician")) for _ in range(3)]
    status, retry, detail = await refused("technician")  # a 4th for one token
    assert status == 429 and retry.isdigit(), detail
    assert "a token may hold at most 3 console viewers" in detail
    open_ws.append(await client.ws_connect(url, headers=tokens.header("admin")))
    status, _, detail = await refused("admin")  # a 5th on one machine
    assert status == 429 and "a machine may hold at most 4 console viewers" in detail
    assert await store.run(attached) == 4  # refused attaches wrote nothing
    assert consoles.status(mid)["viewers"] == 4

    # The instance's cap (5 in all), reached here on one machine once its own cap is raised.
    consoles.limiter.per["machine"] = 10
    open_ws.append(await client.ws_connect(url, headers=tokens.header("admin")))
    status, _, detail = await refused("admin")
    assert status == 429 and "at most 5 console viewers at once" in detail
    assert await store.run(attached) == 5

    # Leaving gives the places back.
    for ws in open_ws:
        await ws.close()
    async with asyncio.timeout(10):
        while consoles.limiter.held() > 0:
            await asyncio.sleep(0.01)
    ws = await client.ws_connect(url, headers=tokens.header("technician"))
    await ws.close()
