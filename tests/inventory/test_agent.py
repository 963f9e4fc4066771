"""The discovery agent (POSIX sh) run on the host under busybox, against fake /sys and /proc
trees built from real captures and a local HTTP receiver on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from metald.inventory import normalize, parse_payload
from tests.inventory.conftest import AGENT, BOOT_ID, FIXTURES, fixture_text
from tests.inventory.fakesys import FakeSys, parse_dmidecode_system, parse_lspci_nn
from tests.inventory.receiver import Receiver
from tests.inventory.test_normalize import IPMITOOL

BUSYBOX = shutil.which("busybox")
pytestmark = pytest.mark.skipif(BUSYBOX is None, reason="busybox (busybox-static) is not installed")

#: Applets the agent uses; the test PATH holds only these, as busybox, like the image.
APPLETS = [
    "sh",
    "cat",
    "tr",
    "awk",
    "sed",
    "head",
    "wc",
    "readlink",
    "sleep",
    "timeout",
    "wget",
    "mkdir",
    "sync",
    "printf",
    "echo",
    "command",
    "od",
]


@pytest.fixture
def busybox_bin(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    for applet in APPLETS:
        (d / applet).symlink_to(BUSYBOX)
    return d


def fake_tool(bin_dir: Path, name: str, output_file: Path) -> None:
    tool = bin_dir / name
    tool.write_text(f"#!{BUSYBOX} sh\ncat '{output_file}'\n")
    tool.chmod(0o755)


def xe9680(root: Path) -> FakeSys:
    fs = FakeSys(root)
    fs.dmi(parse_dmidecode_system(fixture_text("dmidecode-t-system_dell-poweredge-xe9680.txt")))
    fs.cpus("Intel(R) Xeon(R) Platinum 8480+", sockets=2, cores=56)
    fs.memory(total_kb=2_100_000_000, block_bytes=2 << 30, blocks=1024)
    fs.nic("eno8303", "b0:7b:25:aa:bb:01", "0000:04:00.0", "tg3", speed=1000)
    fs.nic("ens1f0np0", "a0:88:c2:00:00:10", "0000:4b:00.0", "mlx5_core", speed=-1, carrier="0")
    fs.virtual_nic("br0", "02:00:00:00:00:01")
    # InfiniBand: 20-byte hardware address, not an Ethernet MAC
    fs.nic(
        "ibp12s0",
        "00:00:10:29:fe:80:00:00:00:00:00:00:a0:88:c2:03:00:12:34:56",
        "0000:0c:00.0",
        "mlx5_core",
    )
    fs.disk(
        "nvme0n1", 3_840_755_982_336, "Dell Ent NVMe CM6 RI 3.84TB", "S5Z1NA0R900123",
        pci="0000:5e:00.0",
    )  # fmt: skip
    fs.disk("sda", 480_103_981_056, "BOSS-N1", "PHYG1234", rotational=1)
    (root / "sys/block/loop0").mkdir()
    for addr, vendor, device, cls in parse_lspci_nn(
        fixture_text("lspci-nn_8x-a100-sxm4-80gb_nvswitch_cx6-vf.txt")
    ):
        fs.pci(addr, vendor, device, cls, driver="nvidia" if vendor == 0x10DE else None)
    return fs


async def run_agent(
    fs: FakeSys, bin_dir: Path, port: int, *, cmdline: str | None = None, **env: str
) -> tuple[int, str]:
    fs.boot(
        BOOT_ID,
        cmdline
        if cmdline is not None
        else f"console=ttyS0 metald.url=http://127.0.0.1:{port}/ metald.token=agent-token metald.machine=m-1",
    )
    environ = {
        "PATH": str(bin_dir),
        "METALD_SYSROOT": str(fs.root),
        "METALD_STATE_DIR": str(fs.root / "run"),
        "METALD_DRY_RUN": "1",
        "METALD_RETRY_MAX": "0",
        **env,
    }
    proc = await asyncio.create_subprocess_exec(
        BUSYBOX,
        "sh",
        str(AGENT),
        env=environ,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode, out.decode()


async def test_agent_posts_the_inventory_of_a_gpu_server(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver(actions=[{"action": "wait", "retry_after_s": 0}, {"action": "poweroff"}])
    server = await aiohttp_server(rec.app())
    fake_tool(busybox_bin, "ipmitool", _write(tmp_path / "lan.txt", IPMITOOL))
    rc, log = await run_agent(xe9680(tmp_path / "root"), busybox_bin, server.port)
    assert rc == 0, log
    assert "] inventory posted (" in log
    assert "] dry run: would poweroff" in log
    assert rec.next_calls == 2  # "wait" was followed by asking again
    assert "asking again in 0s" in log  # after the answer's retry_after_s
    (post,) = rec.posts
    assert rec.headers[0]["Authorization"] == "Bearer agent-token"
    body = post["body"]
    p = parse_payload(body)
    assert (p.machine_id, p.boot_id, p.sequence) == ("m-1", BOOT_ID, 1)
    inv = normalize(p)
    assert (inv.vendor, inv.product, inv.serial) == ("Dell Inc.", "PowerEdge XE9680", "HSR8X04")
    assert inv.system_uuid == "4c4c4544-0053-5210-8038-c8c04f583034"
    assert (inv.cpu_count, inv.cpu_sockets, inv.cpu_cores) == (224, 2, 112)
    assert inv.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert inv.memory_mb == 2 * 1024 * 1024
    assert (inv.gpu_model, inv.gpu_count) == ("NVIDIA A100-SXM4-80GB", 8)
    assert len(p.pci) == len(
        fixture_text("lspci-nn_8x-a100-sxm4-80gb_nvswitch_cx6-vf.txt").splitlines()
    )
    assert {n.name: (n.mac, n.driver, n.link, n.speed_mbps, n.pci_address) for n in inv.nics} == {
        "eno8303": ("b0:7b:25:aa:bb:01", "tg3", True, 1000, "0000:04:00.0"),
        "ens1f0np0": ("a0:88:c2:00:00:10", "mlx5_core", False, None, "0000:4b:00.0"),
    }
    disks = {d.name: d for d in inv.disks}
    assert set(disks) == {"nvme0n1", "sda"}
    assert disks["nvme0n1"].size_bytes == 3_840_755_982_336 // 512 * 512
    assert (disks["sda"].rotational, disks["sda"].model) == (True, "BOSS-N1")
    # /dev/disk/by-path as udev names an NVMe namespace; SATA's numbering is not in sysfs alone
    assert {d.name: d.by_path for d in p.disks} == {
        "nvme0n1": "pci-0000:5e:00.0-nvme-1",
        "sda": None,
    }
    assert inv.bmc is not None and inv.bmc.address == "10.20.30.41"
    assert body["raw"]["nvidia_smi_xml"] is None and body["raw"]["lldpctl"] is None


async def test_agent_sends_nvidia_smi_xml_when_present(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver()
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus("x", 1, 1, 1)
    fs.pci("0000:01:00.0", 0x10DE, 0x20B2, 0x0302, driver="nvidia")
    fake_tool(
        busybox_bin, "nvidia-smi", FIXTURES / "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
    )
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    body = rec.posts[0]["body"]
    # the XML arrives intact through the shell's JSON escaping (but for its final newline)
    assert body["raw"]["nvidia_smi_xml"] == fixture_text(
        "nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
    ).rstrip("\n")
    (gpu,) = normalize(parse_payload(body)).gpus
    assert (gpu.model, gpu.serial, gpu.source) == (
        "NVIDIA A100-SXM4-80GB",
        "1650522003820",
        "nvidia-smi",
    )


async def test_agent_reports_infiniband_port_guids(tmp_path, busybox_bin, aiohttp_server):
    """Fails on the old agent: it sent no infiniband list (the leaf could not be matched)."""
    rec = Receiver()
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus("x", 1, 1, 1)
    fs.ib_port("mlx5_0", 1, "fe80:0000:0000:0000:a088:c203:0012:3456", "a088:c203:0012:3456")
    fs.ib_port("mlx5_1", 1, "fe80:0000:0000:0000:a088:c203:0012:3457", "a088:c203:0012:3457")
    fs.ib_port("mlx5_2", 1, "zz", "0000:0000:0000:0000")  # unreadable GID: left out
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    inv = normalize(parse_payload(rec.posts[0]["body"]))
    assert [(p.device, p.port, p.port_guid, p.node_guid) for p in inv.infiniband] == [
        ("mlx5_0", 1, "0xa088c20300123456", "0xa088c20300123456"),
        ("mlx5_1", 1, "0xa088c20300123457", "0xa088c20300123457"),
    ]
    assert inv.infiniband[0].rate == "400 Gb/sec (4X NDR)"


async def test_agent_escapes_hostile_strings(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver()
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus('Weird "CPU" \\ model\twith tab', 1, 2, 1)
    fs.dmi(
        {
            "sys_vendor": 'Acme "Servers" \\Inc\\',
            "product_name": "Box\x01\x1b[31m\x7fé",
            "product_serial": "SN-1",
        }
    )
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    p = parse_payload(rec.posts[0]["body"])
    assert p.system.vendor == 'Acme "Servers" \\Inc\\'
    assert p.system.product == "Box[31m"  # control bytes and non-ASCII dropped
    assert p.cpu.model == 'Weird "CPU" \\ model\twith tab'
    assert (p.cpu.logical, p.cpu.sockets, p.cpu.cores) == (2, 1, 2)


async def test_agent_retries_with_a_new_sequence_each_time(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver(post_statuses=[503, 500])
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus("x", 1, 1, 1)
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    assert [p["status"] for p in rec.posts] == [503, 500, 200]
    assert [p["body"]["sequence"] for p in rec.posts] == [1, 2, 3]
    assert {p["body"]["boot_id"] for p in rec.posts} == {BOOT_ID}
    assert log.count("inventory post failed") == 2


async def test_agent_follows_inspect_by_posting_again(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver(actions=[{"action": "inspect"}, {"action": "reboot"}])
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus("x", 1, 1, 1)
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    assert [p["body"]["sequence"] for p in rec.posts] == [1, 2]
    assert "dry run: would reboot" in log


async def test_agent_env_overrides_and_wrong_token(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver()
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus("x", 1, 1, 1)
    rc, log = await run_agent(
        fs,
        busybox_bin,
        server.port,
        cmdline="quiet",
        METALD_URL=f"http://127.0.0.1:{server.port}",
        METALD_TOKEN="wrong",
        METALD_MAX_TRIES="2",
    )
    assert rc == 1
    assert log.count("inventory post failed") == 2 and "401" in log
    assert rec.posts == []


async def test_agent_without_url_does_nothing(tmp_path, busybox_bin):
    fs = FakeSys(tmp_path / "root")
    rc, log = await run_agent(fs, busybox_bin, 1, cmdline="console=ttyS0 quiet")
    assert rc == 2
    assert "no metald.url=" in log


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def test_oversized_or_failing_tool_output_is_left_out(tmp_path, busybox_bin, aiohttp_server):
    rec = Receiver()
    server = await aiohttp_server(rec.app())
    fs = FakeSys(tmp_path / "root")
    fs.cpus("x", 1, 1, 1)
    fake_tool(
        busybox_bin, "nvidia-smi", _write(tmp_path / "big.xml", "<x>" + "a" * 800_000 + "</x>\n")
    )
    failing = busybox_bin / "ipmitool"
    failing.write_text(f"#!{BUSYBOX} sh\necho 'Could not open device' ; exit 1\n")
    failing.chmod(0o755)
    fake_tool(
        busybox_bin,
        "lldpctl",
        _write(
            tmp_path / "lldp.txt", "lldp.eth0.chassis.name=leaf-1\nlldp.eth0.port.ifname=swp3\n"
        ),
    )
    rc, log = await run_agent(fs, busybox_bin, server.port)
    assert rc == 0, log
    p = parse_payload(rec.posts[0]["body"])  # still a valid payload
    assert (p.raw.nvidia_smi_xml, p.raw.ipmitool_lan_print) == (None, None)
    assert normalize(p).rack_position_hint == "leaf-1/swp3"
