"""A simulated GB200 NVL72 fleet: 4 NVLink domains of 18 compute trays, each tray's inventory
made from the real GB200 capture (tests/fixtures/gpu) with its domain's cluster UUID, its
slot and chassis serial put in, and one InfiniBand port; an ibsim fabric of one spine and two
leaf switches (domains 0-1 on leaf-a, 2-3 on leaf-b), whose ibnetdiscover output sets the
machines' leaves. Shared by the placement tests and bench/placement.py."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from metald.inventory import normalize, parse_payload
from metald.inventory.normalize import inventory_document
from metald.lifecycle import State
from metald.store import Store
from metald.store.models import Machine
from vmlab.inventory import payload

ROOT = Path(__file__).resolve().parents[2]
GB200_XML = ROOT / "tests/fixtures/gpu/nvidia-smi-q-x_4x-gb200_arm64_drv580.173.02.xml"
DOMAINS, TRAYS = 4, 18


def tray(d: int, slot: int) -> str:
    return f"nvl{d}-t{slot:02d}"


def cluster_uuid(d: int) -> str:
    return f"{d + 1:08x}-0000-4000-8000-{d + 1:012x}"


def domain_id(d: int) -> str:
    return f"{cluster_uuid(d)}.{d + 1}"


def ibsim_net() -> str:
    """The ibsim net file: spine, leaf-a (trays of domains 0-1), leaf-b (domains 2-3)."""
    per_leaf = DOMAINS // 2 * TRAYS
    parts = [f'Switch 8 "spine"\n[1] "leaf-a"[{per_leaf + 1}]\n[2] "leaf-b"[{per_leaf + 1}]\n']
    hcas = []
    for li, leaf in enumerate(("leaf-a", "leaf-b")):
        lines = [f'Switch {per_leaf + 1} "{leaf}"']
        for k in range(per_leaf):
            d, slot = divmod(li * per_leaf + k, TRAYS)
            lines.append(f'[{k + 1}] "{tray(d, slot)}"[1]')
            hcas.append(f'Hca 1 "{tray(d, slot)}"\n[1] "{leaf}"[{k + 1}]\n')
        lines.append(f'[{per_leaf + 1}] "spine"[{li + 1}]')
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts + hcas)


_CA = re.compile(r'^Ca\s+\d+\s+"H-[0-9a-f]{16}"\s+#\s+"([^"]+)"\s*\n\[1\]\(([0-9a-f]+)\)', re.M)


def ca_port_guids(ibnetdiscover: str) -> dict[str, str]:
    """HCA name -> port GUID, from the comments ibnetdiscover prints (test side only)."""
    return {name: "0x" + g.rjust(16, "0") for name, g in _CA.findall(ibnetdiscover)}


@functools.cache
def tray_inventory(
    d: int, slot: int, port_guid: str | None, capture: Path = GB200_XML
) -> tuple[dict[str, Any], Any]:
    """(stored inventory document, normalized facts) of one tray."""
    xml = capture.read_text()
    xml = xml.replace("00000001-0000-0000-0000-000000000001", cluster_uuid(d))
    xml = xml.replace("<cliqueId>2</cliqueId>", f"<cliqueId>{d + 1}</cliqueId>")
    xml = xml.replace("<slot_number>14</slot_number>", f"<slot_number>{slot + 1}</slot_number>")
    xml = xml.replace("1820000000001", f"18200000000{d + 1:02d}")
    ports = []
    if port_guid:
        ports = [{"device": "mlx5_0", "port": 1, "port_guid": port_guid,
                  "link_layer": "InfiniBand", "state": "4: ACTIVE"}]  # fmt: skip
    p = parse_payload(payload(raw={"nvidia_smi_xml": xml}, infiniband=ports))
    norm = normalize(p)
    return inventory_document(p, norm), norm


def add_fleet(store: Store, ibnetdiscover: str | None = None) -> dict[str, str]:
    """The 72 trays, ready, each in its rack (one NVL72 rack per domain) and power domain
    (two per rack); name -> id."""
    guids = ca_port_guids(ibnetdiscover) if ibnetdiscover else {}
    ids = {}
    with store.session() as s:
        for d in range(DOMAINS):
            for slot in range(TRAYS):
                doc, norm = tray_inventory(d, slot, guids.get(tray(d, slot)))
                m = Machine(
                    name=tray(d, slot),
                    state=State.READY.value,
                    rack=f"rack{d}",
                    power_domain=f"rack{d}-pdu{slot % 2}",
                    inventory=doc,
                    **norm.machine_fields(),
                )
                s.add(m)
                s.flush()
                ids[m.name or ""] = m.id
        s.commit()
    return ids
