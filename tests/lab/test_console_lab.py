"""A lab machine's serial console through metald end to end: the API's console WebSocket, the
console service, metald's SOL link, the lab's virtual BMC and QEMU's serial port.

Everything metald-side runs in one process inside the lab's namespace (where the BMC address
lives): the real API application, BMC and console services on a throwaway SQLite store. The
machine is powered on through the API; SeaBIOS's and iPXE's text must arrive on the WebSocket,
and a key typed there must reach iPXE: Ctrl-C while it waits for DHCP makes it print
"Operation canceled" (text the key itself does not contain).

The same again through the web console's page, in Debian's chromium (Playwright, the helpers
of ``tests.ui_browser``) run inside the lab's namespace: log in at /ui/, open the machine's
console, see SeaBIOS's and iPXE's text in the xterm, type Ctrl-C there and see iPXE's answer.
Its screenshot is saved as ``console-lab.png`` in the web console's artifacts folder.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import lab_prerequisites
from .labtools import in_ns, vlab

pytestmark = [pytest.mark.lab, pytest.mark.root]

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import asyncio, json, sys, tempfile
from pathlib import Path
import aiohttp
from aiohttp.test_utils import TestServer
from api.app import create_app
from api.context import AppContext, Services
from metald.bmc.console import ConsoleService
from metald.bmc.console_links import BmcLinks
from metald.bmc.service import BmcService
from metald.config import load_config
from metald.events import EventBus
from metald.secrets import SecretBox
from metald.store import Store
from tests.conftest import LAB_BMC_ENV, seed

address, port, user, password = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
seen = bytearray()

async def main():
    tmp = Path(tempfile.mkdtemp())
    cfg = load_config(None, environ={"METALD_STATE_DIR": str(tmp / "state"),
                                     "METALD_STORE__URL": f"sqlite:///{tmp}/m.db", **LAB_BMC_ENV})
    store = Store(cfg.store_url)
    store.migrate()
    secrets = SecretBox.from_file(cfg.secrets_key_path)
    bmc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    consoles = ConsoleService(store, cfg.instance, BmcLinks(bmc, secrets))
    ctx = AppContext(cfg=cfg, store=store, secrets=secrets, bus=EventBus(),
                     services=Services(bmc=bmc, console=consoles))
    tokens = seed(store)
    server = TestServer(create_app(ctx), host="127.0.0.1")
    await server.start_server()
    tech = tokens.header("technician")
    mid = tokens.machine_free
    out = {}
    async with aiohttp.ClientSession() as http:
        body = {"address": address, "port": port, "protocol": "ipmi", "username": user,
                "password": password, "machine_id": mid}
        async with http.post(server.make_url("/api/v1/bmcs"), json=body, headers=tech) as r:
            assert r.status == 201, await r.text()
        power = server.make_url(f"/api/v1/machines/{mid}/power")
        async with http.post(power, json={"action": "off"}, headers=tech) as r:
            assert r.status == 200, await r.text()
        ws = await http.ws_connect(server.make_url(f"/api/v1/machines/{mid}/console"),
                                   headers=tech)

        async def until(needle: bytes, timeout: float) -> None:
            async with asyncio.timeout(timeout):
                while needle not in seen:
                    m = await ws.receive()
                    if m.type == aiohttp.WSMsgType.BINARY:
                        seen.extend(m.data)
                    elif m.type == aiohttp.WSMsgType.TEXT:
                        note = json.loads(m.data)
                        if note.get("state") == "connected":
                            seen.extend(b"<connected>")
                    else:
                        raise RuntimeError(f"socket ended: {m}")

        await until(b"<connected>", 30)
        async with http.post(power, json={"action": "on"}, headers=tech) as r:
            assert r.status == 200, await r.text()
        await until(b"SeaBIOS", 60)
        out["seabios"] = True
        # iPXE from the NIC's ROM tries DHCP (nobody answers here); Ctrl-C typed on the console
        # cancels it at once, and iPXE says so: text that the key itself does not contain.
        await until(b"Configuring (net0", 90)
        mark = len(seen)
        await ws.send_bytes(b"\x03")
        await until(b"canceled", 60)
        out["answer"] = bytes(seen[mark:]).decode(errors="replace")
        await ws.close()
        async with http.post(power, json={"action": "off"}, headers=tech) as r:
            out["off"] = r.status
    await consoles.stop()
    await bmc.stop()
    await server.close()
    print(json.dumps(out))

try:
    asyncio.run(main())
except BaseException as e:
    print("FAILED", type(e).__name__, e, "seen:", bytes(seen[-1500:]), file=sys.stderr)
    raise
"""


