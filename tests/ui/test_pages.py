"""The web console in a real browser (Debian's chromium, Playwright) against a real metald:
login, the fleet and its live updates, search and filters, a confirmed bulk action, the
machine page with a fixture inventory's GPUs, roles and scopes, CSRF, logout and revocation,
and axe-core on every page."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import expect

from api.ui import live
from metald import machines
from metald.inventory import validate_inventory
from metald.lifecycle import Trigger
from metald.store.models import Claim, Machine
from tests.api_helpers import LoopbackApi
from tests.conftest import Tokens
from tests.inventory.conftest import fixture_text, payload
from tests.inventory.fakesys import parse_lspci_nn
from tests.ui.conftest import serve
from tests.ui_browser import axe_violations, login, open_as, shoot

A100_LSPCI = "lspci-nn_8x-a100-sxm4-80gb_nvswitch_cx6-vf.txt"
A100_XML = "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
#: GPUs metald finds in those captures: the 8 of lspci, and the nvidia-smi capture's one, which
#: sits on a bus address lspci's host does not have (the captures come from two servers).
GPUS = 9
LLDP = "lldp.eno1.via=LLDP\nlldp.eno1.chassis.name=leaf-r12\nlldp.eno1.port.ifname=Ethernet17\n"


def a100_inventory() -> dict[str, Any]:
    """The inventory document metald keeps for a server whose agent posted the A100 captures."""
    devices = parse_lspci_nn(fixture_text(A100_LSPCI))
    pci = [
        {"address": a, "vendor": f"0x{v:04x}", "device": f"0x{d:04x}", "class": f"0x{c:04x}00"}
        for a, v, d, c in devices
    ]
    body = payload(pci=pci, raw={"nvidia_smi_xml": fixture_text(A100_XML), "lldpctl": LLDP})
    return validate_inventory(body, token_machine_id=body["machine_id"], stored=None).document


def fleet(_cfg: Any, store: Any, _tokens: Tokens) -> None:
    """Beside the seed's node0 (tenant acme), node1 (globex) and node2 (free): a rack of six
    ready machines and one with the A100 fixture inventory."""
    inv = a100_inventory()
    norm = inv["normalized"]
    with store.session() as s:
        for i in range(6):
            m = machines.create_machine(
                s,
                macs=[f"52:54:00:aa:00:{i:02x}"],
                actor="test",
                name=f"r7-{i:02d}",
                rack="r7",
                rack_position=f"u{i + 1}",
                labels={"pool": "blue" if i < 3 else "green"},
            )
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            machines.transition(
                s,
                m.id,
                Trigger.INSPECTED,
                actor="test",
                updates={"inventory": {"schema_version": 1}, "memory_mb": 524288},
            )
        # node0 (acme's) provisions for a claim: the claims page shows its progress.
        claim = Claim(tenant_id=_tokens.tenant_a, count=1, state="allocated", created_by="test")
        s.add(claim)
        s.commit()
        node0 = s.get(Machine, _tokens.machine_a)
        assert node0 is not None
        node0.claim_id = claim.id
        s.add(node0)
        s.commit()
        m = machines.create_machine(
            s, macs=["aa:bb:cc:00:11:22"], actor="test", name="gpu-a100", rack="r9"
        )
        machines.transition(s, m.id, Trigger.INSPECT, actor="test")
        machines.transition(
            s,
            m.id,
            Trigger.INSPECTED,
            actor="test",
            updates={
                "inventory": inv,
                "gpu_model": norm["gpu_model"],
                "gpu_count": norm["gpu_count"],
                "memory_mb": norm["memory_mb"],
                "serial": norm["serial"],
            },
        )


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackApi]:
    # Open streams re-check their session every 0.2 s instead of 2 s: the revocation test
    # waits on the stream's end, not on a fixed interval.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(live, "RECHECK_S", 0.2)
        with serve(tmp_path_factory.mktemp("ui"), fleet) as a:
            yield a


@pytest.fixture(scope="module")
def tokens(app: LoopbackApi) -> Tokens:
    assert app.tokens is not None
    return app.tokens


def api(app: LoopbackApi, token: str, method: str, path: str, **kw: Any) -> requests.Response:
    return requests.request(
        method, app.base + path, headers={"Authorization": f"Bearer {token}"}, timeout=10, **kw
    )


def machine_id(app: LoopbackApi, name: str) -> str:
    with app.store.session() as s:
        from sqlmodel import select

        return s.exec(select(Machine.id).where(Machine.name == name)).one()


def state(app: LoopbackApi, name: str) -> str:
    with app.store.session() as s:
        from sqlmodel import select

        return s.exec(select(Machine.state).where(Machine.name == name)).one()


def rows(page: Any) -> list[str]:
    return page.locator("#fleet tbody td[data-col=name]").all_inner_texts()


def test_login_and_the_fleet_lists_the_machines(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = login(browser, app.base, tokens.technician)
    assert rows(page) == ["gpu-a100", "node0", "node1", "node2", *[f"r7-{i:02d}" for i in range(6)]]
    gpu_row = page.locator("tr", has_text="gpu-a100")
    expect(gpu_row.locator("td[data-col=gpu]")).to_have_text(f"NVIDIA A100-SXM4-80GB × {GPUS}")
    expect(page.locator("[data-count=ready]")).to_have_text("8")
    # The session cookie: HttpOnly, SameSite=Strict, only under /ui, and not the token.
    (cookie,) = page.context.cookies()
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/ui")
    assert tokens.technician not in cookie["value"]
    shoot(page, shots, "fleet")
    assert axe_violations(page) == []
    page.context.close()


def test_a_state_change_through_the_api_appears_without_reload(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    expect(page.locator("#live")).to_have_text("on")
    page.evaluate("window.__sameDocument = true")
    mid = machine_id(app, "r7-05")
    cell = page.locator(f'tr[data-id="{mid}"] td[data-col=state] .state')
    expect(cell).to_have_text("ready")
    started = time.monotonic()
    r = api(
        app,
        tokens.admin,
        "POST",
        f"/api/v1/machines/{mid}/actions",
        json={"action": "mark-broken", "reason": "PSU smoke"},
    )
    assert r.status_code == 200, r.text
    expect(cell).to_have_text("broken")
    print(f"row updated {time.monotonic() - started:.2f} s after the API call")
    assert page.evaluate("window.__sameDocument") is True  # no reload happened
    expect(page.locator("[data-count=broken]")).to_have_text("1")
    page.context.close()


def test_search_and_filters(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    search = page.get_by_role("search").get_by_label("Search", exact=True)
    search.fill("52:54:00:00:00:02")  # node1's MAC
    search.press("Enter")
    page.wait_for_url("**q=*")
    assert rows(page) == ["node1"]
    search.fill("HSR8X04")  # the fixture server's serial
    search.press("Enter")
    expect(page.locator("#fleet tbody tr")).to_have_count(1)
    assert rows(page) == ["gpu-a100"]
    page.goto("/ui/")
    page.get_by_role("search").get_by_label("Rack", exact=True).select_option("r7")
    page.get_by_role("search").get_by_label("Label", exact=True).fill("pool=green")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url("**rack=r7*")
    assert rows(page) == ["r7-03", "r7-04", "r7-05"]
    page.goto("/ui/")
    page.get_by_role("search").get_by_label("GPU model", exact=True).select_option(
        "NVIDIA A100-SXM4-80GB"
    )
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url("**gpu_model=*")
    assert rows(page) == ["gpu-a100"]
    page.goto("/ui/")
    page.get_by_role("search").get_by_label("Tenant", exact=True).select_option(label="acme")
    page.get_by_role("button", name="Apply").click()
    page.wait_for_url("**tenant=*")
    assert rows(page) == ["node0"]
    # Hidden columns are remembered by this browser.
    page.get_by_text("Columns", exact=True).click()
    page.get_by_label("Firmware").uncheck()
    page.reload()
    expect(page.locator("th[data-col=firmware]")).to_be_hidden()
    page.context.close()


def test_bulk_maintenance_is_confirmed_first(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    for name in ("r7-00", "r7-01"):
        page.get_by_label(f"Select {name}").check()
    expect(page.locator("#selected")).to_have_text("2 selected")
    page.get_by_role("button", name="maintenance on").click()
    dialog = page.get_by_role("dialog")
    # The dialog names the machines (issue 31 item 5; it said "on 2 machines?").
    expect(dialog).to_contain_text("maintenance on on 2 machines: r7-00, r7-01?")
    shoot(page, shots, "bulk-confirm")
    dialog.get_by_role("button", name="Cancel").click()
    assert (state(app, "r7-00"), state(app, "r7-01")) == ("ready", "ready")
    page.get_by_role("button", name="maintenance on").click()
    dialog.get_by_label("Reason").fill("reseat GPUs")
    dialog.get_by_role("button", name="Confirm").click()
    expect(page.locator("#bulk-status")).to_have_text("2 machines done.")
    # The page stays where it was (it navigated to /ui/machines/bulk before).
    assert page.url == app.base + "/ui/"
    assert (state(app, "r7-00"), state(app, "r7-01")) == ("maintenance", "maintenance")
    r = api(
        app, tokens.admin, "GET", f"/api/v1/events?machine_id={machine_id(app, 'r7-00')}&sort=-id"
    )
    assert r.json()["items"][0]["reason"] == "reseat GPUs"
    assert r.json()["items"][0]["actor"] == "technician:technician"
    # Without the confirmation the server refuses a destructive action, whatever the page does.
    csrf = page.locator("body").get_attribute("data-csrf")
    resp = page.request.post(
        "/ui/machines/bulk",
        form={"csrf": csrf, "action": "mark-broken", "id": machine_id(app, "r7-02"), "reason": "x"},
        headers={"Origin": app.base, "Accept": "application/json"},
    )
    assert resp.status == 428
    assert "confirm it in the dialog" in resp.json()["detail"]
    assert state(app, "r7-02") == "ready"
    page.context.close()


def test_machine_page_shows_the_fixture_inventory_gpus(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    page.get_by_role("link", name="gpu-a100").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("gpu-a100")
    gpus = page.locator("table.gpus tbody tr")
    expect(gpus).to_have_count(GPUS)
    first = gpus.filter(has_text="0000:01:00.0")
    expect(first).to_contain_text("NVIDIA A100-SXM4-80GB")
    expect(first).to_contain_text("10de:20b2")
    expect(first).to_contain_text("1650522003820")  # serial from nvidia-smi
    expect(first).to_contain_text("GPU-513536b6-7d19-9063-b049-1e69664bb298")
    expect(page.get_by_role("row", name="aa:bb:cc:00:11:22")).to_contain_text("leaf-r12 Ethernet17")
    expect(page.locator("#timeline li").first).to_contain_text("inspecting → ready")
    shoot(page, shots, "machine", full=True)
    assert axe_violations(page) == []
    page.context.close()


def test_technician_gets_no_tokens_page_and_admin_does(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    nav = page.get_by_role("navigation", name="Sections")
    expect(nav.get_by_role("link", name="Tokens")).to_have_count(0)
    resp = page.goto("/ui/tokens")
    assert resp is not None and resp.status == 403
    expect(page.locator(".problem .detail")).to_have_text(
        "a technician token cannot list tokens; this needs one of: admin"
    )
    shoot(page, shots, "refused")
    page.context.close()
    page = open_as(browser, app.base, tokens.admin)
    page.get_by_role("navigation", name="Sections").get_by_role("link", name="Tokens").click()
    expect(page.get_by_role("cell", name="technician").first).to_be_visible()
    assert axe_violations(page) == []
    page.context.close()


def test_orchestrator_sees_only_its_tenant(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.orchestrator)
    assert rows(page) == ["node0"]
    assert page.locator("#bulk").count() == 0  # no fleet actions for an orchestrator
    resp = page.goto(f"/ui/machines/{tokens.machine_b}")
    assert resp is not None and resp.status == 404
    page.goto("/ui/tenants")
    expect(page.get_by_role("heading", name="acme")).to_be_visible()
    expect(page.get_by_role("heading", name="globex")).to_have_count(0)
    resp = page.goto(f"/ui/fleet/rows?id={tokens.machine_b}&id={tokens.machine_a}")
    assert resp is not None and list(resp.json()["rows"]) == [tokens.machine_a]
    page.context.close()


def test_a_post_without_the_csrf_token_is_refused(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    mid = machine_id(app, "r7-03")
    form = {"action": "maintenance-on", "id": mid, "reason": "x", "confirm": "yes"}
    json_accept = {"Accept": "application/json", "Origin": app.base}
    resp = page.request.post("/ui/machines/bulk", form=form, headers=json_accept)
    assert resp.status == 403
    assert resp.json()["title"] == "CSRF token missing or wrong"
    resp = page.request.post(
        "/ui/machines/bulk", form={**form, "csrf": "x" * 43}, headers=json_accept
    )
    assert resp.status == 403
    csrf = page.locator("body").get_attribute("data-csrf")
    evil = {"Accept": "application/json", "Origin": "http://evil.example"}
    resp = page.request.post("/ui/machines/bulk", form={**form, "csrf": csrf}, headers=evil)
    assert resp.status == 403 and resp.json()["title"] == "Cross-site request refused"
    assert state(app, "r7-03") == "ready"
    page.context.close()


def test_logout_and_revocation_end_the_session(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = login(browser, app.base, tokens.technician)
    (cookie,) = page.context.cookies()
    page.get_by_role("button", name="Log out").click()
    page.wait_for_url("**/ui/login")
    page.goto("/ui/")
    assert "/ui/login" in page.url
    # The server forgot the session: the old cookie, sent again, opens nothing.
    again = requests.get(
        app.base + "/ui/",
        cookies={cookie["name"]: cookie["value"]},
        headers={"Accept": "application/json"},
        timeout=10,
    )
    assert again.status_code == 401
    page.context.close()
    r = api(
        app, tokens.admin, "POST", "/api/v1/tokens", json={"name": "shift", "role": "technician"}
    )
    assert r.status_code == 201, r.text
    token = r.json()
    page = open_as(browser, app.base, token["token"])
    expect(page.locator("#live")).to_have_text("on")
    assert api(app, tokens.admin, "DELETE", f"/api/v1/tokens/{token['id']}").status_code in (
        200,
        204,
    )
    # The open page's live stream ends, and the next request goes to the login page.
    expect(page.locator("#live")).to_have_text("session ended: log in again")
    page.goto("/ui/")
    assert "/ui/login" in page.url
    page.context.close()


def test_every_page_passes_axe_and_is_captured(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.admin)
    found: dict[str, list[dict[str, Any]]] = {}
    for name, path in [
        ("claims", "/ui/claims"),
        ("tenants", "/ui/tenants"),
        ("events", "/ui/events"),
        ("firmware", "/ui/firmware"),
        ("instances", "/ui/instances"),
        ("topology", "/ui/topology"),
        ("tokens", "/ui/tokens"),
    ]:
        resp = page.goto(path)
        assert resp is not None and resp.status == 200, path
        shoot(page, shots, name)
        found[name] = axe_violations(page)
    page.context.close()
    ctx = browser.new_context(base_url=app.base, bypass_csp=True)
    login_page = ctx.new_page()
    login_page.goto("/ui/login")
    shoot(login_page, shots, "login")
    found["login"] = axe_violations(login_page)
    ctx.close()
    assert found == {k: [] for k in found}


def test_claim_progress_moves_live(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.orchestrator, "/ui/claims")
    expect(page.locator("#live")).to_have_text("on")
    bar = page.get_by_role("progressbar", name="node0 progress")
    expect(bar).to_have_attribute("value", "0")
    page.evaluate("window.__sameDocument = true")
    with app.store.session() as s:  # what the provisioning agent's progress post records
        machines.add_event(
            s,
            "provision.progress",
            "agent:node0",
            machine_id=tokens.machine_a,
            tenant_id=tokens.tenant_a,
            data={"phase": "image", "percent": 40.0},
        )
        s.commit()
    expect(bar).to_have_attribute("value", "40")
    expect(page.locator("[data-claim]")).to_contain_text("(image)")
    assert page.evaluate("window.__sameDocument") is True
    shoot(page, shots, "claims-progress")
    page.context.close()


def test_events_page_tails_live(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician, "/ui/events?kind=machine.labels")
    expect(page.locator("#live")).to_have_text("on")
    mid = machine_id(app, "r7-04")
    r = api(
        app, tokens.admin, "PATCH", f"/api/v1/machines/{mid}/labels", json={"labels": {"x": "1"}}
    )
    assert r.status_code == 200, r.text
    expect(page.locator("#tail li").first).to_contain_text("machine.labels")
    page.context.close()


__all__ = ["Path"]


def test_new_machines_appear_live_within_the_page_filters(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician, "/ui/?rack=r7")
    expect(page.locator("#live")).to_have_text("on")
    page.evaluate("window.__sameDocument = true")
    assert rows(page) == [f"r7-{i:02d}" for i in range(6)]

    def added(resp: Any) -> bool:
        return "/ui/fleet/rows" in resp.url and "add=" in resp.url

    # Another rack's new machine: the page asks for it with its own filters and gets nothing.
    with page.expect_response(added) as other:
        r = api(
            app,
            tokens.admin,
            "POST",
            "/api/v1/machines",
            json={"macs": ["52:54:00:bb:00:01"], "name": "r8-new", "rack": "r8"},
        )
        assert r.status_code == 201, r.text
    assert "rack=r7" in other.value.url and other.value.json()["added"] == []
    # This rack's new machine appears in name order, without a reload.
    r = api(
        app,
        tokens.admin,
        "POST",
        "/api/v1/machines",
        json={"macs": ["52:54:00:bb:00:02"], "name": "r7-02b", "rack": "r7"},
    )
    assert r.status_code == 201, r.text
    expect(page.locator("#fleet tbody td[data-col=name]")).to_have_count(7)
    assert rows(page) == ["r7-00", "r7-01", "r7-02", "r7-02b", "r7-03", "r7-04", "r7-05"]
    assert page.evaluate("window.__sameDocument") is True
    page.context.close()


def test_live_additions_come_from_the_scoped_query(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    """The rows endpoint answers a machine only through the page's scoped, filtered query:
    an orchestrator asking for a machine outside its tenants gets nothing."""
    page = open_as(browser, app.base, tokens.orchestrator)

    def ask(query: str) -> list[str]:
        got = page.evaluate(
            "async (q) => (await (await fetch('/ui/fleet/rows?' + q,"
            " {headers: {Accept: 'application/json'}})).json()).added.map((a) => a.id)",
            query,
        )
        return list(got)

    assert ask(f"add={tokens.machine_free}&add={tokens.machine_b}") == []
    assert ask(f"add={tokens.machine_a}&add={tokens.machine_free}") == [tokens.machine_a]
    assert ask(f"add={tokens.machine_a}&state=broken") == []  # filters apply too
    page.context.close()
