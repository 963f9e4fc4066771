"""The Debian 12 image joins its tenant's cluster, booted in QEMU (TCG): the disk carries a
NoCloud seed as metald's deploy agent writes it (the tenant's user-data, metald's vendor-data
with /etc/metald/join.json, DHCP on the PXE NIC); on first boot cloud-init writes the join
file and metald-join.service runs the image's metald-node: POST /api/v1/join to the metald
stand-in the node image's tests use (tests/bootassets/fake_metald.py, which adds the node to
a wireguard-go hub as metald's hub does), kernel WireGuard in the guest, the guard, munged and
slurmd configless against a real slurmctld behind the hub: ``srun hostname`` runs on it.
Over SSH (the guard leaves 22 open): the unit active, wg0 with the hub as peer, the guard's
table. Powered off and booted again: back from /var/lib/metald-node with no join call, srun
again. The same agent against metald's real join endpoint: test_debian_join.py (make test).

METALD_LAB_LONG=1 only (make test-long): a ~900 MB image and two TCG boots of a full OS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from metald.provision.metadata import nocloud
from tests.bootassets.conftest import boot_until, needs_qemu_root
from tests.bootassets.test_node_qemu import (
    AGENT_TOKEN,
    JOIN_TOKEN,
    MUNGE_KEY,
    PORT,
    SERVER,
    debugfs,
    hub_and_controller,
    hub_join_response,
    read_requests,
    srun_result,
    standin,
)
from tests.qemu_netns import bridge_netns, tap_nic

pytestmark = [
    *needs_qemu_root,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="a Debian image and two TCG boots of it: set METALD_LAB_LONG=1 (make test-long)",
    ),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap is not installed"),
    pytest.mark.skipif(
        not all(
            shutil.which(t)
            for t in ("wireguard-go", "wg", "slurmctld", "srun", "munged", "debugfs", "ssh")
        ),
        reason="needs wireguard-go, wireguard-tools, slurmctld, slurm-client, munge, "
        "e2fsprogs and the OpenSSH client",
    ),
]

MAC = "52:54:00:6d:7a:01"
HOSTNAME = "lab-node-1"
USER_DATA = "#cloud-config\nwrite_files:\n  - path: /root/tenant.txt\n    content: tenant\n"
BOOT_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def debian_image() -> Path:
    from bootassets.debian import ensure_debian_built

    t0 = time.monotonic()
    built = ensure_debian_built()
    print(f"\nDebian image ready in {time.monotonic() - t0:.1f} s: {built}")
    return built


def seeded(image: Path, tmp_path: Path, key_pub: str) -> Path:
    """A copy of disk.raw with the NoCloud seed the deploy agent writes: the tenant's
    user-data, metald's vendor-data (its key, the join file), DHCP on the PXE NIC."""
    manifest = json.loads((image / "manifest.json").read_text())
    assert manifest["join"]["enabled"] == ["metald-join"], manifest["join"]
    disk = tmp_path / "disk.raw"
    shutil.copyfile(image / "disk.raw", disk)
    offset = manifest["disk"]["partition"]["offset"]
    join = {
        "url": f"http://{SERVER}:{PORT}",
        "token": JOIN_TOKEN,
        "expires_at": "2030-01-01T00:00:00Z",
    }
    files = nocloud(
        machine_id="lab-deb-j1",
        name=HOSTNAME,
        pxe_mac=MAC,
        ssh_authorized_keys=[key_pub],
        join=join,
        user_data=USER_DATA,
    )
    assert "/etc/metald/join.json" in files["vendor-data"]
    seed = "/var/lib/cloud/seed/nocloud"
    for d in ("/var/lib/cloud", "/var/lib/cloud/seed", seed):
        debugfs(disk, offset, f"mkdir {d}")  # an existing folder is only a message
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        debugfs(disk, offset, f"write {tmp_path / name} {seed}/{name}")
    return disk


def leased(tmp_path: Path) -> list[str]:
    from tests.provision_agent.test_qemu_debian import leased as leases

    return leases(tmp_path, MAC)


def ssh(key: Path, ns: str, host: str, command: str) -> subprocess.CompletedProcess[str]:
    from tests.provision_agent.test_qemu_debian import ssh as run

    return run(key, ns, host, command, timeout=120)


