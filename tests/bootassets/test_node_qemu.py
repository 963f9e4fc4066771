"""Boot the node image in QEMU (TCG): its self-test, the disk form reading a NoCloud seed, and
the stateless boot protocol against a metald stand-in inside a network namespace this test
creates (nothing leaves it: no default route, the VM's only NIC is a tap on its bridge)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from metald.provision.metadata import nocloud
from tests.bootassets.conftest import ROOT, boot_until, needs_qemu_root
from tests.qemu_netns import bridge_netns, ip, start, stop

pytestmark = needs_qemu_root

SERVER = "10.79.0.1"
PORT = 8080
MAC = "52:54:00:6d:77:21"
AGENT_TOKEN = "agent-token-9f8e7d6c5b4a"
JOIN_TOKEN = "join-token-0a1b2c3d4e5f"
MUNGE_KEY = base64.b64encode(bytes(range(256)) * 4).decode()
HUB_KEY = base64.b64encode(bytes(range(32))).decode()
SECRETS = (AGENT_TOKEN, JOIN_TOKEN, MUNGE_KEY, MUNGE_KEY[:40])


def test_selftest_passes(node_image: Path, tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    log = boot_until(
        ["-m", "1024", "-nic", "none", "-kernel", str(node_image / "vmlinuz")]
        + ["-initrd", str(node_image / "initrd.img")]
        + ["-append", "console=ttyS0 metald.node.selftest=1"],
        console,
        ["METALD-NODE-SELFTEST"],
        timeout=240,
    )
    assert "METALD-NODE-SELFTEST OK" in log, log[-3000:]
    for check in ("wireguard", "nft-guard", "jq", "munged", "slurmd", "shell"):
        assert f"metald-node: selftest: {check} ok" in log


def debugfs(image: Path, offset: int, command: str) -> None:
    subprocess.run(
        ["debugfs", "-w", "-R", command, f"{image}?offset={offset}"],
        check=True,
        capture_output=True,
    )


@pytest.mark.skipif(shutil.which("debugfs") is None, reason="debugfs (e2fsprogs) is missing")
def test_disk_form_reads_the_seed_and_joins(node_image: Path, tmp_path: Path) -> None:
    manifest = json.loads((node_image / "manifest.json").read_text())
    if not manifest.get("disk"):
        pytest.skip("this node build has no disk.raw (built without root)")
    disk = tmp_path / "disk.raw"
    shutil.copyfile(node_image / "disk.raw", disk)
    offset = manifest["disk"]["partition"]["offset"]
    join = {"url": "http://192.0.2.1:9", "token": JOIN_TOKEN, "expires_at": "2030-01-01T00:00:00Z"}
    # the seed exactly as metald's deploy agent writes it
    files = nocloud(
        machine_id="lab-d1", name="seed-host-7", pxe_mac=None, ssh_authorized_keys=[], join=join
    )
    (tmp_path / "meta-data").write_text(files["meta-data"])
    (tmp_path / "user-data").write_text(files["user-data"])
    seed = "/var/lib/cloud/seed/nocloud"
    debugfs(disk, offset, "mkdir /var/lib/cloud/seed")
    debugfs(disk, offset, f"mkdir {seed}")
    for f in ("meta-data", "user-data"):
        debugfs(disk, offset, f"write {tmp_path / f} {seed}/{f}")
    console = tmp_path / "console.log"
    wanted = "metald-node: joining http://192.0.2.1:9 as seed-host-7"
    log = boot_until(
        ["-m", "1024", "-nic", "none", "-drive", f"file={disk},format=raw,if=virtio"],
        console,
        [wanted, "metald-node: join failed (try 1"],
        timeout=240,
    )
    assert "SYSLINUX" in log  # booted through the MBR and extlinux, not -kernel
    assert "metald-node: hostname seed-host-7 from the seed on /dev/vda1" in log, log[-3000:]
    assert wanted in log
    assert "metald-node: provisioned" not in log  # no progress post in disk mode
    for secret in SECRETS:
        assert secret not in log


# ---- stateless protocol against a metald stand-in ---------------------------------------


@pytest.fixture
def netns() -> Iterator[str]:
    with bridge_netns(f"mdnode{os.getpid()}", SERVER, ("tap0",)) as name:
        yield name


def stateless_boot(
    ns: str,
    tmp_path: Path,
    image: Path,
    config: dict,
    wanted: list[str],
    also: Callable[[], bool] | None = None,
) -> tuple[list[dict], str]:
    conf = tmp_path / "udhcpd.conf"
    conf.write_text(
        "start 10.79.0.100\nend 10.79.0.150\ninterface br0\nmax_leases 50\n"
        f"lease_file {tmp_path / 'leases'}\npidfile {tmp_path / 'udhcpd.pid'}\n"
        "option subnet 255.255.255.0\n"
    )
    (tmp_path / "leases").touch()
    (tmp_path / "config.json").write_text(json.dumps(config))
    requests, ready = tmp_path / "requests.jsonl", tmp_path / "ready"
    requests.touch()
    server = [sys.executable, str(ROOT / "tests/bootassets/fake_metald.py"), SERVER, str(PORT)]
    server += [str(requests), str(ready), str(tmp_path / "config.json")]
    procs = [
        start(ns, ["busybox", "udhcpd", "-f", str(conf)], tmp_path / "udhcpd.log"),
        start(ns, server, tmp_path / "server.log", env={**os.environ, "PYTHONPATH": str(ROOT)}),
    ]
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        args = (
            f"metald.url=http://{SERVER}:{PORT} metald.token={AGENT_TOKEN} "
            f"metald.machine=lab-n1 metald.mac={MAC} metald.action=provision "
            "console=ttyS0,115200 quiet metald.unknown=ignored"
        )
        log = boot_until(
            ["-m", "1024", "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img")]
            + ["-append", args]
            + ["-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no"]
            + ["-device", f"virtio-net-pci,netdev=n0,mac={MAC}"],
            tmp_path / "console.log",
            wanted,
            timeout=240,
            netns=ns,
            stop_on=("metald-node: staying up",),
            also=also,
        )
    finally:
        for p in procs:
            stop(p)
    return [json.loads(line) for line in requests.read_text().splitlines()], log


def provision_answer() -> dict:
    return {
        "action": "provision",
        "machine_id": "lab-n1",
        "image": {"id": "img-node", "kind": "stateless"},
        "nocloud": nocloud(
            machine_id="lab-n1", name="lab-node-1", pxe_mac=MAC, ssh_authorized_keys=[]
        ),
        "join": {
            "url": f"http://{SERVER}:{PORT}",
            "token": JOIN_TOKEN,
            "expires_at": "2030-01-01T00:00:00Z",
        },
    }


def test_stateless_boot_reports_joins_guards_and_starts_slurmd(
    node_image: Path, netns: str, tmp_path: Path
) -> None:
    config = {
        "agent_token": AGENT_TOKEN,
        "provision": provision_answer(),
        "join_response": {
            "overlay_address": "10.200.0.2/24",
            "hub": {"endpoint": f"{SERVER}:51820", "public_key": HUB_KEY, "address": "10.200.0.1"},
            "allowed_ips": ["10.200.0.0/24", "10.201.0.0/24"],
            "persistent_keepalive": 25,
            "cluster": {
                "kind": "slurm",
                "conf_server": "10.200.0.1:6817",
                "node_name": "node-lab1",
                "munge_key": MUNGE_KEY,
                "slurmd_args": ["-Z", "-N", "node-lab1", "--conf-server", "10.200.0.1:6817"],
            },
        },
    }
    done = "metald-node: node ready"
    requests, log = stateless_boot(netns, tmp_path, node_image, config, [done])
    assert done in log, log[-4000:]
    for line in (
        "metald-node: hostname lab-node-1",
        "metald-node: guard applied on eth0",
        "metald-node: provisioned",
        "metald-node: joining http://10.79.0.1:8080 as lab-node-1",
        f"metald-node: joined hub {SERVER}:51820 as 10.200.0.2/24",
        "metald-node: munged started",
        "metald-node: slurmd started as node-lab1",
    ):
        assert line in log
    assert "metald-node: error" not in log
    paths = [r["path"] for r in requests]
    assert paths == ["/api/v1/agent/provision", "/api/v1/agent/progress", "/api/v1/join"]
    assert requests[0]["auth"] == requests[1]["auth"] == f"Bearer {AGENT_TOKEN}"
    assert requests[1]["body"] == {"phase": "booted", "done": True}
    join = requests[2]
    assert join["auth"] is None
    assert set(join["body"]) == {"token", "public_key"}
    assert join["body"]["token"] == JOIN_TOKEN
    assert len(base64.b64decode(join["body"]["public_key"], validate=True)) == 32
    for secret in SECRETS:
        assert secret not in log


def test_stateless_join_refused_is_final(node_image: Path, netns: str, tmp_path: Path) -> None:
    config = {
        "agent_token": AGENT_TOKEN,
        "provision": provision_answer(),
        "join_status": 410,
        "join_detail": "this join token was already used",
    }
    refused = "metald-node: error: join refused (410): this join token was already used"
    requests, log = stateless_boot(
        netns, tmp_path, node_image, config, [refused, "metald-node: staying up"]
    )
    assert refused in log, log[-4000:]
    assert "metald-node: staying up" in log  # metald-node ended; /init keeps the machine up
    assert [r["path"] for r in requests].count("/api/v1/join") == 1  # no retry of a 4xx
    assert "joined hub" not in log and "slurmd started" not in log
    for secret in SECRETS:
        assert secret not in log


@pytest.mark.skipif(
    not all(shutil.which(t) for t in ("wireguard-go", "wg", "slurmctld", "srun", "munged")),
    reason="needs wireguard-go, wireguard-tools, slurmctld, slurm-client and munge",
)
def test_srun_reaches_the_node_over_wireguard(node_image: Path, netns: str, tmp_path: Path) -> None:
    """The whole join for real: a wireguard-go hub and a configless slurmctld in the test's
    namespace; the node joins through the metald stand-in and `srun hostname` runs on it."""
    from metald.tenants.slurm import ControlPlane, render_slurm_conf

    hub_if = f"mhn{os.getpid() % 100000}"
    ctl = tmp_path / "ctl"
    for sub in ("state", "spool", "run", "log"):
        (ctl / sub).mkdir(parents=True)
    key = base64.b64decode(MUNGE_KEY)
    (ctl / "munge.key").write_bytes(key)
    cp = ControlPlane(
        cluster_name="labnode",
        host_name="hub",
        address="10.200.0.1",
        state_dir=str(ctl / "state"),
        spool_dir=str(ctl / "spool"),
        run_dir=str(ctl / "run"),
        log_dir=str(ctl / "log"),
        max_nodes=8,
    )
    (ctl / "slurm.conf").write_text(render_slurm_conf(cp))
    hub_key = subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True).stdout
    (tmp_path / "hub.key").write_text(hub_key)
    hub_pub = subprocess.run(
        ["wg", "pubkey"], input=hub_key, capture_output=True, text=True, check=True
    ).stdout.strip()
    hub = start(
        netns, ["env", "WG_PROCESS_FOREGROUND=1", "wireguard-go", hub_if], tmp_path / "hub.log"
    )
    controller = None
    try:
        deadline = time.monotonic() + 20
        while subprocess.run(
            ["ip", "-n", netns, "link", "show", hub_if], capture_output=True
        ).returncode:
            assert time.monotonic() < deadline, (tmp_path / "hub.log").read_text()
            time.sleep(0.2)
        ns = ["ip", "netns", "exec", netns]
        subprocess.run(
            [
                *ns,
                "wg",
                "set",
                hub_if,
                "private-key",
                str(tmp_path / "hub.key"),
                "listen-port",
                "51820",
            ],
            check=True,
        )
        ip("-n", netns, "addr", "add", "10.200.0.1/24", "dev", hub_if)
        ip("-n", netns, "link", "set", hub_if, "up")
        controller = start(
            netns,
            ["unshare", "--mount", "--uts", "--propagation", "private", "bash",
             str(ROOT / "tests/bootassets/slurm_controller.sh"), str(ctl)],
            tmp_path / "controller.log",
        )  # fmt: skip
        config = {
            "agent_token": AGENT_TOKEN,
            "provision": provision_answer(),
            "hub_ifname": hub_if,
            "join_response": {
                "overlay_address": "10.200.0.2/24",
                "hub": {
                    "endpoint": f"{SERVER}:51820",
                    "public_key": hub_pub,
                    "address": "10.200.0.1",
                },
                "allowed_ips": ["10.200.0.0/24"],
                "persistent_keepalive": 25,
                "cluster": {
                    "kind": "slurm",
                    "conf_server": "10.200.0.1:6817",
                    "node_name": "node-lab1",
                    "munge_key": MUNGE_KEY,
                    "slurmd_args": ["-Z", "-N", "node-lab1", "--conf-server", "10.200.0.1:6817"],
                },
            },
        }

        # the VM runs until the controller has run srun on it (or the timeout)
        requests, log = stateless_boot(
            netns,
            tmp_path,
            node_image,
            config,
            ["metald-node: node ready"],
            also=lambda: (ctl / "srun.rc").exists(),
        )
    finally:
        if controller is not None:
            stop(controller)
        stop(hub)
    assert "metald-node: slurmd started as node-lab1" in log, log[-4000:]
    state = (ctl / "node.state").read_text() if (ctl / "node.state").exists() else "none"
    assert (ctl / "srun.rc").exists(), (
        f"{state}; controller: {(tmp_path / 'controller.log').read_text()}"
    )
    err = (ctl / "srun.err").read_text()
    assert (ctl / "srun.rc").read_text().strip() == "0", f"{state}; srun: {err}"
    assert (ctl / "srun.out").read_text().strip() == "lab-node-1"  # busybox hostname on the node
    assert [r["path"] for r in requests][-1] == "/api/v1/join"
    for secret in SECRETS:
        assert secret not in log
