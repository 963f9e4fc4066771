"""The tenant's OS through a running metald, end to end (issue 32): a QEMU machine with three
NICs (the PXE NIC on the lab's boot network, two on its data network) and two disks, with a
virtual BMC, powers on through metald, PXE-boots metald's own iPXE and the discovery image,
is inspected and commissioned (a profile that wants both disks) and becomes ready. An
orchestrator then claims it through metald's HTTP API with the Debian 12 image (systemd,
cloud-init; ``bootassets/debian.py``), the tenant's user-data (a file written, a command run,
a package list), a network request (an active-backup bond of the two data NICs, a VLAN on it,
a static address from metald's IPAM pool) and a storage layout (a RAID1 root over the two
disks), for a tenant with a Slurm cluster. metald deploys the image; the machine boots Debian
from the mirror and joins the tenant's cluster by itself. From inside the machine, over SSH
with the claim's key: ``ip -d link`` (bond and VLAN), the static address, ``/proc/mdstat``
(RAID1 active, ``/`` on it), the user-data's files, no failed unit, the join unit's own
lines; from the tenant's control plane, ``srun hostname`` answered by the node. The VLAN's
frames are read off the data network (this host's kernel has no 802.1Q to end it). Then the
release: metald wipes the machine, and both disks of the array read back with zeros at both
ends and no md superblock (read once the BMC powered the machine off).

Nothing here stands in for metald: the storage plan, the netplan, the NoCloud seed and the
join answer are the running daemon's. METALD_LAB_LONG=1 only (make test-long): a ~900 MB
image onto a mirror under TCG takes many minutes; it prints the time of each phase.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import waiting
from tests.e2e.conftest import RULES, lab_ipxe_assets, lab_skip_reason
from tests.e2e.test_arm64_lab import _phases, _state_times
from tests.e2e.test_claim_provision_release import disk_ends
from tests.provision_agent.test_qemu_debian import CAPTURE, MARK
from tests.provision_agent.test_qemu_debian import USER_DATA as QEMU_DEBIAN_USER_DATA
from tests.provision_agent.test_qemu_storage import md_superblocks

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 1800
ACTIVE_TIMEOUT_S = 3600
WIPE_TIMEOUT_S = 1800
VLAN = 100
USER_DATA = (
    QEMU_DEBIAN_USER_DATA
    + """# a package the image already has: cloud-init's package module runs (apt-get update, which
# finds no mirror from the lab and goes on, then install) and needs nothing new
packages: [jq]
"""
)
#: Commissioning on a profile this machine meets only with both its disks (the SKU check);
#: no tool checks (their image and runs cost minutes under TCG and prove nothing new here).
COMMISSIONING = (
    '[[enroll.rules]]\nmatch = { product = "vm-lab bios" }\nlabels = { nics = "3" }\n'
    "[enroll.rules.commissioning]\n"
    'name = "two-disk-node"\nmin_cpu_count = 2\n'
    "disks = [{ min_size_gb = 2, count = 2 }]\n"
)


def _skip_reason() -> str | None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        return "a Debian image deployed under TCG takes many minutes: METALD_LAB_LONG=1"
    if shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed"
    if shutil.which("ssh") is None:
        return "the OpenSSH client is not installed"
    return lab_skip_reason()


def _config(state: dict[str, Any]) -> str:
    from vmlab.rack import tenants_config

    k = state["slot"]
    return (
        RULES
        + COMMISSIONING
        + tenants_config(state)
        + f'[provision.networks.tenant]\ncidr = "10.{k}.{VLAN}.0/24"\ngateway = "10.{k}.{VLAN}.1"\n'
        f'start = "10.{k}.{VLAN}.10"\nend = "10.{k}.{VLAN}.20"\nvlan = {VLAN}\n'
    )


@dataclass
class DebianRack:
    rack: Any
    machine: dict[str, Any]
    item: dict[str, Any]
    bmc: dict[str, Any]
    power_on_to_ready_s: float


@pytest.fixture(scope="module")
def debian_rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DebianRack]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack

    work = Path(tmp_path_factory.mktemp("debian-claim"))
    assets = lab_ipxe_assets(work / "assets")
    rack = LabRack(
        f"deb{os.getpid() % 10000}",
        work / "rack",
        machines=1,
        uefi=0,
        nics=3,
        disks=2,
        rng=True,  # metald's iPXE seeds its TLS from the firmware's RNG
        assets=assets,
        extra_config=_config,
    )
    try:
        (m,) = rack.machines
        bmc = rack.register_bmcs(["ipmi"])[m["name"]]
        rack.ctl("bmcs", "power", bmc["id"], "on")
        t_on = time.monotonic()
        ready = rack.wait_state([m["mac"]], "ready", READY_TIMEOUT_S)
        item = rack.machine_by_mac(m["mac"])
        assert item is not None
        yield DebianRack(rack, m, item, bmc, ready[m["mac"]] - t_on)
    finally:
        rack.down()


def _ssh(rack: Any, key: Path, host: str, command: str, timeout: float = 120) -> str:
    argv = ["ssh", "-i", str(key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
            f"root@{host}", command]  # fmt: skip
    r = rack.lab.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"ssh {command!r}: rc {r.returncode}\n{r.stdout}{r.stderr}")
    return str(r.stdout)


def _leased(rack: Any, mac: str) -> str | None:
    """The address metald's DHCP has bound to ``mac`` (its store, read-only)."""
    db = sqlite3.connect(f"file:{rack.state_dir / 'metald.db'}?mode=ro", uri=True, timeout=30)
    try:
        row = db.execute(
            "SELECT ip FROM leases WHERE mac = ? AND state = 'bound' ORDER BY updated_at DESC",
            (mac,),
        ).fetchone()
    finally:
        db.close()
    return row[0] if row else None


