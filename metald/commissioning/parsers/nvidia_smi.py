"""``nvidia-smi -q -x``: per-GPU health.

Fails on: uncorrectable ECC errors (volatile or aggregate), retired pages or remapped rows
pending (or a remapping failure), a PCIe link trained below its maximum generation or width,
active slowdown reasons that mean hardware trouble (HW slowdown, thermal, power brake), a GPU
count other than the profile's. Reports persistence mode, driver and VBIOS versions.
Handles both the ``clocks_event_reasons`` (drivers >= 535) and ``clocks_throttle_reasons``
spellings, and both ECC layouts (``*_uncorrectable`` leaves, and older ``double_bit``).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

from metald.commissioning.verdict import Verdict, error, judge

#: Slowdown reasons that mean the hardware is protecting itself (idle, application clocks,
#: SW power cap and sync boost are normal).
BAD_SLOWDOWNS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
)


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    head = text.strip().split(" ")[0].rstrip("x")
    return int(head) if head.isdigit() else None


def _ecc(node: ET.Element | None) -> tuple[int, int]:
    """(correctable, uncorrectable) summed over a volatile/aggregate block: leaves named
    ``*_uncorrectable`` / ``*_correctable`` (drivers >= 470), or the ``total`` of the older
    ``double_bit`` / ``single_bit`` blocks."""
    corr = unc = 0

    def walk(el: ET.Element, parent: str) -> None:
        nonlocal corr, unc
        for child in el:
            if len(child):
                walk(child, child.tag)
                continue
            n = _int(child.text)
            if n is None:
                continue
            tag = child.tag
            if "uncorrectable" in tag or (tag == "total" and parent == "double_bit"):
                unc += n
            elif "correctable" in tag or (tag == "total" and parent == "single_bit"):
                corr += n

    if node is not None:
        walk(node, node.tag)
    return corr, unc


def _gpu(g: ET.Element) -> dict[str, Any]:
    link = g.find("pci/pci_gpu_link_info")
    reasons = g.find("clocks_event_reasons")
    if reasons is None:
        reasons = g.find("clocks_throttle_reasons")
    active = []
    if reasons is not None:
        for r in reasons:
            name = r.tag.replace("clocks_event_reason_", "").replace("clocks_throttle_reason_", "")
            if (r.text or "").strip() == "Active":
                active.append(name)
    vol = _ecc(g.find("ecc_errors/volatile"))
    agg = _ecc(g.find("ecc_errors/aggregate"))
    rows = g.find("remapped_rows")
    retired = g.find("retired_pages")

    def text(path: str) -> str | None:
        el = g.find(path)
        return None if el is None or el.text is None else el.text.strip()

    return {
        "bus_id": g.get("id"),
        "product": text("product_name"),
        "serial": text("serial"),
        "vbios": text("vbios_version"),
        "persistence_mode": text("persistence_mode"),
        "pcie_gen": _int(text("pci/pci_gpu_link_info/pcie_gen/current_link_gen")),
        "pcie_gen_max": _int(text("pci/pci_gpu_link_info/pcie_gen/max_link_gen")),
        "pcie_width": _int(text("pci/pci_gpu_link_info/link_widths/current_link_width")),
        "pcie_width_max": _int(text("pci/pci_gpu_link_info/link_widths/max_link_width")),
        "has_link": link is not None,
        "ecc_volatile": {"correctable": vol[0], "uncorrectable": vol[1]},
        "ecc_aggregate": {"correctable": agg[0], "uncorrectable": agg[1]},
        "slowdowns": active,
        "retired_pending": (text("retired_pages/pending_retirement") or "") == "Yes"
        if retired is not None
        else False,
        "remap_pending": rows is not None and (text("remapped_rows/remapped_row_pending") == "Yes"),
        "remap_failure": rows is not None and (text("remapped_rows/remapped_row_failure") == "Yes"),
        "remapped_uncorrectable": _int(text("remapped_rows/remapped_row_unc")) or 0,
    }


def parse(xml_text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, per-GPU facts). Raises ValueError on anything but nvidia-smi's XML."""
    if "<!ENTITY" in xml_text or "<!DOCTYPE nvidia_smi_log [" in xml_text:
        raise ValueError("nvidia-smi XML with an inline DTD is refused")
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ValueError(f"not XML: {e}") from None
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"not nvidia-smi -q -x output (root element {root.tag!r})")
    head = {
        "driver": (root.findtext("driver_version") or "").strip() or None,
        "cuda": (root.findtext("cuda_version") or "").strip() or None,
        "attached_gpus": _int(root.findtext("attached_gpus")),
    }
    return head, [_gpu(g) for g in root.findall("gpu")]


def judge_health(
    xml_text: str, *, expected_count: int | None = None, driver: str | None = None
) -> Verdict:
    try:
        head, gpus = parse(xml_text)
    except ValueError as e:
        return error(f"nvidia-smi output unreadable: {e}")
    problems: list[str] = []
    if expected_count is not None and len(gpus) != expected_count:
        problems.append(f"nvidia-smi sees {len(gpus)} GPUs, the profile expects {expected_count}")
    if head["attached_gpus"] is not None and head["attached_gpus"] != len(gpus):
        problems.append(
            f"nvidia-smi reports {head['attached_gpus']} attached GPUs but describes {len(gpus)}"
        )
    if driver is not None and head["driver"] != driver:
        problems.append(f"driver {head['driver']}, the profile expects {driver}")
    for g in gpus:
        where = f"GPU {g['bus_id']}"
        if g["ecc_volatile"]["uncorrectable"]:
            problems.append(
                f"{where} has {g['ecc_volatile']['uncorrectable']} uncorrectable ECC errors "
                "since the driver loaded"
            )
        elif g["ecc_aggregate"]["uncorrectable"]:
            problems.append(
                f"{where} has {g['ecc_aggregate']['uncorrectable']} uncorrectable ECC errors "
                "over its lifetime"
            )
        if g["retired_pending"]:
            problems.append(f"{where} has a page retirement pending (reset the GPU)")
        if g["remap_pending"]:
            problems.append(f"{where} has a row remapping pending (reset the GPU)")
        if g["remap_failure"]:
            problems.append(f"{where} failed to remap a row (replace the GPU)")
        # The generation drops at idle to save power (so it is reported, not judged); the
        # width does not: a narrower link is a badly seated card or riser.
        w, wmax = g["pcie_width"], g["pcie_width_max"]
        if w is not None and wmax is not None and w < wmax:
            problems.append(f"{where} PCIe link at x{w}, below its maximum x{wmax}")
        bad = [r for r in g["slowdowns"] if r in BAD_SLOWDOWNS]
        if bad:
            problems.append(f"{where} clocks slowed down by {', '.join(bad)}")
    values = {**head, "gpus": gpus}
    return judge(problems, f"{len(gpus)} GPU(s) healthy (driver {head['driver']})", **values)
