"""Normalisation against real captures from GPU servers (tests/fixtures/gpu, see SOURCES.md)."""

from __future__ import annotations

import json

import pytest

from metald.inventory import normalize, parse_payload
from metald.inventory.normalize import (
    clean,
    parse_ipmitool_lan_print,
    parse_lldpctl_keyvalue,
    parse_nvidia_smi_xml,
    pci_address,
)
from metald.inventory.pci_ids import GPU_MODELS, gpu_model, is_gpu, load_pci_ids
from tests.inventory.conftest import fixture_text, nvidia_smi_q_gpus, payload
from tests.inventory.fakesys import parse_dmidecode_system, parse_lspci_nn, parse_lspci_plain

A100_LSPCI = "lspci-nn_8x-a100-sxm4-80gb_nvswitch_cx6-vf.txt"
A100_XML = "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"


def pci_entries(devices: list[tuple[str, int, int, int]]) -> list[dict[str, str]]:
    return [
        {"address": a, "vendor": f"0x{v:04x}", "device": f"0x{d:04x}", "class": f"0x{c:04x}00"}
        for a, v, d, c in devices
    ]


def test_debian_pci_ids_is_read():
    names = load_pci_ids()
    assert names.vendors[0x10DE] == "NVIDIA Corporation"
    assert "A100 SXM4 80GB" in names.devices[(0x10DE, 0x20B2)]


def test_eight_a100_from_lspci_nn_nvswitch_and_nics_are_not_gpus():
    devices = parse_lspci_nn(fixture_text(A100_LSPCI))
    assert len(devices) == len(fixture_text(A100_LSPCI).splitlines())  # every line parsed
    inv = normalize(parse_payload(payload(pci=pci_entries(devices))))
    assert inv.gpu_count == 8
    assert inv.gpu_model == "NVIDIA A100-SXM4-80GB"
    assert inv.gpu_family == "A100"
    assert {g.address for g in inv.gpus} == {a for a, _, d, _ in devices if d == 0x20B2}
    # the 6 NVSwitches (class 0680) and ConnectX VFs share vendor ids but are not GPUs
    assert sum(1 for _, v, _, c in devices if v == 0x10DE and not is_gpu(v, c)) == 6


def test_a100_nvidia_smi_xml_names_serial_and_memory():
    (gpu,) = parse_nvidia_smi_xml(fixture_text(A100_XML))
    assert gpu.model == "NVIDIA A100-SXM4-80GB"
    assert gpu.family == "A100"
    assert gpu.address == "0000:01:00.0"
    assert gpu.serial == "1650522003820"
    assert gpu.uuid == "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert gpu.memory_mib == 81920  # the GPU's framebuffer, not a MIG slice's


def test_nvidia_smi_xml_merges_with_pci_by_address():
    pci = pci_entries(
        [("0000:01:00.0", 0x10DE, 0x20B2, 0x0302), ("0000:41:00.0", 0x10DE, 0x20B2, 0x0302)]
    )
    inv = normalize(parse_payload(payload(pci=pci, raw={"nvidia_smi_xml": fixture_text(A100_XML)})))
    assert inv.gpu_count == 2
    by_addr = {g.address: g for g in inv.gpus}
    assert by_addr["0000:01:00.0"].source == "nvidia-smi"
    assert by_addr["0000:01:00.0"].serial == "1650522003820"
    assert by_addr["0000:41:00.0"].source == "pci-id"


def test_nvidia_smi_product_name_is_preferred():
    xml = fixture_text(A100_XML).replace(
        "<product_name>NVIDIA A100-SXM4-80GB<", "<product_name>NVIDIA A100 Custom<"
    )
    pci = pci_entries([("0000:01:00.0", 0x10DE, 0x20B2, 0x0302)])
    inv = normalize(parse_payload(payload(pci=pci, raw={"nvidia_smi_xml": xml})))
    assert inv.gpu_model == "NVIDIA A100 Custom"
    assert inv.gpu_family == "A100"


