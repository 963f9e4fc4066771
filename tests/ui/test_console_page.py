"""The machine page's serial console in a real browser: xterm.js over the console WebSocket
(on the session cookie, not a token), against OpenIPMI's ipmi_sim whose Serial-over-LAN is
wired to a TCP socket this test serves as the host's serial port (tests/bmc/test_sol_ipmi_sim.py,
the cheapest real SOL). Text printed on the serial line shows in the xterm; keys typed in the
page reach the line. A WebSocket from another Origin, or without the CSRF token, is refused."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import expect

from tests.bmc.peers import PASSWORD
from tests.bmc.test_sol_ipmi_sim import SolSim, running_sol_sim
from tests.conftest import LAB_BMC_ENV, Tokens, seed
from tests.ui_browser import axe_violations, open_as, shoot

pytestmark = [
    pytest.mark.skipif(shutil.which("ipmi_sim") is None, reason="needs OpenIPMI's ipmi_sim"),
    # The session reaches the console route as ApiRequest.session, not as a str key on the
    # aiohttp request (which aiohttp warns about): the warning fails the test.
    pytest.mark.filterwarnings("error::aiohttp.web_exceptions.NotAppKeyWarning"),
]


@dataclass
class ConsoleApp:
    base: str
    tokens: Tokens
    sim: SolSim
    loop: asyncio.AbstractEventLoop

    def run(self, coro: Any, timeout: float = 15) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def console_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleApp]:
    """metald with its BMC and console services and a machine whose BMC is ipmi_sim, served
    from a thread with its own event loop (the browser is driven from the test's thread)."""
    from aiohttp import web

    from api.app import create_app
    from api.context import AppContext, Services
    from metald.bmc.console import ConsoleService
    from metald.bmc.console_links import BmcLinks
    from metald.bmc.service import BmcService
    from metald.config import load_config
    from metald.events import EventBus
    from metald.secrets import SecretBox
    from metald.store import Store

    tmp = tmp_path_factory.mktemp("console")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop = asyncio.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        url = f"sqlite:///{tmp / 'metald.db'}"
        cfg = load_config(
            None,
            environ={
                "METALD_STATE_DIR": str(tmp / "state"),
                "METALD_STORE__URL": url,
                **LAB_BMC_ENV,
            },
        )
        cfg.bmc.min_interval_ms, cfg.bmc.timeout_s, cfg.bmc.retries = 0, 3, 1
        store = Store(url)
        store.migrate()
        tokens = seed(store)
        secrets = SecretBox.from_file(cfg.secrets_key_path)
        bmc = BmcService(store, secrets, cfg.bmc, cfg.instance)
        consoles = ConsoleService(store, cfg.instance, BmcLinks(bmc, secrets), linger_s=0.0)
        ctx = AppContext(
            cfg=cfg,
            store=store,
            secrets=secrets,
            bus=EventBus(),
            services=Services(bmc=bmc, console=consoles),
        )
        async with running_sol_sim(tmp) as sim:
            runner = web.AppRunner(create_app(ctx), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            box["app"] = ConsoleApp(f"http://127.0.0.1:{runner.addresses[0][1]}", tokens, sim, loop)
            ready.set()
            await stop.wait()
            await consoles.stop()
            await bmc.stop()
            await runner.cleanup()
        store.close()

    def thread() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve())
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            box["error"] = e
            ready.set()

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    ready.wait(60)
    if "error" in box:
        raise box["error"]
    app: ConsoleApp = box["app"]
    r = requests.post(
        app.base + "/api/v1/bmcs",
        json={
            "address": "127.0.0.1",
            "port": app.sim.port,
            "protocol": "ipmi",
            "username": "admin",
            "password": PASSWORD,
            "machine_id": app.tokens.machine_free,
        },
        headers=app.tokens.header("technician"),
        timeout=10,
    )
    assert r.status_code == 201, r.text
    try:
        yield app
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(30)


def test_console_shows_serial_text_and_sends_typed_keys(browser, console_app, shots) -> None:  # type: ignore[no-untyped-def]
    app = console_app
    page = open_as(
        browser, app.base, app.tokens.technician, f"/ui/machines/{app.tokens.machine_free}"
    )
    page.get_by_role("button", name="Open console").click()
    expect(page.locator("#console-mode")).to_have_text("you type")
    expect(page.locator("#watching")).to_have_text("technician:technician")
    # Text printed before the SOL session is up is not the console's: wait for the link.
    expect(page.locator("#console-state")).to_have_text(re.compile("^connected"))
    app.run(app.sim.serial.send(b"SeaBIOS (version 1.16)\r\nBooting from ROM...\r\nlogin: "))
    expect(page.locator("#term .xterm-rows")).to_contain_text("Booting from ROM...")
    page.locator("#term").click()
    page.keyboard.type("root")
    page.keyboard.press("Enter")
    app.run(app.sim.serial.wait_for(b"root\r"))
    shoot(page, shots, "console")
    assert axe_violations(page) == []
    page.context.close()


def test_console_websocket_needs_our_origin_and_the_csrf_token(browser, console_app) -> None:  # type: ignore[no-untyped-def]
    app = console_app
    page = open_as(
        browser, app.base, app.tokens.technician, f"/ui/machines/{app.tokens.machine_free}"
    )
    csrf = page.locator("body").get_attribute("data-csrf")
    cookie = page.context.cookies()[0]
    ws_url = app.base.replace("http", "ws") + f"/ui/machines/{app.tokens.machine_free}/console"
    jar = {"Cookie": f"{cookie['name']}={cookie['value']}"}

    def status(url: str, headers: dict[str, str]) -> int:
        async def go() -> int:
            import aiohttp

            async with aiohttp.ClientSession() as http:
                try:
                    ws = await http.ws_connect(url, headers=headers)
                except aiohttp.WSServerHandshakeError as e:
                    return e.status
                await ws.close()
                return 101

        return app.run(go())

    assert status(f"{ws_url}?csrf={csrf}", {**jar, "Origin": "http://evil.example"}) == 403
    assert status(f"{ws_url}?csrf={csrf}", jar) == 403  # no Origin at all
    assert status(f"{ws_url}?csrf=wrong", {**jar, "Origin": app.base}) == 403
    assert status(f"{ws_url}?csrf={csrf}", {"Origin": app.base}) == 401  # no session
    assert status(f"{ws_url}?csrf={csrf}&mode=read", {**jar, "Origin": app.base}) == 101
    page.context.close()


__all__ = ["Path"]


def test_actions_on_the_machine_page_keep_the_console_attached(browser, console_app) -> None:  # type: ignore[no-untyped-def]
    """Issue 31 item 14: confirming "power cycle" navigated to /ui/machines/bulk and the open
    console was gone. Now actions are sent in place: the same document, the same WebSocket.
    Maintenance on goes through and serial text still arrives; power cycle is refused by this
    ipmi_sim (no chassis control) and the refusal shows in place."""
    app = console_app
    path = f"/ui/machines/{app.tokens.machine_free}"
    page = open_as(browser, app.base, app.tokens.technician, path)
    page.get_by_role("button", name="Open console").click()
    expect(page.locator("#console-state")).to_have_text(re.compile("^connected"))
    app.run(app.sim.serial.send(b"before the action\r\n"))
    expect(page.locator("#term .xterm-rows")).to_contain_text("before the action")
    page.get_by_role("button", name="Maintenance on").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Maintenance on")
    dialog.get_by_label("Reason").fill("watch it boot")
    dialog.get_by_role("button", name="Confirm").click()
    expect(page.locator("#act-status")).to_contain_text("maintenance on: done")
    expect(page.locator("#m-state")).to_have_text("maintenance")
    assert page.url == app.base + path
    assert page.evaluate("window.metaldConsole.ws.readyState") == 1  # OPEN, the same socket
    expect(page.locator("#console-state")).to_have_text(re.compile("^connected"))
    app.run(app.sim.serial.send(b"after the action: iPXE\r\n"))
    # xterm.js renders only while the terminal is on screen: bring it back into view.
    page.locator("#term").scroll_into_view_if_needed()
    expect(page.locator("#term .xterm-rows")).to_contain_text("after the action: iPXE")
    # Power cycle, confirmed: sent in place too (this ipmi_sim has no chassis control behind
    # it and answers 0xcc, so the refusal shows in place with the BMC's sentence).
    page.get_by_role("button", name="Power cycle").click()
    expect(dialog).to_contain_text("Power cycle")
    dialog.get_by_role("button", name="Confirm").click()
    expect(page.locator("#act-status")).to_contain_text("BMC command failed")
    assert page.url == app.base + path
    assert page.evaluate("window.metaldConsole.ws.readyState") == 1
    page.context.close()
