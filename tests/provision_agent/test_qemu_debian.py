"""A real OS through the tenant's own configuration (issue 32): the Debian 12 image
(systemd, cloud-init, netplan, mdadm; ``bootassets/debian.py``) deployed by the real discovery
image onto a RAID1 root over two disks of a QEMU machine with three NICs, then booted from
those disks. From inside the machine, over SSH with the claim's key on the static address
the claim's network put on a VLAN over a bond of two NICs: ``ip -d link`` shows the bond and
the VLAN, ``/proc/mdstat`` the mirror, and the tenant's user-data wrote its file. Then a wipe
boot clears both members of the array.

What metald decides is computed by metald's own code (the storage plan, the netplan
network-config from a pool, the NoCloud files with the tenant's user-data and metald's
vendor-data); the deploy agent reads it from the stand-in API the other agent lab tests use
(tests/provision_agent/server.py).

METALD_LAB_LONG=1 only (make test-long): three TCG boots and a ~900 MB image, several minutes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.provision.metadata import nocloud
from metald.provision.netplan import NicInfo, Pool, render
from metald.provision.storage import DiskInfo, plan
from metald.provision.userdata import check
from tests.provision_agent.conftest import MIB, ROOT
from tests.provision_agent.test_qemu_storage import md_superblocks
from tests.qemu_netns import QEMU_IN_NETNS, bridge_netns, metald_standin, run_guest, start, stop

pytestmark = [
    *QEMU_IN_NETNS,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="a Debian image and three TCG boots: set METALD_LAB_LONG=1 (make test-long)",
    ),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap is not installed"),
    pytest.mark.skipif(shutil.which("ssh") is None, reason="the OpenSSH client is not installed"),
]

SERVER = "10.79.0.1"
PORT = 8080
#: The PXE NIC, then the two the bond takes (QEMU PCI slots 3, 4, 5).
NICS = [
    NicInfo("eth0", "52:54:00:6d:79:01", "0000:00:03.0", pxe=True),
    NicInfo("eth1", "52:54:00:6d:79:02", "0000:00:04.0"),
    NicInfo("eth2", "52:54:00:6d:79:03", "0000:00:05.0"),
]
TAPS = ("tap0", "tap1", "tap2")
VLAN = 100
POOL = Pool("tenant", "10.79.100.0/24", start="10.79.100.10", end="10.79.100.20", vlan=VLAN)
PEER_ON_VLAN = "10.79.100.1"
MARK = "written by the tenant's user-data"
USER_DATA = f"""#cloud-config
write_files:
  - path: /root/tenant-file.txt
    content: "{MARK}\\n"
    permissions: "0640"
runcmd:
  - [sh, -c, "echo runcmd ran > /root/runcmd.txt"]
"""


@pytest.fixture
def netns() -> Iterator[str]:
    with bridge_netns(f"mddeb{os.getpid()}", SERVER, TAPS) as name:
        yield name


#: Runs in the namespace: the frames on an interface until one carries an 802.1Q tag (or the
#: time is up): its source MAC and VLAN id (this host's kernel has no 8021q, so the tag is
#: read off the wire).
CAPTURE = """
import socket, struct, sys, time
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
s.setsockopt(263, 8, 1)  # SOL_PACKET, PACKET_AUXDATA: the tag the kernel took off on receive
s.bind((sys.argv[1], 0))
s.settimeout(0.5)
end, seen = time.monotonic() + float(sys.argv[2]), set()
while time.monotonic() < end and not seen:
    try:
        f, anc, _, _ = s.recvmsg(2048, socket.CMSG_SPACE(20))
    except TimeoutError:
        continue
    if f[12:14] == b"\\x81\\x00":
        seen.add((f[6:12].hex(":"), int.from_bytes(f[14:16], "big") & 0xFFF))
    for level, kind, data in anc:
        status, *_, tci, _tpid = struct.unpack("IIIHHHH", data[:20])
        if level == 263 and kind == 8 and status & 0x10:  # TP_STATUS_VLAN_VALID
            seen.add((f[6:12].hex(":"), tci & 0xFFF))