def test_broken_or_hostile_xml_keeps_pci_facts():
    pci = pci_entries([("0000:01:00.0", 0x10DE, 0x2335, 0x0302)])
    bomb = (
        '<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa">]><nvidia_smi_log>&a;</nvidia_smi_log>'
    )
    for xml in ("<nvidia_smi_log><gpu", bomb):
        inv = normalize(parse_payload(payload(pci=pci, raw={"nvidia_smi_xml": xml})))
        assert (inv.gpu_model, inv.gpu_count) == ("NVIDIA H200", 1)


@pytest.mark.parametrize(
    ("capture", "count"),
    [
        ("nvgpu-exporter-capture_linux-x86_64__nvidia-h100-80gb-hbm3__590.48.01.txt", 1),
        ("nvgpu-exporter-capture_linux-x86_64__nvidia-h200__590.48.01.txt", 1),
        ("nvgpu-exporter-capture_linux-x86_64__nvidia-l40s__595.80.txt", 1),
        ("nvidia-smi-q_8x-h100-80gb-hbm3_drv535.183.01.txt", 8),
    ],
)
def test_pci_id_gives_the_name_nvidia_smi_reports(capture, count):
    """Without nvidia-smi in the image, the PCI id alone must give what nvidia-smi would say."""
    gpus = nvidia_smi_q_gpus(fixture_text(capture))
    assert len(gpus) == count
    devices = []
    for g in gpus:
        ident = int(g["Device Id"], 16)  # 0x233510DE: device << 16 | vendor
        devices.append((pci_address(g["Bus Id"]), ident & 0xFFFF, ident >> 16, 0x0302))
    inv = normalize(parse_payload(payload(pci=pci_entries(devices))))
    assert inv.gpu_count == count
    assert inv.gpu_model == gpus[0]["Product Name"]


def test_gb200_tray_from_plain_lspci():
    devices = parse_lspci_plain(fixture_text("lspci_gb200-tray_4x-gb200_cx7_bf3.txt"))
    inv = normalize(parse_payload(payload(pci=pci_entries(devices))))
    assert (inv.gpu_model, inv.gpu_family, inv.gpu_count) == ("NVIDIA GB200", "GB200", 4)
    # NVIDIA root ports (22b1/22b2/22b8) are bridges, not GPUs
    assert any(d == 0x22B1 for _, _, d, _ in devices)


def test_mi100_from_pci_id_with_rocm_smi_details():
    text = fixture_text("rocm-smi-json_4x-mi100_rocm6.0.2.json")
    cards = {k: v for k, v in json.loads(text).items() if k.startswith("card")}
    devices = [(c["PCI Bus"], 0x1002, int(c["Device ID"], 16), 0x0380) for c in cards.values()]
    inv = normalize(parse_payload(payload(pci=pci_entries(devices), raw={"rocm_smi_json": text})))
    assert (inv.gpu_model, inv.gpu_family, inv.gpu_count) == ("AMD Instinct MI100", "MI100", 4)
    assert all(g.memory_mib == 32752 for g in inv.gpus)
    # rocm-smi's own series name agrees with the table
    assert all("MI100" in c["Card series"] for c in cards.values())


def test_supplement_covers_the_issue_gpus():
    for family in ("A100", "H100", "H200", "B200", "L40S", "MI300X", "GB200"):
        assert any(m.family == family for m in GPU_MODELS.values()), family
    assert gpu_model(0x10DE, 0x2901).name == "NVIDIA B200"
    assert gpu_model(0x1002, 0x74A1).name == "AMD Instinct MI300X"
    # an id only Debian's pci.ids knows still gets a name from it
    a40 = gpu_model(0x10DE, 0x2235)
    assert "A40" in a40.name and a40.family == "A40"
    assert gpu_model(0x10DE, 0xFFF0).name == "NVIDIA device fff0"


