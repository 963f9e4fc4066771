"""The console page's WebSocket in a fleet: two instances on one store, the BMC owned by one,
the browser's session opened on the other. The session holds no bearer token; the non-owner
carries the WebSocket to the owner's console route with the session's cookie, and the owner
resolves the same session and principal from the shared store (api.ui.live.ConsoleCaller)."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from sqlmodel import select

from metald.config import Config
from metald.store import Store
from metald.store.models import Event
from tests.bmc.test_sol_console_fleet import _instance, both_ways, register_sim_bmc
from tests.bmc.test_sol_ipmi_sim import SolSim, running_sol_sim
from tests.conftest import seed

pytestmark = [
    pytest.mark.skipif(shutil.which("ipmi_sim") is None, reason="needs OpenIPMI's ipmi_sim"),
    # The session reaches the console route as ApiRequest.session, not as a str key on the
    # aiohttp request (which aiohttp warns about): the warning fails the test.
    pytest.mark.filterwarnings("error::aiohttp.web_exceptions.NotAppKeyWarning"),
]


@pytest.fixture
async def sim(tmp_path: Path) -> AsyncIterator[SolSim]:
    async with running_sol_sim(tmp_path) as s:
        yield s


async def _session(http: aiohttp.ClientSession, base: str, token: str, mid: str) -> tuple[str, str]:
    """Log in at /ui/login as a browser would; the session's cookie and its CSRF token."""
    async with http.post(f"{base}/ui/login", data={"token": token}, allow_redirects=False) as r:
        assert r.status == 303, await r.text()
        cookie = r.cookies["metald_ui"].value
    async with http.get(
        f"{base}/ui/machines/{mid}", headers={"Cookie": f"metald_ui={cookie}"}
    ) as r:
        assert r.status == 200, await r.text()
        found = re.search(r'data-csrf="([^"]+)"', await r.text())
    assert found
    return cookie, found.group(1)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the forwarding, not the store
async def test_a_session_console_on_a_non_owner_is_carried_to_the_owner(
    cfg: Config, store: Store, sim: SolSim
) -> None:
    tokens = seed(store)
    owner, fa, sa = await _instance("rack-a", cfg, store, ["127.0.0.0/8"])
    other, fb, sb = await _instance("rack-b", cfg, store, ["192.0.2.0/24"])
    try:
        await fa.refresh()
        await fb.refresh()
        mid = tokens.machine_free
        base = str(other.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as http:
            await register_sim_bmc(http, owner, sim, mid, tokens.header("technician"))

            cookie, csrf = await _session(http, base, tokens.technician, mid)
            url = f"{base}/ui/machines/{mid}/console?csrf={csrf}"
            headers = {"Cookie": f"metald_ui={cookie}", "Origin": base}
            async with http.ws_connect(url, headers=headers) as ws:
                await both_ways(ws, sim, b"via-the-owner", b"typed-in-the-page")
                # The SOL link lives on the owner, attached for the session's own principal.
                assert mid in sa[0].consoles and mid not in sb[0].consoles
                assert [v.actor for v in sa[0].consoles[mid].viewers] == ["technician:technician"]
            with store.session() as s:
                attached = s.exec(
                    select(Event).where(Event.kind == "console.attached", Event.machine_id == mid)
                ).all()
            assert [e.actor for e in attached] == ["technician:technician"]

            # Without the session's CSRF token the non-owner refuses before carrying anything.
            bad = f"{base}/ui/machines/{mid}/console?csrf=wrong"
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(bad, headers=headers)
            assert e.value.status == 403
            # After logout the cookie opens no console, here or (carried) at the owner.
            async with http.post(
                f"{base}/ui/logout",
                data={"csrf": csrf},
                headers={**headers},
                allow_redirects=False,
            ) as r:
                assert r.status == 303
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(url, headers=headers)
            assert e.value.status == 401
    finally:
        for f, services, server in ((fb, sb, other), (fa, sa, owner)):
            for s in services:
                await s.stop()
            await f.stop()
            await server.close()