def test_debian_joins_over_wireguard_runs_srun_and_comes_back_after_a_reboot(
    debian_image: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = os.getloadavg()
    # the controller's rounds wait as long as a boot may take (a full OS under TCG)
    monkeypatch.setenv("NODE_WAIT_S", str(BOOT_TIMEOUT_S))
    key = tmp_path / "claim_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    disk = seeded(debian_image, tmp_path, (tmp_path / "claim_key.pub").read_text().strip())
    qemu = ["-m", "1024", "-smp", "2", "-drive", f"file={disk},format=raw,if=virtio"]
    qemu += tap_nic(MAC)
    ready = "metald-node: node ready"
    times: dict[str, float] = {}
    inside: dict[str, str] = {}
    with (
        bridge_netns(f"mddj{os.getpid()}", SERVER, ("tap0",)) as ns,
        hub_and_controller(ns, tmp_path, rounds=2) as (hub_if, hub_pub, ctl),
    ):
        config = {
            "agent_token": AGENT_TOKEN,
            "hub_ifname": hub_if,
            "join_response": hub_join_response(hub_pub),
        }
        with standin(ns, tmp_path, config) as requests_file:

            def look_inside() -> bool:
                """Over SSH while the node runs (the guard leaves 22 open): once."""
                if inside or not (ctl / "srun.rc").exists():
                    return bool(inside)
                for addr in leased(tmp_path):
                    r = ssh(
                        key, ns, addr,
                        "systemctl is-active metald-join; wg show wg0 peers; "
                        "nft list table inet metald_guard; echo \"[$(cat /root/tenant.txt)]\"; "
                        "stat -c '%a %n' /var/lib/metald-node /var/lib/metald-node/*; "
                        "systemctl is-enabled munge slurmd; systemctl --failed --no-legend",
                    )  # fmt: skip
                    if r.returncode == 0:
                        inside["out"] = r.stdout
                        return True
                return False

            t0 = time.monotonic()
            log1 = boot_until(
                qemu, tmp_path / "console1.log", [ready], netns=ns,
                timeout=BOOT_TIMEOUT_S, also=look_inside,
            )  # fmt: skip
            times["first boot to srun done"] = time.monotonic() - t0
            (ctl / "go.2").touch()
            t0 = time.monotonic()
            log2 = boot_until(
                qemu, tmp_path / "console2.log", [ready], netns=ns,
                timeout=BOOT_TIMEOUT_S, also=lambda: (ctl / "srun.2.rc").exists(),
            )  # fmt: skip
            times["second boot to srun done"] = time.monotonic() - t0
            handshakes = subprocess.run(
                ["ip", "netns", "exec", ns, "wg", "show", hub_if, "latest-handshakes"],
                capture_output=True, text=True, check=True,
            ).stdout.split()  # fmt: skip
        requests = read_requests(requests_file)
    print(
        f"\nload average at start {load}; " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
    )

    # first boot: cloud-init wrote the join file, the unit joined with it
    for line in (
        # the tenant's write_files replaced vendor-data's: the join info comes from the seed
        "metald-node: no joined state in /var/lib/metald-node yet; joining with the NoCloud "
        "seed's vendor-data (/var/lib/cloud/seed/nocloud)",
        "metald-node: guard applied on",
        f"metald-node: joining http://{SERVER}:{PORT} as {HOSTNAME}",
        "metald-node: joined state stored in /var/lib/metald-node",
        f"metald-node: joined hub {SERVER}:51820 as 10.200.0.2/24",
        "metald-node: munged started",
        "metald-node: slurmd started as node-lab1",
    ):
        assert line in log1, (line, log1[-6000:])
    assert "(TCP 22 open)" in log1
    _, out1 = srun_result(ctl, tmp_path)
    assert out1 == HOSTNAME
    # from inside: the unit active, the hub its peer, the guard, the tenant's file, the state
    assert inside, log1[-4000:]
    out = inside["out"]
    assert out.startswith("active\n") and hub_pub in out, out
    assert "tcp dport 22 accept" in out and "udp dport 51820 ip saddr @wg_sources accept" in out
    assert "[tenant]\n" in out  # the tenant's user-data ran too
    assert "700 /var/lib/metald-node\n" in out and "600 /var/lib/metald-node/wg.key" in out
    assert "disabled\ndisabled\n" in out  # munge and slurmd: the agent's, not boot's
    # second boot: back from the stored state, no join call
    for line in (
        "metald-node: joined before: WireGuard key and join answer from /var/lib/metald-node; no join call",
        f"metald-node: back on hub {SERVER}:51820 as 10.200.0.2/24",
        "metald-node: slurmd started as node-lab1",
    ):
        assert line in log2, (line, log2[-6000:])
    assert "metald-node: joining" not in log2
    for log in (log1, log2):
        assert "metald-node: error" not in log
        for secret in (JOIN_TOKEN, MUNGE_KEY, MUNGE_KEY[:40]):
            assert secret not in log
    _, out2 = srun_result(ctl, tmp_path, ".2")
    assert out2 == HOSTNAME
    assert [r["path"] for r in requests] == ["/api/v1/join"]
    assert requests[0]["auth"] is None and requests[0]["body"]["token"] == JOIN_TOKEN
    assert handshakes[0::2] == [requests[0]["body"]["public_key"]]
