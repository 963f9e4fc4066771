"""Boot the node image in QEMU (TCG): its self-test, the disk form reading a NoCloud seed, and
the stateless boot protocol against a metald stand-in inside a network namespace this test
creates (nothing leaves it: no default route, the VM's only NIC is a tap on its bridge)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from metald.provision.metadata import nocloud
from metald.tenants import keys
from tests.bootassets.conftest import ROOT, boot_until, needs_qemu_root
from tests.qemu_netns import bridge_netns, ip, metald_standin, start, stop, tap_nic

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
        + ["-append", "console=ttyS0 no_timer_check metald.node.selftest=1"],
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


def debugfs_read(image: Path, offset: int, command: str) -> str:
    return subprocess.run(
        ["debugfs", "-R", command, f"{image}?offset={offset}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def seeded_disk(image: Path, tmp_path: Path, join_url: str, name: str) -> tuple[Path, int]:
    """A copy of disk.raw with a NoCloud seed exactly as metald's deploy agent writes it (the
    join token in write_files /etc/metald/join.json); returns it and its partition's offset."""
    manifest = json.loads((image / "manifest.json").read_text())
    if not manifest.get("disk"):
        pytest.skip("this node build has no disk.raw (built without root)")
    disk = tmp_path / "disk.raw"
    shutil.copyfile(image / "disk.raw", disk)
    offset = manifest["disk"]["partition"]["offset"]
    join = {"url": join_url, "token": JOIN_TOKEN, "expires_at": "2030-01-01T00:00:00Z"}
    files = nocloud(machine_id="lab-d1", name=name, pxe_mac=None, ssh_authorized_keys=[], join=join)
    (tmp_path / "meta-data").write_text(files["meta-data"])
    (tmp_path / "user-data").write_text(files["user-data"])
    seed = "/var/lib/cloud/seed/nocloud"
    debugfs(disk, offset, "mkdir /var/lib/cloud/seed")
    debugfs(disk, offset, f"mkdir {seed}")
    for f in ("meta-data", "user-data"):
        debugfs(disk, offset, f"write {tmp_path / f} {seed}/{f}")
    return disk, offset


# ---- stateless protocol against a metald stand-in ---------------------------------------


@pytest.fixture
def netns() -> Iterator[str]:
    with bridge_netns(f"mdnode{os.getpid()}", SERVER, ("tap0",)) as name:
        yield name


@contextmanager
def standin(ns: str, tmp_path: Path, config: dict) -> Iterator[Path]:
    """udhcpd and fake_metald.py (the node image's metald) on the namespace's bridge; yields
    the file its requests are logged to (read_requests)."""
    requests = tmp_path / "requests.jsonl"
    requests.touch()
    script = ROOT / "tests/bootassets/fake_metald.py"
    with metald_standin(ns, tmp_path, script, SERVER, PORT, requests, config) as out:
        yield out


def read_requests(requests: Path) -> list[dict]:
    return [json.loads(line) for line in requests.read_text().splitlines()]


#: The VM's one NIC: a tap on the namespace's bridge.
TAP_NIC = tap_nic(MAC)


def stateless_boot(
    ns: str,
    tmp_path: Path,
    image: Path,
    config: dict,
    wanted: list[str],
    also: Callable[[], bool] | None = None,
) -> tuple[list[dict], str]:
    with standin(ns, tmp_path, config) as requests:
        args = (
            f"metald.url=http://{SERVER}:{PORT} metald.token={AGENT_TOKEN} "
            f"metald.machine=lab-n1 metald.mac={MAC} metald.action=provision "
            "console=ttyS0,115200 quiet metald.unknown=ignored"
        )
        log = boot_until(
            ["-m", "1024", "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img")]
            + ["-append", args]
            + TAP_NIC,
            tmp_path / "console.log",
            wanted,
            timeout=240,
            netns=ns,
            stop_on=("metald-node: staying up",),
            also=also,
        )
    return read_requests(requests), log


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


needs_cluster_tools = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("wireguard-go", "wg", "slurmctld", "srun", "munged")),
    reason="needs wireguard-go, wireguard-tools, slurmctld, slurm-client and munge",
)