BROWSER_SCRIPT = r"""
import asyncio, json, re, sys, tempfile, threading
from pathlib import Path
import requests
from playwright.sync_api import expect
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
from tests.conftest import LAB_BMC_ENV, seed
from tests.ui_browser import artifacts_dir, chromium, login, shoot

address, port, user, password = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
loop = asyncio.new_event_loop()
ready, box = threading.Event(), {}

async def serve():
    tmp = Path(tempfile.mkdtemp())
    cfg = load_config(None, environ={"METALD_STATE_DIR": str(tmp / "state"),
                                     "METALD_STORE__URL": f"sqlite:///{tmp}/m.db", **LAB_BMC_ENV})
    store = Store(cfg.store_url)
    store.migrate()
    secrets = SecretBox.from_file(cfg.secrets_key_path)
    bmc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    consoles = ConsoleService(store, cfg.instance, BmcLinks(bmc, secrets))
    ctx = AppContext(cfg=cfg, store=store, secrets=secrets, bus=EventBus(),
                     services=Services(bmc=bmc, console=consoles))
    box["tokens"] = seed(store)
    runner = web.AppRunner(create_app(ctx), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    box["base"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    box["stop"] = asyncio.Event()
    ready.set()
    await box["stop"].wait()
    await consoles.stop()
    await bmc.stop()
    await runner.cleanup()

def run():
    try:
        loop.run_until_complete(serve())
    except BaseException as e:
        box["error"] = e
        ready.set()

server = threading.Thread(target=run, daemon=True)
server.start()
ready.wait(60)
if "error" in box:
    raise box["error"]
base, tokens = box["base"], box["tokens"]
tech, mid = tokens.header("technician"), tokens.machine_free
body = {"address": address, "port": port, "protocol": "ipmi", "username": user,
        "password": password, "machine_id": mid}
r = requests.post(base + "/api/v1/bmcs", json=body, headers=tech, timeout=30)
assert r.status_code == 201, r.text
power = f"{base}/api/v1/machines/{mid}/power"
r = requests.post(power, json={"action": "off"}, headers=tech, timeout=60)
assert r.status_code == 200, r.text
out = {}
shots = artifacts_dir()
with chromium() as browser:
    page = login(browser, base, tokens.technician)
    try:
        page.goto(f"/ui/machines/{mid}")
        page.get_by_role("button", name="Open console").click()
        expect(page.locator("#console-mode")).to_have_text("you type")
        expect(page.locator("#console-state")).to_have_text(re.compile("^connected"), timeout=30_000)
        r = requests.post(power, json={"action": "on"}, headers=tech, timeout=60)
        assert r.status_code == 200, r.text
        rows = page.locator("#term .xterm-rows")
        expect(rows).to_contain_text("SeaBIOS", timeout=60_000)
        out["seabios"] = True
        expect(rows).to_contain_text("Configuring (net0", timeout=90_000)
        page.locator("#term").click()
        page.keyboard.press("Control+C")
        expect(rows).to_contain_text("Operation canceled", timeout=60_000)
        out["answer"] = rows.inner_text()
    finally:
        out["screenshot"] = str(shoot(page, shots, "console-lab"))
        page.context.close()
r = requests.post(power, json={"action": "off"}, headers=tech, timeout=60)
out["off"] = r.status_code
loop.call_soon_threadsafe(box["stop"].set)
server.join(30)  # the SOL session is closed at the BMC before the process ends
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bios_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    reason = lab_prerequisites()
    if reason:
        pytest.skip(reason)
    rack = vlab.Lab(
        f"t{os.getpid()}c",
        machines=1,
        uefi=0,
        workdir=tmp_path_factory.mktemp("vmlab-console"),
        cpus=1,
    )
    rack.up()
    try:
        yield rack.state
    finally:
        rack.down()


def test_boot_text_arrives_and_typed_keys_reach_ipxe(bios_lab: dict[str, Any]) -> None:
    m = bios_lab["machines"][0]
    bmc = m["bmc"]
    argv = [sys.executable, "-c", SCRIPT, bmc["address"], str(bmc["ipmi_port"])]
    argv += [bmc["username"], bmc["password"]]
    done = in_ns(bios_lab["netns"], argv, timeout=300)
    bmc_log = Path(m["bmc_log"]).read_text(errors="replace")[-1500:]
    assert done.returncode == 0, done.stderr[-1500:] + "\nBMC log:\n" + bmc_log
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["seabios"] and "Operation canceled" in out["answer"], out
    assert out["off"] == 200
    # QEMU still logs the serial port while it is a socket.
    assert "iPXE" in Path(m["serial_log"]).read_text(errors="replace")


def test_console_page_in_a_browser_shows_boot_text_and_sends_keys(
    bios_lab: dict[str, Any],
) -> None:
    """The web console's machine page, in chromium inside the lab: the VM's boot text arrives
    in the xterm through its BMC's SOL, and Ctrl-C typed in the page makes iPXE answer."""
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("needs Debian's chromium (scripts/bootstrap installs it)")
    m = bios_lab["machines"][0]
    bmc = m["bmc"]
    argv = [sys.executable, "-c", BROWSER_SCRIPT, bmc["address"], str(bmc["ipmi_port"])]
    argv += [bmc["username"], bmc["password"]]
    done = in_ns(bios_lab["netns"], argv, timeout=400)
    bmc_log = Path(m["bmc_log"]).read_text(errors="replace")[-1500:]
    assert done.returncode == 0, done.stderr[-3000:] + "\nBMC log:\n" + bmc_log
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("console page screenshot:", out["screenshot"])
    assert out["seabios"] and "Operation canceled" in out["answer"], out
    assert out["off"] == 200
