"""Payload -> the facts metald stores and filters on. Pure: no I/O but reading pci.ids once.

``normalize(payload)`` cleans DMI placeholders, counts CPUs and memory, recognises GPUs by PCI
class and vendor:device id (names from ``pci_ids``), prefers ``nvidia-smi``'s product name and
serials when its XML is present, and reads the BMC address and LLDP neighbours from tool output.
``NormalizedInventory.machine_fields()`` gives exactly the ``Machine`` columns to update.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict

from metald.arch import from_uname
from metald.inventory import pci_ids
from metald.inventory.cpuname import cpu_model
from metald.inventory.dmistrings import clean
from metald.inventory.nvlink import NvlinkFacts, parse_fabric
from metald.inventory.nvlinkmatrix import NvlinkLinks, links_facts
from metald.inventory.schema import SCHEMA_VERSION, InventoryPayload


class DiskFacts(BaseModel):
    name: str
    size_bytes: int
    model: str | None = None
    serial: str | None = None
    rotational: bool | None = None


class NicFacts(BaseModel):
    name: str
    mac: str
    driver: str | None = None
    link: bool | None = None
    speed_mbps: int | None = None
    pci_address: str | None = None


class GpuFacts(BaseModel):
    #: PCI address 0000:01:00.0 (domain:bus:device.function).
    address: str | None = None
    vendor_id: str
    device_id: str
    model: str
    family: str
    serial: str | None = None
    uuid: str | None = None
    memory_mib: int | None = None
    #: Where the model name came from: "pci-id" or "nvidia-smi" / "rocm-smi".
    source: str = "pci-id"


class BmcFacts(BaseModel):
    address: str | None = None
    mac: str | None = None
    address_source: str | None = None


class LldpNeighbour(BaseModel):
    interface: str
    chassis_name: str | None = None
    chassis_id: str | None = None
    port_id: str | None = None
    port_descr: str | None = None


class IbPortFacts(BaseModel):
    device: str
    port: int
    #: ``0x`` and 16 lower-case hex digits.
    port_guid: str
    node_guid: str | None = None
    link_layer: str | None = None
    state: str | None = None
    rate: str | None = None


class NormalizedInventory(BaseModel):
    model_config = ConfigDict(frozen=True)

    vendor: str | None = None
    product: str | None = None
    serial: str | None = None
    system_uuid: str | None = None
    cpu_model: str | None = None
    #: Debian's name for the CPU architecture (amd64, arm64) from ``uname -m``; None when the
    #: agent did not say or said something metald does not know.
    arch: str | None = None
    #: Logical CPUs.
    cpu_count: int | None = None
    cpu_sockets: int | None = None
    cpu_cores: int | None = None
    memory_mb: int | None = None
    disks: list[DiskFacts] = []
    nics: list[NicFacts] = []
    gpus: list[GpuFacts] = []
    #: The most common GPU model ("NVIDIA H100 80GB HBM3"); None without GPUs.
    gpu_model: str | None = None
    #: Its short family ("H100"), for selectors that do not care about form factor.
    gpu_family: str | None = None
    gpu_count: int = 0
    bmc: BmcFacts | None = None
    lldp: list[LldpNeighbour] = []
    #: "switch/port" from LLDP of the first NIC that has a neighbour: a rack position candidate.
    rack_position_hint: str | None = None
    #: RDMA ports (InfiniBand and RoCE) with their GUIDs.
    infiniband: list[IbPortFacts] = []
    #: The GPUs' NVLink fabric (multi-node NVLink systems); None without one.
    nvlink: NvlinkFacts | None = None
    #: The NVLink link matrix (nvidia-smi nvlink -s and topo -m); None without either.
    nvlink_links: NvlinkLinks | None = None

    def machine_fields(self) -> dict[str, Any]:
        """The ``Machine`` columns this inventory sets (arch only when it says: an older
        agent's inventory leaves what DHCP recorded)."""
        arch = {"arch": self.arch} if self.arch else {}
        return arch | {
            "vendor": self.vendor,
            "product": self.product,
            "serial": self.serial,
            "system_uuid": self.system_uuid,
            "cpu_model": self.cpu_model,
            "cpu_count": self.cpu_count,
            "memory_mb": self.memory_mb,
            "gpu_model": self.gpu_model,
            "gpu_count": self.gpu_count,
            "nvlink_domain": self.nvlink.domain if self.nvlink else None,
            "nvlink_ready": bool(self.nvlink and self.nvlink.ready),
        }


def clean_uuid(value: str | None) -> str | None:
    v = clean(value)
    if v is None:
        return None
    v = v.lower()
    return (
        v
        if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", v)
        else None
    )


def pci_address(bus_id: str) -> str:
    """nvidia-smi's ``00000000:01:00.0`` -> ``0000:01:00.0`` (sysfs form), lower case."""
    domain, _, rest = bus_id.strip().lower().rpartition(":")
    domain, _, bus = domain.rpartition(":")
    return f"{int(domain or '0', 16):04x}:{bus}:{rest}"


def _int(value: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", value or "")
    return int(m.group(1)) if m else None


def parse_nvidia_smi_xml(xml_text: str) -> list[GpuFacts]:
    """GPUs from ``nvidia-smi -q -x``. Refuses entity declarations (untrusted input)."""
    if "<!ENTITY" in xml_text:
        raise ValueError("nvidia-smi XML with entity declarations refused")
    root = ET.fromstring(xml_text)
    gpus = []
    for gpu in root.findall("gpu"):
        dev_id = (gpu.findtext("pci/pci_device_id") or "").lower().removeprefix("0x")
        # "20b210de": device id in the high 16 bits, vendor in the low 16
        device, vendor = (dev_id[:4], dev_id[4:8]) if len(dev_id) == 8 else ("0000", "10de")
        by_id = pci_ids.gpu_model(int(vendor, 16), int(device, 16))
        bus = gpu.get("id") or gpu.findtext("pci/pci_bus_id")
        gpus.append(
            GpuFacts(
                address=pci_address(bus) if bus else None,
                vendor_id=vendor,
                device_id=device,
                model=clean(gpu.findtext("product_name")) or by_id.name,
                family=by_id.family,
                serial=clean(gpu.findtext("serial")),
                uuid=clean(gpu.findtext("uuid")),
                memory_mib=_int(gpu.findtext("fb_memory_usage/total")),
                source="nvidia-smi",
            )
        )
    return gpus


def parse_rocm_smi_json(text: str) -> dict[str, dict[str, Any]]:
    """rocm-smi --json: PCI address -> {serial, memory_mib, unique_id}. Model names stay PCI-id based."""
    data = json.loads(text)
    out: dict[str, dict[str, Any]] = {}
    for key, card in data.items():
        if not key.startswith("card") or not isinstance(card, dict) or "PCI Bus" not in card:
            continue
        vram = _int(card.get("VRAM Total Memory (B)"))
        out[str(card["PCI Bus"]).lower()] = {
            "serial": clean(card.get("Serial Number")),
            "memory_mib": vram // (1 << 20) if vram else None,
            "uuid": clean(card.get("Unique ID")),
        }
    return out


def parse_ipmitool_lan_print(text: str) -> BmcFacts | None:
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    address = fields.get("IP Address")
    if address in (None, "", "0.0.0.0"):
        address = None
    mac = fields.get("MAC Address")
    if mac in (None, "", "00:00:00:00:00:00"):
        mac = None
    if address is None and mac is None:
        return None
    return BmcFacts(
        address=address,
        mac=mac.lower() if mac else None,
        address_source=fields.get("IP Address Source"),
    )


def parse_lldpctl_keyvalue(text: str) -> list[LldpNeighbour]:
    """``lldpctl -f keyvalue``: lines like ``lldp.eth0.chassis.name=leaf1``."""
    per_if: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 4 or parts[0] != "lldp":
            continue
        per_if.setdefault(parts[1], {}).setdefault(".".join(parts[2:]), value.strip())
    out = []
    for ifname, kv in per_if.items():
        out.append(
            LldpNeighbour(
                interface=ifname,
                chassis_name=kv.get("chassis.name"),
                chassis_id=kv.get("chassis.mac") or kv.get("chassis.id"),
                port_id=kv.get("port.ifname") or kv.get("port.mac") or kv.get("port.local"),
                port_descr=kv.get("port.descr"),
            )
        )
    return out


def _gpus(payload: InventoryPayload) -> list[GpuFacts]:
    names = pci_ids.load_pci_ids()
    by_address: dict[str, GpuFacts] = {}
    for dev in payload.pci:
        vendor, device, cls = int(dev.vendor, 16), int(dev.device, 16), int(dev.class_, 16)
        if not pci_ids.is_gpu(vendor, cls):
            continue
        model = pci_ids.gpu_model(vendor, device, names)
        by_address[dev.address.lower()] = GpuFacts(
            address=dev.address.lower(),
            vendor_id=f"{vendor:04x}",
            device_id=f"{device:04x}",
            model=model.name,
            family=model.family,
        )
    if payload.raw.nvidia_smi_xml:
        try:
            smi = parse_nvidia_smi_xml(payload.raw.nvidia_smi_xml)
        except (ET.ParseError, ValueError):
            smi = []  # a broken tool output must not lose the PCI-based facts
        for g in smi:
            base = by_address.get(g.address or "")
            # nvidia-smi names the product; the family stays the one the PCI id gives
            family = base.family if base else g.family
            by_address[g.address or f"nvidia-smi-{len(by_address)}"] = g.model_copy(
                update={"family": family}
            )
    if payload.raw.rocm_smi_json:
        try:
            rocm = parse_rocm_smi_json(payload.raw.rocm_smi_json)
        except (ValueError, AttributeError):
            rocm = {}
        for address, extra in rocm.items():
            if address in by_address:
                by_address[address] = by_address[address].model_copy(update=extra)
    return sorted(by_address.values(), key=lambda g: g.address or "")


def _memory_mb(payload: InventoryPayload) -> int | None:
    if payload.memory.online_bytes:
        return payload.memory.online_bytes // (1 << 20)
    if payload.memory.meminfo_total_kb:
        return payload.memory.meminfo_total_kb // 1024
    return None


def normalize(payload: InventoryPayload) -> NormalizedInventory:
    s = payload.system
    gpus = _gpus(payload)
    common = Counter(g.model for g in gpus).most_common(1)
    gpu_model = common[0][0] if common else None
    gpu_family = next((g.family for g in gpus if g.model == gpu_model), None)
    bmc = (
        parse_ipmitool_lan_print(payload.raw.ipmitool_lan_print)
        if payload.raw.ipmitool_lan_print
        else None
    )
    lldp = parse_lldpctl_keyvalue(payload.raw.lldpctl) if payload.raw.lldpctl else []
    hint = next(
        (
            f"{n.chassis_name or n.chassis_id}/{n.port_id or n.port_descr}"
            for n in lldp
            if (n.chassis_name or n.chassis_id) and (n.port_id or n.port_descr)
        ),
        None,
    )
    nvlink = None
    if payload.raw.nvidia_smi_xml:
        try:
            nvlink = parse_fabric(payload.raw.nvidia_smi_xml)
        except (ET.ParseError, ValueError):
            nvlink = None
    links = links_facts(payload.raw.nvidia_smi_nvlink, payload.raw.nvidia_smi_topo)
    return NormalizedInventory(
        vendor=clean(s.vendor),
        product=clean(s.product),
        serial=clean(s.serial) or clean(s.chassis_serial),
        system_uuid=clean_uuid(s.uuid),
        cpu_model=cpu_model(payload.cpu),
        arch=from_uname(payload.cpu.arch),
        cpu_count=payload.cpu.logical or None,
        cpu_sockets=payload.cpu.sockets,
        cpu_cores=payload.cpu.cores,
        memory_mb=_memory_mb(payload),
        disks=[
            DiskFacts(
                name=d.name,
                size_bytes=d.size_bytes,
                model=clean(d.model),
                serial=clean(d.serial),
                rotational=d.rotational,
            )
            for d in payload.disks
        ],
        nics=[
            NicFacts(
                name=n.name,
                mac=n.mac.lower(),
                driver=n.driver,
                link=n.link,
                speed_mbps=n.speed_mbps,
                pci_address=n.pci_address,
            )
            for n in payload.nics
        ],
        gpus=gpus,
        gpu_model=gpu_model,
        gpu_family=gpu_family,
        gpu_count=len(gpus),
        bmc=bmc,
        lldp=lldp,
        rack_position_hint=hint,
        infiniband=[
            IbPortFacts(
                device=p.device,
                port=p.port,
                port_guid=p.port_guid.lower(),
                node_guid=p.node_guid.lower() if p.node_guid else None,
                link_layer=p.link_layer,
                state=p.state,
                rate=p.rate,
            )
            for p in payload.infiniband
        ],
        nvlink=nvlink,
        nvlink_links=links,
    )


def inventory_document(
    payload: InventoryPayload, normalized: NormalizedInventory
) -> dict[str, Any]:
    """What to store in ``Machine.inventory``: the normalised view and the payload it came from
    (kept so a later metald with better tables can normalise it again)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "normalized": normalized.model_dump(mode="json"),
        "payload": payload.model_dump(mode="json", by_alias=True),
    }
