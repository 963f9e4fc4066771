"""The part a technician looks at, from a fault's subject, its event-log text and the
machine's inventory."""

from __future__ import annotations

from metald.health.parts import locate, pci_key

INVENTORY = {
    "gpus": [
        {"address": "0000:18:00.0", "serial": "1650123456789", "model": "NVIDIA H100 80GB HBM3",
         "uuid": "GPU-aaaa"},
        {"address": "0000:3b:00.0", "serial": "1650123456790", "model": "NVIDIA H100 80GB HBM3",
         "uuid": "GPU-bbbb"},
    ],
    "disks": [{"name": "nvme0n1", "serial": "S4EWNX0R123456", "model": "Dell Ent NVMe"}],
}  # fmt: skip


def test_a_gpu_fault_names_the_gpu_by_pci_address_and_serial() -> None:
    # nvidia-smi and the kernel write the address with an 8-digit domain and upper case.
    part = locate({"kind": "xid", "subject": "00000000:3B:00.0", "evidence": "Xid 79"}, INVENTORY)
    assert part["part"] == "gpu"
    assert (part["pci_address"], part["serial"]) == ("0000:3b:00.0", "1650123456790")
    assert part["where"] == "GPU at PCI 0000:3b:00.0, serial 1650123456790, NVIDIA H100 80GB HBM3"


def test_a_missing_gpu_lists_the_slots_to_compare() -> None:
    part = locate({"kind": "gpu-count", "subject": "node", "code": "missing"}, INVENTORY)
    assert part["part"] == "gpu"
    assert [g["serial"] for g in part["inventory_gpus"]] == ["1650123456789", "1650123456790"]
    assert "0000:18:00.0 (serial 1650123456789)" in part["where"]


def test_a_sel_record_names_the_dimm_slot_or_the_psu() -> None:
    dimm = locate(
        {
            "kind": "sel",
            "subject": "bmc",
            "part": "dimm",
            "evidence": "#12 2026-12-06T10:00:00 critical Memory CPU1_DIMM_A2 Uncorrectable ECC",
        },
        INVENTORY,
    )
    assert (dimm["part"], dimm["slot"]) == ("dimm", "CPU1_DIMM_A2")
    psu = locate(
        {"kind": "sel", "subject": "bmc", "evidence": "#3 critical Power Supply PS2 Failure"},
        INVENTORY,
    )
    assert (psu["part"], psu["psu"]) == ("psu", "PS2")
    unnamed = locate({"kind": "sel", "subject": "bmc", "part": "dimm", "evidence": "ECC"}, None)
    assert unnamed["part"] == "dimm" and "names no slot" in unnamed["where"]


def test_sensors_disks_and_the_node() -> None:
    assert locate({"kind": "sensor", "subject": "FAN3"}, None)["part"] == "fan"
    assert locate({"kind": "sensor", "subject": "PSU1 Status", "part": "psu"}, None) == {
        "part": "psu",
        "where": "sensor PSU1 Status",
        "sensor": "PSU1 Status",
    }
    disk = locate({"kind": "smart", "subject": "nvme0n1"}, INVENTORY)
    assert disk["serial"] == "S4EWNX0R123456" and "S4EWNX0R123456" in disk["where"]
    assert locate({"kind": "silence", "subject": "node"}, INVENTORY)["part"] == "node"


def test_pci_key_spellings() -> None:
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00.0") == "0000:3b:00.0"
    assert pci_key("3b:00.0") == "0000:3b:00.0"
    assert pci_key("node") is None
