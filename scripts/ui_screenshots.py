#!/usr/bin/env python3
"""Screenshots of the web console for docs/ui.md: the fleet, the rack view and a machine
page, over a demo fleet of 3 racks (48 machines in several states, GPUs, a GPU fault, disks).
Runs against whichever metald is importable (``PYTHONPATH=<a checkout>`` for another tree).

    .venv/bin/python scripts/ui_screenshots.py docs/img ui-after
"""

from __future__ import annotations

import sys
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # tests.* helpers (after any PYTHONPATH tree)

STATES = ["ready"] * 8 + ["active"] * 4 + ["maintenance", "broken", "provisioning", "ready"]
INVENTORY = {
    "schema_version": 1,
    "normalized": {
        "cpu_model": "AMD EPYC 9654",
        "cpu_count": 192,
        "disks": [
            {"name": "nvme0n1", "model": "Samsung PM1743", "size_bytes": 3_840_000_000_000},
            {"name": "nvme1n1", "model": "Samsung PM1743", "size_bytes": 3_840_000_000_000},
            {"name": "sda", "model": "QEMU HARDDISK", "size_bytes": 2_000_000_000},
        ],
        "gpus": [
            {
                "address": f"0000:{0x18 + i:02x}:00.0",
                "model": "NVIDIA H100 80GB HBM3",
                "vendor_id": "10de",
                "device_id": "2330",
                "memory_mib": 81559,
            }
            for i in range(8)
        ],
        "nics": [],
    },
}


def demo(_cfg: Any, store: Any, tokens: Any) -> None:
    from metald import machines
    from metald.lifecycle import Trigger
    from metald.store.models import HealthFault, Machine, Tenant

    with store.session() as s:
        tenant = s.get(Tenant, tokens.tenant_a)
        for r, rack in enumerate(("r07", "r08", "r09")):
            for u in range(16):
                i = r * 16 + u
                m = machines.create_machine(
                    s,
                    macs=[f"52:54:00:dd:{r:02x}:{u:02x}"],
                    actor="demo",
                    name=f"{rack}-u{2 * u + 1:02d}",
                    rack=rack,
                    rack_position=f"u{2 * u + 1}",
                )
                machines.transition(s, m.id, Trigger.INSPECT, actor="demo")
                machines.transition(
                    s,
                    m.id,
                    Trigger.INSPECTED,
                    actor="demo",
                    updates={
                        "inventory": INVENTORY,
                        "memory_mb": 2_097_152,
                        "gpu_count": 8,
                        "gpu_model": "NVIDIA H100 80GB HBM3",
                        "product": "PowerEdge XE9680",
                        "vendor": "Dell Inc.",
                        "serial": f"CZ{i:05d}",
                    },
                )
                if u in (2, 9):  # a GPU fault: the rack view's GPU colour
                    s.add(
                        HealthFault(
                            machine_id=m.id,
                            open_key=f"{m.id}/xid",
                            witness="node",
                            kind="xid",
                            subject="0000:1a:00.0",
                            code="79",
                            severity="fatal" if u == 2 else "degraded",
                            rule="xid-79",
                            evidence="NVRM: Xid 79",
                            table_version="1",
                        )
                    )
                    s.commit()
                want = STATES[(i * 7 + r * 5) % len(STATES)]
                if want == "maintenance":
                    machines.transition(
                        s, m.id, Trigger.MAINTENANCE_ON, actor="demo", reason="reseat GPU 3 riser"
                    )
                elif want == "broken":
                    machines.transition(
                        s,
                        m.id,
                        Trigger.MARK_BROKEN,
                        actor="demo",
                        reason="XID 79: GPU fell off the bus",
                    )
                elif want in ("active", "provisioning"):
                    row = s.get(Machine, m.id)
                    assert row is not None and tenant is not None
                    row.state, row.tenant_id = want, tenant.id
                    row.power_state = "on"
                    s.add(row)
                    s.commit()


def main(out: Path, prefix: str) -> None:
    from tests.api_helpers import LoopbackApi
    from tests.ui_browser import chromium, open_as

    out.mkdir(parents=True, exist_ok=True)
    with (
        TemporaryDirectory() as tmp,
        chromium() as browser,
        LoopbackApi(f"sqlite:///{tmp}/metald.db", Path(tmp), demo) as app,
    ):
        assert app.tokens is not None
        page = open_as(browser, app.base, app.tokens.technician, "/ui/")
        page.set_viewport_size({"width": 1500, "height": 900})
        page.screenshot(path=str(out / f"{prefix}-fleet.png"))
        page.goto("/ui/?group=rack&sort=state")
        page.screenshot(path=str(out / f"{prefix}-fleet-grouped.png"))
        page.goto("/ui/racks")
        page.screenshot(path=str(out / f"{prefix}-racks.png"), full_page=True)
        page.goto("/ui/racks?colour=gpu")
        page.screenshot(path=str(out / f"{prefix}-racks-gpu.png"), full_page=True)
        page.goto("/ui/?q=r08-u05")
        page.locator("#fleet tbody a").first.click()
        page.wait_for_load_state()
        page.screenshot(path=str(out / f"{prefix}-machine.png"), full_page=True)
        page.context.close()
    print(f"screenshots in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
