"""The NVLink fabric a machine's GPUs report: ``nvidia-smi -q -x``'s ``<fabric>`` and
``<platformInfo>`` per GPU, summed up into the machine's NVLink domain. Pure.

On multi-node NVLink systems (GB200/GB300 NVL72, DGX GH200) every GPU registers with the
fabric manager; once registration is ``Completed`` with status ``Success`` the GPU reports the
cluster UUID and clique id of its NVLink partition. GPUs that reach each other over NVLink share
both, so the domain id is ``<clusterUuid>.<cliqueId>`` (the value NVIDIA's GPU feature discovery
puts in the ``nvidia.com/gpu.clique`` label). A machine is *ready* in its domain only when
every GPU the driver attached is listed, registered and agrees on that id; otherwise the
problems say what is wrong and the machine is not placed by NVLink (docs/inventory.md).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from pydantic import BaseModel

_ZERO_UUID = re.compile(r"^[0-]+$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


class GpuFabric(BaseModel):
    """One GPU's fabric registration and its place in the rack, as nvidia-smi reports them."""

    address: str | None = None
    state: str | None = None
    status: str | None = None
    clique_id: int | None = None
    cluster_uuid: str | None = None
    health: str | None = None
    chassis_serial: str | None = None
    slot_number: int | None = None
    tray_index: int | None = None
    host_id: int | None = None
    module_id: int | None = None
    #: "Switch Connected" on NVSwitch systems, "Direct Connected" GPU to GPU.
    peer_type: str | None = None


class NvlinkFacts(BaseModel):
    #: ``<clusterUuid>.<cliqueId>`` the GPUs agree on, even when not every GPU is healthy.
    domain: str | None = None
    cluster_uuid: str | None = None
    clique_id: int | None = None
    #: Every attached GPU listed, registered (Completed/Success) and in ``domain``.
    ready: bool = False
    problems: list[str] = []
    gpus_attached: int | None = None
    gpus_reported: int = 0
    #: The rack's chassis serial (one NVL72 rack is one chassis) and the tray's slot in it.
    chassis_serial: str | None = None
    slot_number: int | None = None
    tray_index: int | None = None
    gpus: list[GpuFabric] = []


def _text(el: ET.Element, path: str) -> str | None:
    v = el.findtext(path)
    v = v.strip() if v is not None else None
    return None if v in (None, "", "N/A", "Not Supported") else v


def _int(v: str | None) -> int | None:
    try:
        return int(v, 0) if v is not None else None
    except ValueError:
        return None


def parse_fabric(xml_text: str) -> NvlinkFacts | None:
    """The fabric facts of ``nvidia-smi -q -x``; None when no GPU reports a fabric (a GPU
    without NVLink fabric, an older driver). Refuses entity declarations (untrusted input)."""
    if "<!ENTITY" in xml_text:
        raise ValueError("nvidia-smi XML with entity declarations refused")
    root = ET.fromstring(xml_text)
    gpus: list[GpuFabric] = []
    for g in root.findall("gpu"):
        fab = g.find("fabric")
        if fab is None:
            continue
        gpus.append(
            GpuFabric(
                address=g.get("id"),
                state=_text(fab, "state"),
                status=_text(fab, "status"),
                clique_id=_int(_text(fab, "cliqueId")),
                cluster_uuid=(_text(fab, "clusterUuid") or "").lower() or None,
                health=_text(fab, "health/summary"),
                chassis_serial=_text(g, "platformInfo/chassis_serial_number"),
                slot_number=_int(_text(g, "platformInfo/slot_number")),
                tray_index=_int(_text(g, "platformInfo/tray_index")),
                host_id=_int(_text(g, "platformInfo/host_id")),
                module_id=_int(_text(g, "platformInfo/module_id")),
                peer_type=_text(g, "platformInfo/peer_type"),
            )
        )
    if not gpus or all(x.state is None for x in gpus):
        return None
    return summarize(gpus, _int(_text(root, "attached_gpus")))


def _domain(g: GpuFabric) -> str | None:
    u = g.cluster_uuid
    if u is None or g.clique_id is None or not _UUID.match(u) or _ZERO_UUID.match(u):
        return None  # an all-zero UUID identifies nothing (every such GPU would "match")
    return f"{u}.{g.clique_id}"


def summarize(gpus: list[GpuFabric], attached: int | None) -> NvlinkFacts:
    problems: list[str] = []
    if attached is not None and attached != len(gpus):
        problems.append(
            f"the driver attached {attached} GPU(s) but nvidia-smi lists {len(gpus)}: a GPU "
            "is missing (fallen off the bus, or not seated)"
        )
    for g in gpus:
        name = g.address or "a GPU"
        if g.state != "Completed":
            problems.append(f"{name}: fabric registration {g.state or 'unknown'}, not Completed")
        elif g.status != "Success":
            problems.append(f"{name}: fabric registration completed with status {g.status}")
        elif _domain(g) is None:
            problems.append(f"{name}: no cluster UUID and clique id (zero or missing)")
    domains = [d for d in (_domain(g) for g in gpus) if d]
    common = max(set(domains), key=domains.count) if domains else None
    others = sorted({d for d in domains if d != common})
    if others:
        problems.append(f"GPUs disagree on the NVLink domain: {common} and {', '.join(others)}")
    first = next((g for g in gpus if _domain(g) == common), gpus[0])

    def one(attr: str) -> str | int | None:
        vals = {getattr(g, attr) for g in gpus} - {None}
        return vals.pop() if len(vals) == 1 else None

    chassis, slot, tray = one("chassis_serial"), one("slot_number"), one("tray_index")
    return NvlinkFacts(
        domain=common,
        cluster_uuid=first.cluster_uuid if common else None,
        clique_id=first.clique_id if common else None,
        ready=common is not None and not problems,
        problems=problems,
        gpus_attached=attached,
        gpus_reported=len(gpus),
        chassis_serial=chassis if isinstance(chassis, str) else None,
        slot_number=slot if isinstance(slot, int) else None,
        tray_index=tray if isinstance(tray, int) else None,
        gpus=gpus,
    )
