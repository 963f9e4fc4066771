"""An arm64 machine's CPU model: /proc/cpuinfo has no "model name" there, so the agent reports
the first CPU's MIDR fields and the raw SMBIOS processor structure, and metald names the CPU
(metald.inventory.cpuname). Real captures from Grace, Ampere Altra and Azure Cobalt 100 hosts
(tests/fixtures/cpu/SOURCES.md), run through the real agent under busybox."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from metald.inventory import normalize, parse_payload
from metald.inventory.cpuname import PARTS, from_midr, from_smbios, smbios_type4_strings
from metald.inventory.schema import InventoryError, Midr
from tests.inventory.conftest import ROOT, payload
from tests.inventory.fakesys import FakeSys
from tests.inventory.receiver import Receiver
from tests.inventory.test_agent import BUSYBOX, run_agent
from tests.inventory.test_agent import busybox_bin as busybox_bin  # the fixture

CPU_FIXTURES = ROOT / "tests" / "fixtures" / "cpu"


def type4_from_dmidecode(text: str) -> bytes:
    """The raw SMBIOS type 4 structure a ``dmidecode -t 4`` record was decoded from, encoded
    back by DSP0134 7.5: the formatted area dmidecode names the length of, string numbers at
    07h (manufacturer), 10h (version), 04h (socket), 20h-22h (serial, asset tag, part
    number), "<BAD INDEX>" as a number past the strings; bytes dmidecode does not show are 0."""
    length = int(re.search(r"DMI type 4, (\d+) bytes", text)[1])  # type: ignore[index]
    fields = dict(re.findall(r"^\s+([A-Za-z ]+): (.*)$", text, re.M))
    raw = bytearray(length)
    raw[0:4] = bytes([4, length]) + struct.pack("<H", 6)
    strings: list[bytes] = []
    bad = 0xFF
    for offset, name in (
        (0x04, "Socket Designation"),
        (0x07, "Manufacturer"),
        (0x10, "Version"),
        (0x20, "Serial Number"),
        (0x21, "Asset Tag"),
        (0x22, "Part Number"),
    ):
        value = fields.get(name, "Not Specified")
        if value == "<BAD INDEX>":
            raw[offset] = bad
        elif value != "Not Specified":
            strings.append(value.encode())
            raw[offset] = len(strings)
    raw[0x08:0x10] = bytes.fromhex(fields["ID"].replace(" ", ""))
    raw[0x23] = raw[0x24] = raw[0x25] = int(fields["Core Count"])
    return bytes(raw) + b"\0".join(strings) + b"\0\0"


def arm64_host(root: Path, cpuinfo: str, type4: bytes | None = None) -> FakeSys:
    fs = FakeSys(root)
    fs.dmi({"sys_vendor": "NVIDIA", "product_name": "P4242", "product_uuid": "1" * 32})
    fs.write("proc/cpuinfo", cpuinfo)
    fs.memory(total_kb=500_000_000, block_bytes=1 << 30, blocks=480)
    fs.nic("enP5p1s0f0", "b8:3f:d2:00:00:01", "0005:01:00.0", "mlx5_core", speed=100000)
    fs.disk("nvme0n1", 3_840_755_982_336, "SAMSUNG MZ1L23T8HBLA-00A07", "S6EUNE0T000001")
    if type4 is not None:
        (root / "sys/firmware/dmi/entries/4-0").mkdir(parents=True)
        (root / "sys/firmware/dmi/entries/4-0/raw").write_bytes(type4)
    return fs


pytestmark_busybox = pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed")


@pytest.mark.parametrize(
    ("fixture", "midr", "name"),
    [
        ("proc-cpuinfo_nvidia-grace_quanta.txt", ("0x41", "0x0", "0xd4f", "0"), "ARM Neoverse-V2"),
        ("proc-cpuinfo_ampere-altra_wiwynn-mt-jade.txt", ("0x41", "0x3", "0xd0c", "1"), "ARM Neoverse-N1"),
        ("proc-cpuinfo_azure-cobalt-100.txt", ("0x41", "0x0", "0xd49", "0"), "ARM Neoverse-N2"),
    ],
)  # fmt: skip
@pytestmark_busybox
async def test_the_agent_reports_the_midr_and_metald_names_the_core(
    fixture,
    midr,
    name,
    tmp_path,
    busybox_bin,
    aiohttp_server,  # noqa: F811
):
    rec = Receiver(actions=[{"action": "poweroff"}])
    server = await aiohttp_server(rec.app())
    fs = arm64_host(tmp_path / "root", (CPU_FIXTURES / fixture).read_text())
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    payload = parse_payload(rec.posts[0]["body"])
    assert payload.cpu.model is None  # arm64: no "model name"
    m = payload.cpu.midr
    assert m is not None
    assert (m.implementer, m.variant, m.part, m.revision) == midr
    assert payload.cpu.smbios_type4 is None
    assert normalize(payload).cpu_model == name


@pytestmark_busybox
async def test_smbios_type4_wins_over_the_midr(tmp_path, busybox_bin, aiohttp_server):  # noqa: F811
    """A Grace host whose firmware names its processor: "NVIDIA Grace A02", not the core."""
    rec = Receiver(actions=[{"action": "poweroff"}])
    server = await aiohttp_server(rec.app())
    type4 = type4_from_dmidecode((CPU_FIXTURES / "dmidecode-t4_nvidia-grace.txt").read_text())
    cpuinfo = (CPU_FIXTURES / "proc-cpuinfo_nvidia-grace_quanta.txt").read_text()
    rc, log = await run_agent(
        arm64_host(tmp_path / "root", cpuinfo, type4), busybox_bin, server.port
    )
    assert rc == 0, log
    payload = parse_payload(rec.posts[0]["body"])
    assert payload.cpu.smbios_type4 == type4.hex()
    assert normalize(payload).cpu_model == "NVIDIA Grace A02"


def test_the_type4_strings_are_read_by_their_numbers() -> None:
    raw = type4_from_dmidecode((CPU_FIXTURES / "dmidecode-t4_nvidia-grace.txt").read_text())
    # part number and asset tag are "<BAD INDEX>": past the strings, so nothing
    assert smbios_type4_strings(raw) == {
        "manufacturer": "NVIDIA",
        "version": "Grace A02",
        "part_number": None,
    }


def test_a_part_number_that_says_more_is_kept() -> None:
    """EDITED record, not a capture: an Ampere Altra's type 4 as a public dmidecode -t 4 shows
    it (Manufacturer "Ampere(R)", Version "Ampere(R) Altra(R) Processor", Part Number
    "Q80-30"), encoded the same way."""
    record = (
        "Handle 0x0003, DMI type 4, 51 bytes\n\tSocket Designation: CPU01\n"
        "\tManufacturer: Ampere(R)\n\tID: 01 00 16 0A A1 00 00 00\n"
        "\tVersion: Ampere(R) Altra(R) Processor\n\tSerial Number: Not Specified\n"
        "\tAsset Tag: Not Set\n\tPart Number: Q80-30\n\tCore Count: 80\n"
    )
    assert from_smbios(type4_from_dmidecode(record).hex()) == "Ampere(R) Altra(R) Processor Q80-30"


@pytest.mark.parametrize(
    "version",
    ["virt-7.2", "pc-q35-7.2", "Not Specified", "To Be Filled By O.E.M.", "", "0000000000"],
)
def test_placeholders_and_qemus_machine_type_name_nothing(version: str) -> None:
    record = (
        "Handle 0x0400, DMI type 4, 48 bytes\n\tSocket Designation: CPU 0\n\tManufacturer: QEMU\n"
        f"\tID: 00 00 00 00 00 00 00 00\n\tVersion: {version or 'Not Specified'}\n"
        "\tCore Count: 2\n"
    )
    assert from_smbios(type4_from_dmidecode(record).hex()) is None
    assert (
        normalize(
            parse_payload(
                {
                    **payload(),
                    "cpu": {
                        "arch": "aarch64",
                        "logical": 2,
                        "midr": {"implementer": "0x41", "part": "0xd08"},
                        "smbios_type4": type4_from_dmidecode(record).hex(),
                    },
                }
            )
        ).cpu_model
        == "ARM Cortex-A72"
    )


@pytest.mark.parametrize(
    ("midr", "name"),
    [
        (Midr(implementer="0x41", part="0xd4f"), "ARM Neoverse-V2"),
        (Midr(implementer="0x41", part="0xd40"), "ARM Neoverse-V1"),
        (Midr(implementer="0x41", part="0xd07"), "ARM Cortex-A57"),
        (Midr(implementer="0x41", part="0xd08"), "ARM Cortex-A72"),
        (Midr(implementer="0xc0", part="0xac3"), "AmpereOne"),
        # the whole register when /proc/cpuinfo is unreadable: QEMU's cortex-a72 (r0p3)
        (Midr(midr_el1="0x00000000410fd083"), "ARM Cortex-A72"),
        (Midr(implementer="0x41", part="0xfff"), "ARM part 0xfff"),
        (Midr(implementer="0x99", part="0x1"), "implementer 0x99 part 0x001"),
        (Midr(), None),
    ],
)
def test_the_midr_table(midr: Midr, name: str | None) -> None:
    assert from_midr(midr) == name


def test_every_named_part_has_a_known_implementer() -> None:
    from metald.inventory.cpuname import IMPLEMENTERS

    assert {i for i, _ in PARTS} <= set(IMPLEMENTERS)


def test_a_malformed_structure_names_nothing() -> None:
    assert smbios_type4_strings(b"\x04\x05") == {
        "manufacturer": None,
        "version": None,
        "part_number": None,
    }
    assert from_smbios("04") is None
    with pytest.raises(InventoryError):
        parse_payload({**payload(), "cpu": {"logical": 1, "smbios_type4": "zz"}})