def test_enrolled_with_three_nics_and_two_disks_and_commissioned(debian_rack: DebianRack) -> None:
    rack, m, item = debian_rack.rack, debian_rack.machine, debian_rack.item
    full = rack.json("machines", "show", item["id"])
    inv = full["inventory"]["normalized"]
    macs = {n["mac"] for n in inv["nics"]}
    assert macs == {m["mac"], *(n["mac"] for n in m["extra_nics"])}, inv["nics"]
    assert len([d for d in inv["disks"] if d.get("size_bytes") == 2 << 30]) == 2, inv["disks"]
    states = [st for st, _ in _state_times(rack, item["id"])]
    assert states[-3:] == ["inspecting", "commissioning", "ready"], states
    code, doc = rack.api("GET", f"/api/v1/machines/{item['id']}/commissioning")
    assert code == 200 and doc["last"]["status"] == "passed", doc
    print(
        f"\npower-on to ready (inspected, commissioned): {debian_rack.power_on_to_ready_s:.1f} s;"
        f" load average {os.getloadavg()}"
    )


def test_claim_deploys_debian_with_bond_vlan_static_raid1_user_data_and_joins(
    debian_rack: DebianRack, tmp_path: Path
) -> None:
    from metald.provision.metadata import hostname
    from metald.tenants import controlplane

    rack, m, item = debian_rack.rack, debian_rack.machine, debian_rack.item
    load_start = os.getloadavg()
    st, tenant = rack.api("POST", "/api/v1/tenants", {"name": "acme", "cluster_kind": "slurm"})
    assert st == 201, tenant
    st, hub = rack.api("POST", f"/api/v1/tenants/{tenant['id']}/hub", {})
    assert st == 201, hub
    st, image = rack.api("POST", "/api/v1/images", rack.publish_debian_image())
    assert st == 201, image
    key = tmp_path / "claim_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    full = rack.json("machines", "show", item["id"])
    disks = sorted(
        (d for d in full["inventory"]["normalized"]["disks"] if d.get("serial")),
        key=lambda d: d["name"],
    )
    assert len(disks) == 2, full["inventory"]["normalized"]["disks"]
    body = {
        "tenant_id": tenant["id"],
        "count": 1,
        "image_id": image["id"],
        "selector": {"labels": {"nics": "3"}},
        "ssh_authorized_keys": [(tmp_path / "claim_key.pub").read_text().strip()],
        "user_data": USER_DATA,
        "network": {
            "bonds": [
                {
                    "name": "bond0",
                    "mode": "active-backup",
                    "nics": [{"role": "data:0"}, {"role": "data:1"}],
                }
            ],
            "vlans": [{"link": "bond0", "network": "tenant"}],
        },  # fmt: skip
        "storage": {"root": {"raid": 1, "disks": [{"serial": d["serial"]} for d in disks]}},
    }
    t0 = time.monotonic()
    st, claim = rack.api("POST", "/api/v1/claims", body)
    assert st == 201, claim
    assert [x["id"] for x in claim["machines"]] == [item["id"]]
    (given,) = claim["addresses"][item["id"]]
    address = given["address"]
    assert address == f"10.{rack.state['slot']}.{VLAN}.10", claim["addresses"]
    assert claim["user_data"]["form"] == "cloud-config" and "content" not in claim["user_data"]

    def active() -> bool:
        state = rack.json("machines", "show", item["id"])["state"]
        assert state not in ("provision-failed", "join-failed"), rack.diagnostics()
        return bool(state == "active")

    waiting.wait_for("the Debian node active", active, ACTIVE_TIMEOUT_S, every=5, explain=rack.diagnostics)  # fmt: skip
    t_active = time.monotonic() - t0
    times = _state_times(rack, item["id"])

    def idle() -> bool:
        r = controlplane.exec_in(rack.state_dir, tenant["id"], ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=60)  # fmt: skip
        return r.stdout.split()[1:2] == ["idle"]

    waiting.wait_for("the Debian node idle in sinfo", idle, 300, every=3, explain=rack.diagnostics)
    job = controlplane.exec_in(rack.state_dir, tenant["id"], ["srun", "-N1", "hostname"], timeout=180)  # fmt: skip
    assert job.returncode == 0, (job.stdout, job.stderr)

    host = str(
        waiting.wait_for("the node's DHCP lease", lambda: _leased(rack, m["mac"]), 120, every=2)
    )
    out: dict[str, str] = {}
    out["cloud-init"] = _ssh(rack, key, host, "cloud-init status --wait --long", 900)
    t_cloud = time.monotonic() - t0
    out["links"] = _ssh(rack, key, host, f"ip -d link show bond0; ip -d link show bond0.{VLAN}; ip -br addr")  # fmt: skip
    out["mdstat"] = _ssh(rack, key, host, "cat /proc/mdstat; findmnt -no SOURCE /")
    out["tenant"] = _ssh(rack, key, host, "cat /root/tenant-file.txt /root/runcmd.txt; hostname")
    out["os"] = _ssh(
        rack, key, host,
        ". /etc/os-release; echo $PRETTY_NAME; systemctl is-system-running --wait;"
        " systemctl --failed --no-legend --plain",
    )  # fmt: skip
    # the merged cloud-config (image, vendor-data, user-data) passes cloud-init's own schema
    out["schema"] = _ssh(rack, key, host, "grep -c 'Invalid cloud-config' /var/log/cloud-init.log || true")  # fmt: skip
    out["join"] = _ssh(rack, key, host, "journalctl -b -u metald-join --no-pager | tail -n 20")
    # traffic to a peer on the VLAN leaves the bond tagged with the pool's VLAN id
    cap = subprocess.Popen(
        rack.lab.exec_argv([sys.executable, "-c", CAPTURE, rack.state["data_bridge"], "90"]),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(2)  # the capture socket is open before the node sends (decides nothing)
    peer = f"10.{rack.state['slot']}.{VLAN}.1"
    send = (
        'python3 -c "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); '
        f"[s.sendto(b'x', ('{peer}', 9)) for _ in range(3)]\""
    )
    _ssh(rack, key, host, send)
    out["wire"] = cap.communicate(timeout=120)[0]
    for what, text in out.items():
        print(f"--- {what}\n{text}")

    assert "status: done" in out["cloud-init"], out["cloud-init"]
    links = out["links"]
    assert "bond mode active-backup" in links, links
    assert f"vlan protocol 802.1Q id {VLAN}" in links, links
    assert f"{address}/24" in links, links
    vlan_mac = re.search(rf"bond0\.{VLAN}@bond0: .*\n\s+link/ether (\S+)", links)
    assert vlan_mac, links
    assert f"('{vlan_mac.group(1)}', {VLAN})" in out["wire"], out["wire"]
    mdstat = out["mdstat"]
    assert "active raid1" in mdstat and "[2/2]" in mdstat, mdstat
    assert mdstat.strip().splitlines()[-1].startswith("/dev/md"), mdstat
    assert MARK in out["tenant"] and "runcmd ran" in out["tenant"], out["tenant"]
    # the hostname is metald's name for the machine (its meta-data), and so is the Slurm node's
    name = hostname(item["id"], full.get("name"))
    assert out["tenant"].split()[-1] == name, (out["tenant"], name)
    assert job.stdout.strip() == name, (job.stdout, name)
    assert "Debian GNU/Linux 12" in out["os"], out["os"]
    assert out["schema"].split() == ["0"], out["schema"]
    assert out["os"].splitlines()[1:] == ["running"], out["os"]  # and no failed unit listed
    assert "joined state stored in" in out["join"] and "slurmd started as" in out["join"], out[
        "join"
    ]
    print(
        f"\nclaim to active (deployed on the RAID1, booted, joined): {t_active:.1f} s"
        f" ({_phases(times, 'claimed', 'active')}); to cloud-init done {t_cloud:.1f} s;"
        f" srun hostname: {job.stdout.strip()}; load average at the claim {load_start},"
        f" now {os.getloadavg()}"
    )

    # release: metald wipes the machine (its wipe boot) and takes the address back
    t1 = time.monotonic()
    st, released = rack.api("POST", f"/api/v1/claims/{claim['id']}/release")
    assert st == 200, released
    waiting.wait_for(
        "wiped and ready",
        lambda: rack.json("machines", "show", item["id"])["state"] == "ready",
        WIPE_TIMEOUT_S,
        every=3,
        explain=rack.diagnostics,
    )
    t_wipe = time.monotonic() - t1
    st, after = rack.api("GET", f"/api/v1/claims/{claim['id']}")
    assert st == 200 and not after["addresses"].get(item["id"]), after["addresses"]
    # the disks are read once the machine is off (its BMC, through metald)
    rack.ctl("bmcs", "power", debian_rack.bmc["id"], "off", "--yes")
    for disk in [m["disk"], *m["extra_disks"]]:
        first, last = disk_ends(disk, tmp_path)
        assert first == bytes(len(first)) and last == bytes(len(last)), disk
        raw = tmp_path / "whole.raw"
        subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", disk, str(raw)], check=True)
        assert md_superblocks(raw.read_bytes()) == [], disk
        raw.unlink()
    times = _state_times(rack, item["id"])
    print(f"\nrelease to wiped and ready: {t_wipe:.1f} s ({_phases(times, 'active', 'ready')})")