print(sorted(seen))
"""


@pytest.fixture(scope="session")
def debian_image() -> Path:
    from bootassets.debian import ensure_debian_built

    t0 = time.monotonic()
    built = ensure_debian_built()
    print(f"\nDebian image ready in {time.monotonic() - t0:.1f} s: {built}")
    return built


@pytest.fixture(scope="session")
def discovery() -> Path:
    from bootassets.build import ensure_built

    return ensure_built() / "discovery"


def nic_args(mac_tap: list[tuple[str, str]]) -> list[str]:
    args = []
    for i, (mac, tap) in enumerate(mac_tap):
        args += ["-netdev", f"tap,id=n{i},ifname={tap},script=no,downscript=no"]
        # no option ROM: SeaBIOS boots the disk, the discovery image comes as -kernel
        args += ["-device", f"virtio-net-pci,netdev=n{i},mac={mac},addr={3 + i},romfile="]
    return args


def ssh(
    key: Path, ns: str, host: str, command: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "ssh", "-i", str(key), "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=5", f"root@{host}", command],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


ADDRESS = POOL.candidates()[0]


def leased(tmp_path: Path, mac: str) -> list[str]:
    """The addresses the namespace's udhcpd leased to ``mac`` (SIGUSR1 makes it write its
    lease file now)."""
    try:  # a udhcpd just started has not written it yet (the last one removed its own)
        pid = int((tmp_path / "udhcpd.pid").read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return []
    os.kill(pid, signal.SIGUSR1)
    time.sleep(0.5)
    out = subprocess.run(
        ["busybox", "dumpleases", "-f", str(tmp_path / "leases")],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return [line.split()[1] for line in out.splitlines() if line.lower().startswith(mac)]


def test_debian_with_bond_vlan_static_raid1_and_user_data(debian_image, discovery, netns, tmp_path):
    load = os.getloadavg()
    image = debian_image / "disk.raw"
    manifest = json.loads((debian_image / "manifest.json").read_text())
    size = manifest["files"]["disk.raw"]["size"]
    disk_bytes = -(-(size + 64 * MIB) // (64 * MIB)) * 64 * MIB
    disks = [DiskInfo(n, disk_bytes, model="QEMU HARDDISK", serial=n) for n in ("vda", "vdb")]
    storage = plan({"root": {"raid": 1, "disks": [{"serial": "vda"}, {"serial": "vdb"}]}}, disks)
    given: dict[str, str] = {}

    def allocate(pool: str, user: str) -> str:
        given[user] = POOL.candidates()[len(given)]
        return given[user]

    network = render(
        {
            "bonds": [
                {"name": "bond0", "mode": "active-backup", "nics": [{"role": "data:0"},
                                                                    {"role": "data:1"}]}
            ],
            "vlans": [{"link": "bond0", "network": "tenant"}],
        },
        NICS,
        {"tenant": POOL},
        allocate,
    )  # fmt: skip
    assert given == {f"bond0.{VLAN}": ADDRESS}, given
    assert check(USER_DATA).form == "cloud-config"
    key = tmp_path / "claim_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    files = nocloud(
        machine_id="lab-deb-1",
        name="tenant-node-1",
        pxe_mac=NICS[0].mac,
        ssh_authorized_keys=[(tmp_path / "claim_key.pub").read_text().strip()],
        user_data=USER_DATA,
        network=network,
    )
    assert "vendor-data" in files  # metald's keys and hostname travel beside the tenant's
    config = {
        "image_path": str(image),
        "provision": {
            "action": "provision",
            "machine_id": "lab-deb-1",
            "image": {
                "id": "debian-12",
                "kind": "disk",
                "url": f"http://{SERVER}:{PORT}/image",
                "sha256": manifest["files"]["disk.raw"]["sha256"],
                "format": "raw",
                "size_bytes": size,
            },
            "nocloud": files,
            "storage": storage.to_dict(),
        },
    }
    drives = []
    for i, name in enumerate(("vda", "vdb")):
        with open(tmp_path / f"{name}.img", "wb") as f:
            f.truncate(disk_bytes)
            f.write(os.urandom(MIB))  # a stale first MiB, as a used disk has
        drives += ["-drive", f"file={tmp_path / name}.img,format=raw,if=none,id=d{i}"]
        boot_index = ",bootindex=1" if i == 0 else ""
        drives += ["-device", f"virtio-blk-pci,drive=d{i},serial={name}{boot_index}"]
    nics = nic_args([(n.mac, t) for n, t in zip(NICS, TAPS, strict=True)])
    times: dict[str, float] = {}

    # 1. deploy: the discovery image's agent builds md0 over vda+vdb and writes the image on it
    console = tmp_path / "deploy.log"
    with metald_standin(
        netns, tmp_path, ROOT / "tests/provision_agent/server.py", SERVER, PORT,
        tmp_path / "progress.jsonl", config,
    ) as reports:  # fmt: skip
        qemu = [
            "qemu-system-x86_64", "-accel", "tcg", "-m", "512", "-smp", "2",
            "-kernel", str(discovery / "vmlinuz"), "-initrd", str(discovery / "initrd.img"),
            "-append", f"console=ttyS0 quiet no_timer_check metald.url=http://{SERVER}:{PORT} metald.token=agent-token metald.machine=lab-deb-1 metald.mode=deploy",
            "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
            *nics, *drives,
        ]  # fmt: skip
        t0 = time.monotonic()
        rc, log = run_guest(netns, qemu, tmp_path, console, timeout=1800)
        times["deploy boot (write + verify on the RAID1)"] = time.monotonic() - t0
        got = [json.loads(line) for line in reports.read_text().splitlines()]
    print("\n".join(line for line in log.splitlines() if "metald-agent:" in line))
    assert rc == 0 and got and got[-1] == {"phase": "deploy", "done": True}, (got, log[-3000:])
    assert "first-boot metadata written to /dev/md0p1" in log, log[-3000:]

    # 2. first boot of Debian from the mirror: systemd, cloud-init, netplan, sshd. SSH comes
    # in over the PXE NIC (DHCP from the namespace's udhcpd): this host's kernel has no 8021q
    # to terminate the tenant VLAN, so the VLAN's tagged frames are read off the bond's wire.
    console = tmp_path / "debian.log"
    qemu = [
        "qemu-system-x86_64", "-accel", "tcg", "-m", "1024", "-smp", "2",
        "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
        *nics, *drives,
    ]  # fmt: skip
    out: dict[str, subprocess.CompletedProcess[str]] = {}
    with metald_standin(
        netns, tmp_path, ROOT / "tests/provision_agent/server.py", SERVER, PORT,
        tmp_path / "progress2.jsonl",
    ):  # fmt: skip
        t0 = time.monotonic()
        vm = start(netns, qemu, tmp_path / "qemu-debian.log")
        try:
            deadline, host = t0 + 1500, ""
            while not host:
                assert vm.poll() is None, console.read_text(errors="replace")[-4000:]
                for addr in leased(tmp_path, NICS[0].mac):
                    if ssh(key, netns, addr, "true", timeout=30).returncode == 0:
                        host = addr
                        break
                else:
                    assert time.monotonic() < deadline, console.read_text(errors="replace")[-6000:]
                    time.sleep(5)
            times["first boot to SSH with the claim's key"] = time.monotonic() - t0
            out["cloud-init"] = ssh(key, netns, host, "cloud-init status --wait --long", 900)
            times["first boot to cloud-init done"] = time.monotonic() - t0
            out["links"] = ssh(
                key, netns, host, "ip -d link show bond0; ip -d link show bond0.100; ip -br addr"
            )
            out["mdstat"] = ssh(key, netns, host, "cat /proc/mdstat; findmnt -no SOURCE /")
            out["tenant"] = ssh(
                key, netns, host, "cat /root/tenant-file.txt /root/runcmd.txt; hostname"
            )
            out["os"] = ssh(
                key, netns, host,
                ". /etc/os-release; echo $PRETTY_NAME; systemctl is-system-running; uname -r",
            )  # fmt: skip
            # traffic to the VLAN's peer leaves the bond tagged with the pool's VLAN id
            cap = subprocess.Popen(
                ["ip", "netns", "exec", netns, sys.executable, "-c", CAPTURE, "br0", "90"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            time.sleep(2)
            send = (
                'python3 -c "import socket; s = socket.socket(socket.AF_INET, '
                f"socket.SOCK_DGRAM); [s.sendto(b'x', ('{PEER_ON_VLAN}', 9)) for _ in range(3)]\""
            )
            out["send"] = ssh(key, netns, host, send)
            out["wire"] = subprocess.CompletedProcess([], 0, cap.communicate(timeout=120)[0], "")
            for what, res in out.items():
                print(f"--- {what} (rc {res.returncode})\n{res.stdout}{res.stderr}")
            ssh(key, netns, host, "systemctl poweroff", timeout=30)
            with contextlib.suppress(subprocess.TimeoutExpired):
                vm.wait(timeout=120)
        finally:
            stop(vm)
    assert "status: done" in out["cloud-init"].stdout, out["cloud-init"]
    links = out["links"].stdout
    assert "bond mode active-backup" in links and "miimon 100" in links, links
    assert f"vlan protocol 802.1Q id {VLAN}" in links, links
    assert f"{ADDRESS}/24" in links, links
    # the VLAN's frames (its broadcasts reach the bridge itself) carry the pool's VLAN id and
    # the bond's own MAC (systemd-networkd gives a bond a MAC of its own, not a member's)
    vlan_mac = re.search(rf"bond0\.{VLAN}@bond0: .*\n\s+link/ether (\S+)", links)
    assert vlan_mac, links
    assert f"('{vlan_mac.group(1)}', {VLAN})" in out["wire"].stdout, out["wire"]
    mdstat = out["mdstat"].stdout
    assert "active raid1" in mdstat and "[2/2]" in mdstat, mdstat
    assert mdstat.strip().splitlines()[-1].startswith("/dev/md"), mdstat
    assert MARK in out["tenant"].stdout and "runcmd ran" in out["tenant"].stdout, out["tenant"]
    assert "tenant-node-1" in out["tenant"].stdout, out["tenant"]
    assert "Debian GNU/Linux 12" in out["os"].stdout, out["os"]
    # no failed unit (mdmonitor.service failed when the agent dropped the image's MAILADDR)
    assert "\nrunning\n" in out["os"].stdout, out["os"]

    # 3. release: the wipe boot clears both members of the array
    console = tmp_path / "wipe.log"
    (tmp_path / "progress.jsonl").unlink(missing_ok=True)
    with metald_standin(
        netns, tmp_path, ROOT / "tests/provision_agent/server.py", SERVER, PORT,
        tmp_path / "progress.jsonl",
    ) as reports:  # fmt: skip
        qemu = [
            "qemu-system-x86_64", "-accel", "tcg", "-m", "512", "-smp", "2",
            "-kernel", str(discovery / "vmlinuz"), "-initrd", str(discovery / "initrd.img"),
            "-append", f"console=ttyS0 quiet no_timer_check metald.url=http://{SERVER}:{PORT} metald.token=agent-token metald.machine=lab-deb-1 metald.mode=wipe",
            "-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot",
            *nics, *drives,
        ]  # fmt: skip
        t0 = time.monotonic()
        rc, log = run_guest(netns, qemu, tmp_path, console, timeout=300)
        times["wipe boot"] = time.monotonic() - t0
        got = [json.loads(line) for line in reports.read_text().splitlines()]
    assert got and got[-1].get("done") is True, (got, log[-3000:])
    assert len(got[-1]["disks"]) == 2
    for name in ("vda", "vdb"):
        with open(tmp_path / f"{name}.img", "rb") as disk:
            head = disk.read(MIB)
            disk.seek(disk_bytes - MIB)
            tail = disk.read(MIB)
        assert head == bytes(MIB) and tail == bytes(MIB), name
        data = (tmp_path / f"{name}.img").read_bytes()
        assert md_superblocks(data) == [], name
    print(f"image {size} bytes, disks {disk_bytes} bytes each; load average before {load}")
    for what, secs in times.items():
        print(f"{secs:8.1f} s  {what}")
