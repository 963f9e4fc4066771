"""Issue 31, the operator's day, in a real browser (Debian's chromium, Playwright) against a
real metald: the machine page's actions follow the machine's state and BMC and act in place;
sizes read in human units; ten tabs share one event stream, freed when they close."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from playwright.sync_api import expect

from api.ui import live
from metald import machines
from metald.lifecycle import Trigger
from tests.api_helpers import LoopbackApi
from tests.conftest import Tokens
from tests.ui.conftest import serve
from tests.ui_browser import axe_violations, open_as, shoot

DISK_INVENTORY = {
    "schema_version": 1,
    "normalized": {
        "disks": [
            {"name": "vda", "model": "QEMU HARDDISK", "size_bytes": 2_000_000_000},
            {"name": "nvme0n1", "model": "PM1733", "size_bytes": 3_840_000_000_000},
        ]
    },
}


def fleet(_cfg: Any, store: Any, tokens: Tokens) -> None:
    """Three ready machines in rack r3 (each with a 2 GB and a 3.84 TB disk); the seed's node0
    (acme's) in a claim, waiting on a BMC it does not have (``provision.no-bmc``)."""
    from metald.store.models import Claim, Machine

    with store.session() as s:
        claim = Claim(tenant_id=tokens.tenant_a, count=1, state="allocated", created_by="test")
        s.add(claim)
        s.commit()
        node0 = s.get(Machine, tokens.machine_a)
        assert node0 is not None
        node0.claim_id = claim.id
        s.add(node0)
        s.commit()
        machines.add_event(
            s,
            "provision.no-bmc",
            "metald",
            machine_id=node0.id,
            reason="no BMC registered: power it on into PXE by hand, or register its BMC",
        )
        s.commit()
        for i in range(3):
            m = machines.create_machine(
                s,
                macs=[f"52:54:00:bb:00:{i:02x}"],
                actor="test",
                name=f"r3-{i:02d}",
                rack="r3",
                rack_position=f"u{i + 1}",
            )
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            machines.transition(
                s,
                m.id,
                Trigger.INSPECTED,
                actor="test",
                updates={"inventory": DISK_INVENTORY, "memory_mb": (16384, 32768, 8192)[i]},
            )


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackApi]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(live, "RECHECK_S", 0.2)
        with serve(tmp_path_factory.mktemp("ui-day"), fleet) as a:
            yield a


@pytest.fixture(scope="module")
def tokens(app: LoopbackApi) -> Tokens:
    assert app.tokens is not None
    return app.tokens


def machine_id(app: LoopbackApi, name: str) -> str:
    from sqlmodel import select

    from metald.store.models import Machine

    with app.store.session() as s:
        return s.exec(select(Machine.id).where(Machine.name == name)).one()


def buttons(page: Any) -> list[str]:
    return page.locator("#m-actions form.act button, #m-actions summary").all_inner_texts()


