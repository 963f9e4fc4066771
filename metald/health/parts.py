"""The part a technician looks at, from a fault and the machine's inventory.

A fault names its part through its ``subject`` (a GPU's PCI address, a sensor, a disk, an
InfiniBand port, ``bmc`` for an event-log record, ``node``) and, for event-log records, the
record's own text ("Memory ... DIMM_A2 ... Uncorrectable ECC", "Power Supply PS2 ... Failure").
``locate`` turns that into what a person at the rack needs: the GPU's PCI address and serial
number from the inventory, the DIMM slot, the PSU or fan, the disk's serial. Pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: Fault kinds whose subject is a GPU (its PCI address).
_GPU_KINDS = frozenset(
    {"xid", "gpu-ecc", "gpu-pages", "gpu-throttle", "gpu-count", "nvlink", "dcgm-health"}
)
_LOG_KINDS = frozenset({"sel", "redfish-log"})
_DIMM = re.compile(r"\b((?:CPU|P)\d+[_ -]?)?DIMM[_ -]?([A-Z]{0,2}\d{0,2}[A-Z]?\d{0,2})\b", re.I)
_PSU = re.compile(r"\b(PSU\s?\d+|PS\s?\d+|Power Supply\s?\d+)\b", re.I)
_FAN = re.compile(r"\b(FAN[_ ]?\w+)\b", re.I)
_CPU = re.compile(r"\b(CPU\s?\d+|Processor\s?\d+|P\d)\b", re.I)
_PCI = re.compile(r"^(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$", re.I)


def pci_key(address: str) -> str | None:
    """A PCI address in one spelling (``0000:3b:00.0``), whatever domain width it came with
    (nvidia-smi writes ``00000000:3B:00.0``); None when it is not one."""
    m = _PCI.match(address.strip())
    if m is None:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def _field(fault: Mapping[str, Any] | Any, name: str) -> str:
    value = fault.get(name) if isinstance(fault, Mapping) else getattr(fault, name, None)
    return "" if value is None else str(getattr(value, "value", value))


def locate(fault: Mapping[str, Any] | Any, inventory: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where to look for ``fault`` (a dict or an object with kind, subject, evidence and,
    optionally, the classification's ``part``): ``{"part": "gpu" | "dimm" | "psu" | ...,
    "where": "<a sentence-sized locator>", ...}`` with the GPU's ``pci_address``, ``serial``,
    ``model`` and ``uuid``, a DIMM's ``slot``, a disk's ``serial`` where known."""
    kind, subject = _field(fault, "kind"), _field(fault, "subject")
    evidence, part = _field(fault, "evidence"), _field(fault, "part")
    inv = inventory or {}
    if kind in _GPU_KINDS or part == "gpu":
        return _gpu(kind, subject, inv)
    if kind in _LOG_KINDS:
        return _from_log(evidence, part)
    if kind == "sensor":
        what = part or _sensor_part(subject)
        return {"part": what, "where": f"sensor {subject}", "sensor": subject}
    if kind == "smart" or part == "disk":
        disk = next((d for d in inv.get("disks") or [] if d.get("name") == subject), None)
        out: dict[str, Any] = {"part": "disk", "where": f"disk {subject}", "disk": subject}
        if disk:
            out.update(serial=disk.get("serial"), model=disk.get("model"))
            if disk.get("serial"):
                out["where"] += f" (serial {disk['serial']})"
        return out
    if kind == "ib-port" or part == "nic":
        return {"part": "nic", "where": f"InfiniBand port {subject}", "port": subject}
    if kind == "technician":
        named = subject if subject and subject != "node" else "the whole machine"
        return {"part": part or "node", "where": f"{named} (as reported by a technician)"}
    return {"part": part or "node", "where": "the whole machine (no single part named)"}


def _gpu(kind: str, subject: str, inv: Mapping[str, Any]) -> dict[str, Any]:
    gpus = list(inv.get("gpus") or [])
    key = pci_key(subject)
    gpu = next((g for g in gpus if key and pci_key(str(g.get("address") or "")) == key), None)
    if gpu is None and kind == "dcgm-health" and subject.startswith("GPU ") and key is None:
        known = ", ".join(f"{g.get('address')} (serial {g.get('serial') or 'unknown'})"
                          for g in gpus)  # fmt: skip
        return {
            "part": "gpu",
            "where": f"DCGM's {subject} (its index in the driver's order, `nvidia-smi -L`); "
            f"the inventory's GPUs: {known or 'none recorded'}",
            "dcgm_gpu_index": subject.removeprefix("GPU "),
        }
    if gpu is None:
        if kind == "gpu-count" or key is None:
            known = ", ".join(
                f"{g.get('address')} (serial {g.get('serial') or 'unknown'})" for g in gpus
            )
            return {
                "part": "gpu",
                "where": "a GPU the driver no longer sees; compare the slots with the "
                f"inventory's {len(gpus)}: {known or 'none recorded'}",
                "inventory_gpus": [
                    {"pci_address": g.get("address"), "serial": g.get("serial")} for g in gpus
                ],
            }
        return {
            "part": "gpu",
            "where": f"GPU at PCI {key} (not in the inventory)",
            "pci_address": key,
        }
    serial = gpu.get("serial")
    return {
        "part": "gpu",
        "where": f"GPU at PCI {key}, serial {serial or 'unknown'}, {gpu.get('model') or ''}".strip(
            ", "
        ),
        "pci_address": key,
        "serial": serial,
        "model": gpu.get("model"),
        "uuid": gpu.get("uuid"),
    }


def _from_log(text: str, part: str) -> dict[str, Any]:
    """An event-log record: the DIMM slot, PSU, fan or CPU its text names."""
    if part in ("dimm", "") and (m := _DIMM.search(text)):
        slot = m.group(0).upper().replace(" ", "_")
        return {"part": "dimm", "where": f"DIMM slot {slot}", "slot": slot}
    if part in ("psu", "") and (m := _PSU.search(text)):
        name = m.group(1)
        return {"part": "psu", "where": f"power supply {name}", "psu": name}
    if part in ("fan", "") and (m := _FAN.search(text)):
        return {"part": "fan", "where": f"fan {m.group(1)}", "fan": m.group(1)}
    if part == "cpu" and (m := _CPU.search(text)):
        return {"part": "cpu", "where": f"processor {m.group(1)}", "cpu": m.group(1)}
    if part == "dimm":
        return {"part": "dimm", "where": "a DIMM (the record names no slot; read the BMC's log)"}
    return {"part": part or "node", "where": "see the event-log record in the evidence"}


def _sensor_part(name: str) -> str:
    low = name.lower()
    if "fan" in low:
        return "fan"
    if "ps" in low or "power" in low:
        return "psu"
    if "temp" in low:
        return "thermal"
    return "sensor"