@contextmanager
def hub_and_controller(ns: str, tmp_path: Path, rounds: int = 1) -> Iterator[tuple[str, str, Path]]:
    """A wireguard-go hub (10.200.0.1/24, listening on SERVER:51820) and munged + a configless
    slurmctld (slurm_controller.sh, ``rounds`` of srun on node-lab1) in namespace ``ns``.
    Yields (hub interface, hub public key, the controller's folder)."""
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
    hub_key = keys.generate_private_key()
    (tmp_path / "hub.key").write_text(hub_key + "\n")
    hub_pub = keys.public_key(hub_key)
    hub = start(
        ns, ["env", "WG_PROCESS_FOREGROUND=1", "wireguard-go", hub_if], tmp_path / "hub.log"
    )
    controller = None
    try:
        deadline = time.monotonic() + 20
        # wireguard-go makes the link first and its control socket after: wait for both.
        uapi = Path("/var/run/wireguard") / f"{hub_if}.sock"
        while (
            subprocess.run(["ip", "-n", ns, "link", "show", hub_if], capture_output=True).returncode
            or not uapi.exists()
        ):
            assert time.monotonic() < deadline, (tmp_path / "hub.log").read_text()
            time.sleep(0.2)
        subprocess.run(
            ["ip", "netns", "exec", ns, "wg", "set", hub_if]
            + ["private-key", str(tmp_path / "hub.key"), "listen-port", "51820"],
            check=True,
        )
        ip("-n", ns, "addr", "add", "10.200.0.1/24", "dev", hub_if)
        ip("-n", ns, "link", "set", hub_if, "up")
        controller = start(
            ns,
            ["unshare", "--mount", "--uts", "--propagation", "private", "bash",
             str(ROOT / "tests/bootassets/slurm_controller.sh"), str(ctl), str(rounds)],
            tmp_path / "controller.log",
        )  # fmt: skip
        yield hub_if, hub_pub, ctl
    finally:
        if controller is not None:
            stop(controller)
        stop(hub)


def hub_join_response(hub_pub: str, allowed_ips: list[str] | None = None) -> dict:
    """metald's join answer for node-lab1 on the hub of hub_and_controller."""
    return {
        "overlay_address": "10.200.0.2/24",
        "hub": {"endpoint": f"{SERVER}:51820", "public_key": hub_pub, "address": "10.200.0.1"},
        "allowed_ips": allowed_ips or ["10.200.0.0/24"],
        "persistent_keepalive": 25,
        "cluster": {
            "kind": "slurm",
            "conf_server": "10.200.0.1:6817",
            "node_name": "node-lab1",
            "munge_key": MUNGE_KEY,
            "slurmd_args": ["-Z", "-N", "node-lab1", "--conf-server", "10.200.0.1:6817"],
        },
    }


def srun_result(ctl: Path, tmp_path: Path, suffix: str = "") -> tuple[str, str]:
    """(rc, stdout) of the controller's srun round, failing with what it saw if it never ran."""
    state = ctl / f"node.state{suffix}"
    state_text = state.read_text() if state.exists() else "node state: none"
    rc = ctl / f"srun{suffix}.rc"
    assert rc.exists(), f"{state_text}; controller: {(tmp_path / 'controller.log').read_text()}"
    err = (ctl / f"srun{suffix}.err").read_text()
    assert rc.read_text().strip() == "0", f"{state_text}; srun: {err}"
    return rc.read_text().strip(), (ctl / f"srun{suffix}.out").read_text().strip()


