"""The repair queue page in a real browser (Debian's chromium, Playwright) against a real
metald: machine, rack position, fault, evidence, the part (a GPU by PCI address and serial
from the inventory, a DIMM slot from the SEL record), who took it; take, note, repaired and
release through the API's routes; an orchestrator gets neither the link nor the page; axe-core."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from playwright.sync_api import expect
from sqlmodel import select

from metald import machines, repairs
from metald.lifecycle import Trigger
from metald.store.models import Repair
from tests.api_helpers import LoopbackApi
from tests.conftest import Tokens
from tests.ui.conftest import serve
from tests.ui.test_pages import a100_inventory
from tests.ui_browser import axe_violations, open_as, shoot

XID = "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
SEL = "#41 2026-12-06T10:00:00+00:00 critical Memory CPU2_DIMM_C1 Uncorrectable ECC"


def queue(_cfg: Any, store: Any, tokens: Tokens) -> None:
    """Two machines in rack r9 with the A100 inventory, in the queue: one from a remediation
    (XID 79 on the GPU at 0000:01:00.0), one from its BMC's SEL (a DIMM); and tenant acme's
    node0 opened by an admin (nobody may take it while the claim holds it)."""
    inv = a100_inventory()
    at = datetime(2026, 12, 6, 10, 0, 5)
    with store.session() as s:
        ids = []
        for i in range(2):
            m = machines.create_machine(
                s, macs=[f"52:54:00:bb:00:{i:02x}"], actor="test", name=f"r9-{i:02d}",
                rack="r9", rack_position=f"leaf-r9/Eth1/{i + 3}",
            )  # fmt: skip
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            machines.transition(
                s, m.id, Trigger.INSPECTED, actor="test", updates={"inventory": inv}
            )
            ids.append(m.id)
        repairs.open_repair(
            s, ids[0], source="remediation", actor="metald:remediation", remediation_id="rem-7",
            faults=[{"kind": "xid", "subject": "00000000:01:00.0", "code": "79",
                     "severity": "fatal", "witness": "node", "evidence": XID, "first_seen": at,
                     "why": "GPU fallen off the bus"}],
        )  # fmt: skip
        repairs.open_repair(
            s, ids[1], source="remediation", actor="metald:remediation", remediation_id="rem-8",
            faults=[{"kind": "sel", "subject": "bmc", "code": "critical: uncorrectable ecc",
                     "severity": "fatal", "witness": "bmc", "evidence": SEL, "first_seen": at,
                     "part": "dimm", "why": "uncorrectable memory ECC"}],
        )  # fmt: skip
        repairs.open_repair(
            s, tokens.machine_a, source="technician", actor="admin:admin",
            faults=[{"kind": "technician", "subject": "psu", "code": "reported",
                     "severity": "fatal", "witness": "technician", "evidence": "PSU2 is dark",
                     "part": "psu", "why": "PSU2 is dark"}],
        )  # fmt: skip


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackApi]:
    with serve(tmp_path_factory.mktemp("ui-repairs"), queue) as a:
        yield a


@pytest.fixture(scope="module")
def tokens(app: LoopbackApi) -> Tokens:
    assert app.tokens is not None
    return app.tokens


def _row(page: Any, name: str) -> Any:
    return page.locator("tr", has=page.get_by_role("link", name=name, exact=True))


def test_the_queue_shows_the_part_and_acts_through_the_api(browser, app, tokens, shots) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.technician)
    page.get_by_role("navigation", name="Sections").get_by_role("link", name="Repairs").click()
    expect(page.get_by_role("heading", name="Repairs")).to_be_visible()
    gpu = _row(page, "r9-00")
    expect(gpu).to_contain_text("leaf-r9/Eth1/3")
    expect(gpu).to_contain_text("fatal xid on 00000000:01:00.0: GPU fallen off the bus")
    expect(gpu).to_contain_text(
        "GPU at PCI 0000:01:00.0, serial 1650522003820, NVIDIA A100-SXM4-80GB"
    )
    gpu.get_by_text("1 record").click()
    expect(gpu.locator(".evidence")).to_contain_text("GPU has fallen off the bus")
    dimm = _row(page, "r9-01")
    expect(dimm).to_contain_text("DIMM slot CPU2_DIMM_C1")
    expect(dimm.get_by_role("button", name="Take")).to_be_visible()
    expect(_row(page, "node0")).to_contain_text("PSU2 is dark")
    shoot(page, shots, "repairs", full=True)
    assert axe_violations(page) == []

    # Take: the machine goes to repairing; the row says who.
    gpu.get_by_role("button", name="Take").click()
    expect(page.get_by_role("status")).to_have_text("Done: take r9-00")
    gpu = _row(page, "r9-00")
    expect(gpu).to_contain_text("technician:technician")
    expect(gpu).to_contain_text("repairing")
    gpu.get_by_label("Note on r9-00").fill("reseated the GPU in slot 1")
    gpu.get_by_role("button", name="Note").click()
    gpu = _row(page, "r9-00")
    gpu.get_by_text("1 note").click()
    expect(gpu).to_contain_text("technician:technician: reseated the GPU in slot 1")
    # Repaired with no commissioning profile: the API's sentence, nothing changed.
    gpu.get_by_role("button", name="Repaired").click()
    expect(page.get_by_role("alert")).to_contain_text("commissioning profile")
    expect(_row(page, "r9-00")).to_contain_text("taken")
    # A tenant's machine: the API's refusal, shown on the page.
    _row(page, "node0").get_by_role("button", name="Take").click()
    expect(page.get_by_role("alert")).to_contain_text("belongs to a tenant")
    shoot(page, shots, "repairs-refused", full=True)
    page.goto("/ui/repairs?status=taken")
    assert page.locator("tbody tr").count() == 1
    # The machine's page names its repair and links to it.
    page.get_by_role("link", name="r9-00", exact=True).click()
    expect(page.locator("#h-summary + dl")).to_contain_text(
        "taken by technician:technician: fatal xid on 00000000:01:00.0"
    )
    page.get_by_role("link", name="taken by technician:technician").click()
    assert page.locator("tbody tr").count() == 1
    # Release: back in the queue for anyone, the machine broken again.
    page.goto("/ui/repairs")
    _row(page, "r9-00").get_by_role("button", name="Release").click()
    expect(page.get_by_role("status")).to_have_text("Done: release r9-00")
    gpu = _row(page, "r9-00")
    expect(gpu).to_contain_text("broken")
    expect(gpu.get_by_role("button", name="Take")).to_be_visible()
    page.context.close()
    with app.store.session() as s:
        assert {r.status for r in s.exec(select(Repair))} == {"open"}


def test_an_orchestrator_gets_no_repairs(browser, app, tokens) -> None:  # type: ignore[no-untyped-def]
    page = open_as(browser, app.base, tokens.orchestrator)
    nav = page.get_by_role("navigation", name="Sections")
    expect(nav.get_by_role("link", name="Repairs")).to_have_count(0)
    resp = page.goto("/ui/repairs")
    assert resp is not None and resp.status == 403
    csrf = page.locator("body").get_attribute("data-csrf")
    with app.store.session() as s:
        rid = next(r.id for r in s.exec(select(Repair)) if r.machine_id == tokens.machine_a)
    resp = page.request.post(
        f"/ui/repairs/{rid}/take",
        form={"csrf": csrf},
        headers={"Origin": app.base},
        max_redirects=0,
    )
    assert resp.status == 403
    page.context.close()