def test_machine_page_offers_what_the_state_and_bmc_allow_and_acts_in_place(
    browser, app, tokens, shots
) -> None:  # type: ignore[no-untyped-def]
    """A ready machine without a BMC: no power or "maintenance off" (item 5: the page offered
    the same six buttons whatever the state); the missing actions are there; maintenance on
    is confirmed in a dialog naming the machine, and the page does not navigate (item 14: it
    went to /ui/machines/bulk)."""
    mid = machine_id(app, "r3-00")
    page = open_as(browser, app.base, tokens.technician, f"/ui/machines/{mid}")
    offered = buttons(page)
    for want in (
        "Inspect",
        "Commission",
        "Maintenance on",
        "Mark broken",
        "Retire",
        "Rename",
        "Set labels",
        "Register its BMC",
    ):
        assert want in offered, offered
    for never in ("Maintenance off", "Power on", "Power off", "Power cycle", "Repair"):
        assert never not in offered, offered
    expect(page.get_by_role("button", name="Open console")).to_have_count(0)  # no BMC
    page.evaluate("window.scrollTo(0, 200); window.stayed = 'here'")
    page.get_by_role("button", name="Maintenance on").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text("Maintenance on r3-00?")
    dialog.get_by_label("Reason").fill("reseat the riser")
    dialog.get_by_role("button", name="Confirm").click()
    expect(page.locator("#act-status")).to_contain_text("maintenance on: done on r3-00")
    expect(page.locator("#m-state")).to_have_text("maintenance")
    expect(page.locator("#act-status")).to_contain_text("maintenance on: done on r3-00")
    assert page.evaluate("window.stayed") == "here"  # no navigation: same document
    assert page.url.endswith(f"/ui/machines/{mid}")
    offered = buttons(page)
    assert "Maintenance off" in offered and "Maintenance on" not in offered, offered
    # Rename and labels, in place too.
    page.locator("summary", has_text="Rename").click()
    page.get_by_label("New name").fill("r3-00-gpu")
    page.get_by_role("button", name="Rename").click()
    expect(page.locator("#act-status")).to_contain_text("rename: done on r3-00-gpu")
    page.locator("summary", has_text="Set labels").click()
    page.get_by_label("Labels (key=value").fill("pool=red, owner=ops")
    page.get_by_role("button", name="Set labels").click()
    expect(page.locator("#act-status")).to_contain_text("set labels: done")
    assert page.evaluate("window.stayed") == "here"
    # A refusal shows the API's sentence, in place.
    csrf = page.locator("body").get_attribute("data-csrf")
    r = page.request.post(
        f"/ui/machines/{mid}/act",
        form={"csrf": csrf, "action": "retire"},
        headers={"Origin": app.base, "Accept": "application/json"},
    )
    assert r.status == 428 and "r3-00-gpu" in r.json()["detail"]
    shoot(page, shots, "machine-actions", full=True)
    assert axe_violations(page) == []
    page.context.close()