def test_xe9680_dmi_fields():
    dmi = parse_dmidecode_system(fixture_text("dmidecode-t-system_dell-poweredge-xe9680.txt"))
    system = {
        "vendor": dmi["sys_vendor"],
        "product": dmi["product_name"],
        "serial": dmi["product_serial"],
        "uuid": dmi["product_uuid"].upper(),
    }
    inv = normalize(parse_payload(payload(system=system)))
    assert (inv.vendor, inv.product, inv.serial) == ("Dell Inc.", "PowerEdge XE9680", "HSR8X04")
    assert inv.system_uuid == "4c4c4544-0053-5210-8038-c8c04f583034"


def test_dmi_placeholders_are_dropped():
    system = {
        "vendor": "To Be Filled By O.E.M.",
        "product": "Default string",
        "serial": "0000000",
        "uuid": "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF",
        "chassis_serial": "CH123",
    }
    inv = normalize(parse_payload(payload(system=system)))
    assert (inv.vendor, inv.product, inv.system_uuid) == (None, None, None)
    assert inv.serial == "CH123"  # the chassis serial stands in
    assert clean("  Dell   Inc. ") == "Dell Inc."


def test_cpu_memory_disks_nics():
    inv = normalize(parse_payload(payload()))
    assert (inv.cpu_count, inv.cpu_sockets, inv.cpu_cores) == (224, 2, 112)
    assert inv.memory_mb == 2 * 1024 * 1024  # from online memory blocks, not MemTotal
    assert inv.nics[0].mac == "aa:bb:cc:00:11:22"
    inv2 = normalize(parse_payload(payload(memory={"meminfo_total_kb": 524288})))
    assert inv2.memory_mb == 512
    fields = inv.machine_fields()
    assert set(fields) == {
        "vendor",
        "product",
        "serial",
        "system_uuid",
        "cpu_model",
        "cpu_count",
        "memory_mb",
        "gpu_model",
        "gpu_count",
        "nvlink_domain",
        "nvlink_ready",
    }


IPMITOOL = """Set in Progress         : Set Complete
IP Address Source       : DHCP Address
IP Address              : 10.20.30.41
Subnet Mask             : 255.255.255.0
MAC Address             : D0:8E:79:AA:BB:CC
Default Gateway IP      : 10.20.30.1
"""


def test_bmc_address_from_ipmitool():
    bmc = parse_ipmitool_lan_print(IPMITOOL)
    assert bmc is not None
    assert (bmc.address, bmc.mac, bmc.address_source) == (
        "10.20.30.41",
        "d0:8e:79:aa:bb:cc",
        "DHCP Address",
    )
    assert (
        parse_ipmitool_lan_print(
            IPMITOOL.replace("10.20.30.41", "0.0.0.0").replace(
                "D0:8E:79:AA:BB:CC", "00:00:00:00:00:00"
            )
        )
        is None
    )
    inv = normalize(parse_payload(payload(raw={"ipmitool_lan_print": IPMITOOL})))
    assert inv.bmc is not None and inv.bmc.address == "10.20.30.41"


def test_lldp_neighbours_give_a_rack_position_hint():
    text = "lldp.eno1.via=LLDP\nlldp.eno1.chassis.mac=00:11:22:33:44:55\nlldp.eno1.chassis.name=leaf-r12\nlldp.eno1.port.ifname=Ethernet17\nlldp.eno1.port.descr=srv17\n"
    (n,) = parse_lldpctl_keyvalue(text)
    assert (n.interface, n.chassis_name, n.port_id) == ("eno1", "leaf-r12", "Ethernet17")
    inv = normalize(parse_payload(payload(raw={"lldpctl": text})))
    assert inv.rack_position_hint == "leaf-r12/Ethernet17"


def test_mixed_gpus_count_all_and_name_the_most_common():
    pci = pci_entries(
        [
            ("0000:01:00.0", 0x10DE, 0x2330, 0x0302),
            ("0000:02:00.0", 0x10DE, 0x2330, 0x0302),
            ("0000:03:00.0", 0x10DE, 0x26B9, 0x0300),
        ]
    )
    inv = normalize(parse_payload(payload(pci=pci)))
    assert (inv.gpu_model, inv.gpu_count) == ("NVIDIA H100 80GB HBM3", 3)