@needs_cluster_tools
def test_srun_reaches_the_node_over_wireguard(node_image: Path, netns: str, tmp_path: Path) -> None:
    """The whole join for real: a wireguard-go hub and a configless slurmctld in the test's
    namespace; the node joins through the metald stand-in and `srun hostname` runs on it."""
    with hub_and_controller(netns, tmp_path) as (hub_if, hub_pub, ctl):
        config = {
            "agent_token": AGENT_TOKEN,
            "provision": provision_answer(),
            "hub_ifname": hub_if,
            "join_response": hub_join_response(hub_pub),
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
    assert "metald-node: slurmd started as node-lab1" in log, log[-4000:]
    for line in (
        "metald-node: hostname lab-node-1",
        "metald-node: guard applied on eth0",
        "metald-node: provisioned",
        "metald-node: joining http://10.79.0.1:8080 as lab-node-1",
        f"metald-node: joined hub {SERVER}:51820 as 10.200.0.2/24",
        "metald-node: munged started",
    ):
        assert line in log, line
    assert "metald-node: error" not in log
    _, out = srun_result(ctl, tmp_path)
    assert out == "lab-node-1"  # busybox hostname on the node
    # the agent token only to the agent routes, then one unauthenticated join with its token
    # and a fresh WireGuard public key
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


@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="two TCG boots of a disk node (~1-2 min): METALD_LAB_LONG=1; make test keeps the stateless join",
)
@needs_cluster_tools
@pytest.mark.skipif(shutil.which("debugfs") is None, reason="debugfs (e2fsprogs) is missing")
def test_disk_node_comes_back_after_a_reboot_without_joining_again(
    node_image: Path, netns: str, tmp_path: Path
) -> None:
    """A disk-form node joins from its seed (srun runs on it), stores its joined state on its
    root partition, is powered off, and boots the same disk again: it comes back on the hub
    (a new handshake) and in the cluster (slurmd registers again, srun runs) with no join
    call; the stand-in, like metald, would refuse the spent token."""
    disk, offset = seeded_disk(node_image, tmp_path, f"http://{SERVER}:{PORT}", "lab-node-1")
    qemu = ["-m", "1024", "-drive", f"file={disk},format=raw,if=virtio", *TAP_NIC]
    ready = "metald-node: node ready"
    with hub_and_controller(netns, tmp_path, rounds=2) as (hub_if, hub_pub, ctl):
        config = {
            "agent_token": AGENT_TOKEN,
            "hub_ifname": hub_if,
            "join_response": hub_join_response(hub_pub),
        }
        with standin(netns, tmp_path, config) as requests_file:
            log1 = boot_until(
                qemu,
                tmp_path / "console1.log",
                [ready],
                netns=netns,
                stop_on=("metald-node: staying up",),
                also=lambda: (ctl / "srun.rc").exists(),
            )
            assert ready in log1, log1[-4000:]
            _, out1 = srun_result(ctl, tmp_path)
            first_off = int(time.time())  # the first VM is gone (boot_until stopped it)
            (ctl / "go.2").touch()
            log2 = boot_until(
                qemu,
                tmp_path / "console2.log",
                [ready],
                netns=netns,
                stop_on=("metald-node: staying up",),
                also=lambda: (ctl / "srun.2.rc").exists(),
            )
            handshakes = subprocess.run(
                ["ip", "netns", "exec", netns, "wg", "show", hub_if, "latest-handshakes"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
        requests = read_requests(requests_file)

    # first boot: joined from the seed and stored the joined state on its disk
    dev = "/dev/vda1"
    for line in (
        "SYSLINUX",
        f"metald-node: hostname lab-node-1 from the seed on {dev}",
        f"metald-node: no joined state stored on {dev} yet; joining with the seed's token",
        f"metald-node: joining http://{SERVER}:{PORT} as lab-node-1",
        f"metald-node: joined state stored in {dev}:/var/lib/metald-node",
        f"metald-node: joined hub {SERVER}:51820 as 10.200.0.2/24",
        "metald-node: slurmd started as node-lab1",
    ):
        assert line in log1, line
    assert out1 == "lab-node-1"
    assert "metald-node: provisioned" not in log1  # no progress post in disk mode
    # second boot of the same disk: back from the stored state, no join call
    assert ready in log2, log2[-4000:]
    for line in (
        "SYSLINUX",
        f"metald-node: hostname lab-node-1 from the seed on {dev}",
        f"metald-node: joined before: WireGuard key and join answer from {dev}:"
        "/var/lib/metald-node; no join call",
        "metald-node: guard applied on eth0",
        f"metald-node: back on hub {SERVER}:51820 as 10.200.0.2/24",
        "metald-node: munged started",
        "metald-node: slurmd started as node-lab1",
    ):
        assert line in log2, line
    assert "metald-node: joining" not in log2
    for log in (log1, log2):
        assert "metald-node: error" not in log
    state2 = (ctl / "node.state.2").read_text()
    started = dict(line.split(": ", 1) for line in state2.splitlines())
    assert started["SlurmdStartTime"] != started["SlurmdStartTime before"], state2
    _, out2 = srun_result(ctl, tmp_path, ".2")
    assert out2 == "lab-node-1"
    # one join in all (a second one would have been refused: the token is spent)
    assert [r["path"] for r in requests] == ["/api/v1/join"]
    node_pub = requests[0]["body"]["public_key"]
    # the hub has the one peer the node joined with, and it shook hands after the reboot
    assert handshakes[0::2] == [node_pub]
    assert int(handshakes[1]) >= first_off
    # the stored key on the disk: the joined key, mode 0600, never on the console
    key = debugfs_read(disk, offset, "cat /var/lib/metald-node/wg.key").strip()
    pub = subprocess.run(
        ["wg", "pubkey"], input=key + "\n", capture_output=True, text=True, check=True
    ).stdout.strip()
    assert pub == node_pub
    assert "Mode:  0600" in debugfs_read(disk, offset, "stat /var/lib/metald-node/wg.key")
    assert "Mode:  0600" in debugfs_read(disk, offset, "stat /var/lib/metald-node/state.json")
    for secret in (*SECRETS, key):
        assert secret not in log1 and secret not in log2