def test_disk_sizes_read_in_human_units(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    """ "vda: 0.0 TB" for a 2 GB disk before (item 14)."""
    page = open_as(browser, app.base, tokens.technician, f"/ui/machines/{machine_id(app, 'r3-01')}")
    disks = page.locator("#h-inv ~ ul li")
    expect(disks.nth(0)).to_contain_text("vda: QEMU HARDDISK 2.0 GB")
    expect(disks.nth(1)).to_contain_text("3.84 TB")
    expect(page.locator("#h-inv + p")).to_contain_text("32 GiB memory")
    page.goto("/ui/?rack=r3")
    row = page.locator("#fleet tbody tr", has_text="r3-01")
    expect(row.locator("td[data-col=disks]")).to_have_text("3.84 TB (2)")
    page.context.close()


def test_ten_tabs_share_one_event_stream_freed_when_they_close(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    """Ten tabs of one session: each is live (9 of 10 got 429 and "reconnecting" with a
    stream each, the API's cap being 8 per token), on one stream; it is freed at once when
    the tabs close (item 6)."""
    bus = app.ctx.bus
    deadline = time.monotonic() + 5
    while bus.streams and time.monotonic() < deadline:  # earlier tests' tabs
        time.sleep(0.05)
    assert bus.streams == 0
    first = open_as(browser, app.base, tokens.technician, "/ui/")
    ctx = first.context
    pages = [first] + [ctx.new_page() for _ in range(9)]
    for p in pages[1:]:
        p.goto("/ui/events")
    for p in pages:
        expect(p.locator("#live")).to_have_text("on")
    assert bus.streams == 1, [(s.token_id, s.closed) for s in bus._subs]
    # Live still: an action shows in every events tab.
    pages[1].goto("/ui/events?machine_id=r3-02")
    expect(pages[1].locator("#live")).to_have_text("on")
    r = requests.patch(
        f"{app.base}/api/v1/machines/r3-02/labels",
        json={"labels": {"seen": "yes"}},
        headers={"Authorization": f"Bearer {tokens.admin}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    for p in pages[1:]:
        expect(p.locator("#tail li").first).to_contain_text("machine.labels")
    ctx.close()
    deadline = time.monotonic() + 5
    while bus.streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bus.streams == 0


def test_fleet_sorts_groups_keeps_the_view_in_its_link_and_says_nothing_matches(
    browser, app, tokens, shots
) -> None:  # type: ignore[no-untyped-def]
    """Item 10: sortable columns, grouping with counts, the view in the URL, "nothing
    matches"; item 7: the maintenance reason in the fleet table (none of it before)."""
    r = requests.post(
        f"{app.base}/api/v1/machines/r3-02/actions",
        json={"action": "maintenance-on", "reason": "PSU swap"},
        headers={"Authorization": f"Bearer {tokens.admin}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    page = open_as(browser, app.base, tokens.technician, "/ui/?rack=r3")
    names = page.locator("#fleet tbody td[data-col=name]")
    page.get_by_role("link", name="Memory").click()
    expect(names).to_have_text(["r3-02", re.compile("^r3-00"), "r3-01"])
    assert "sort=memory" in page.url and "rack=r3" in page.url
    page.get_by_role("link", name="Memory ▲").click()
    expect(names).to_have_text(["r3-01", re.compile("^r3-00"), "r3-02"])
    assert "sort=-memory" in page.url
    expect(
        page.locator("#fleet tbody tr", has_text="r3-02").locator("td[data-col=why]")
    ).to_have_text("PSU swap")
    # Grouped by state, with counts; the link keeps the view (reload: the same page).
    page.get_by_label("Group by").select_option("state")
    page.get_by_role("button", name="Apply").click()
    groups = page.locator("#fleet tbody tr.group")
    expect(groups).to_have_count(2)
    # r3-00 went to maintenance in the machine page's test.
    expect(groups.nth(0)).to_have_text(re.compile(r"maintenance \(2 machines\)"))
    expect(groups.nth(1)).to_have_text(re.compile(r"ready \(1 machine\)"))
    page.reload()
    expect(groups).to_have_count(2)
    shoot(page, shots, "fleet-grouped")
    assert axe_violations(page) == []
    page.goto("/ui/?q=no-such-machine-anywhere")
    expect(page.locator("#fleet tbody tr.nothing")).to_contain_text("Nothing matches these filters")
    page.context.close()


def test_rack_view_draws_racks_coloured_and_clickable(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    """Item 10: racks as elevations, each machine in its unit coloured by state (or power, or
    GPU health), a link to its page (no rack view before: 404)."""
    page = open_as(browser, app.base, tokens.technician, "/ui/racks")
    rack = page.get_by_role("region", name=re.compile("^r3"))
    slots = rack.locator("a.slot")
    expect(slots).to_have_count(3)
    unit1 = rack.get_by_role("link", name=re.compile(r", unit 1: "))
    expect(unit1).to_have_class(re.compile(r"\bs-(ready|maintenance)\b"))
    expect(
        rack.get_by_role("link", name=re.compile(r"^r3-02, unit 3: (ready|maintenance), power"))
    ).to_be_visible()
    assert axe_violations(page) == []
    shoot(page, shots, "racks")
    page.get_by_label("Colour by").select_option("power")
    page.get_by_role("button", name="Apply").click()
    expect(page.locator("#racks")).to_have_class(re.compile("by-power"))
    rack.get_by_role("link", name=re.compile(r"^r3-01, unit 2")).click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("r3-01")
    page.context.close()


def test_claims_say_what_a_machine_waits_on_and_name_the_tenant(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    """Item 7: a claim's blocking event on the claims page, the tenant by name (its id's
    first 8 characters before), token scopes by name."""
    page = open_as(browser, app.base, tokens.admin, "/ui/claims")
    claim = page.locator("#claims section.claim").first
    expect(claim).to_contain_text("tenant acme")
    expect(claim.locator("li", has_text="node0")).to_contain_text(
        "waits on provision.no-bmc: no BMC registered"
    )
    assert axe_violations(page) == []
    page.goto("/ui/tokens")
    expect(page.get_by_role("row", name=re.compile("^orchestrator orchestrator "))).to_contain_text(
        "acme"
    )
    page.context.close()
