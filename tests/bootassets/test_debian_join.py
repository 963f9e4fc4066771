"""An installed OS joining its tenant's cluster: ``metald-node join``, what the Debian image's
metald-join.service runs (bootassets/debian/metald-join.service), run for real under the
host's /bin/sh (dash, as in the image) against metald itself, in namespaces this test makes.

The hub namespace holds metald's API (its real app and store; the socket made there), the
tenant's hub (metald's LocalHubs on wireguard-go) and a configless slurmctld with munged
(tests/bootassets/slurm_controller.sh) with the tenant's munge key. The node namespace holds
the agent in a mount namespace of its own (its /run, /etc/munge, /var/spool, /var/log and
/etc/hosts; nothing of the host's changes), reading the join file cloud-init would have
written from metald's vendor-data. The host has no kernel WireGuard: a wrapper in front of
``ip`` makes ``ip link add wg0 type wireguard`` start wireguard-go instead (the image's kernel
has the module; tests/bootassets/test_debian_join_qemu.py boots the image).

First run: one POST /api/v1/join with a fresh key, the hub peer stored by metald, the
WireGuard handshake, the guard with SSH open, munged and slurmd with metald's munge key, the
node idle in slurmctld and ``srun hostname`` on it; the joined state in its folder. Second run
(a reboot): back from that state without a join call, registered again, srun again."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from sqlmodel import select

from metald.tenants import mesh
from netconfig import guard
from tests.bootassets.conftest import ROOT
from tests.tenants.nslab import Underlay, underlay
from vmlab import procs
from vmlab.fleet import socket_in_namespace

SCRIPT = ROOT / "bootassets/node/metald-node"
UNIT = ROOT / "bootassets/debian/metald-join.service"
HOSTNAME = "debian-node"

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network and mount namespaces"),
    pytest.mark.skipif(
        not all(
            shutil.which(t)
            for t in ("wireguard-go", "wg", "nft", "munged", "slurmd", "slurmctld", "srun")
            + ("curl", "jq", "dash", "nsenter", "unshare")
        ),
        reason="needs wireguard-go, wireguard-tools, nftables, munge, slurmd, slurmctld, "
        "slurm-client, curl, jq, dash and util-linux",
    ),
]

#: ``ip`` on the node: ``ip link add NAME type wireguard`` starts wireguard-go (in the
#: foreground, in this process group), everything else is the real ip.
IP_WRAPPER = """#!/bin/sh
if [ "$1 $2 $4 $5" = "link add type wireguard" ]; then
	WG_PROCESS_FOREGROUND=1 wireguard-go "$3" >/dev/null 2>&1 &
	for _ in $(seq 1 100); do
		[ -S "/run/wireguard/$3.sock" ] && exec {ip} link show "$3" >/dev/null
		sleep 0.1
	done
	exit 1
fi
exec {ip} "$@"
"""

#: The node: its own mounts, then the agent as the unit starts it; on TERM, everything it
#: started (munged daemonizes: by its pid file).
NODE = """set -eu
T=$1
for d in /run /var/spool /var/log /var/lib/munge /etc/munge /etc/slurm; do
	mount -t tmpfs -o mode=0755 tmpfs "$d"
done
mount --bind "$T/hosts" /etc/hosts
hostname {hostname}
ip link set lo up
stop() {{
	trap - TERM INT
	[ -s /run/munge/munged.pid ] && kill "$(cat /run/munge/munged.pid)" 2>/dev/null
	kill 0
}}
trap stop TERM INT
PATH=$T/bin:$PATH METALD_JOIN_INFO=$T/join.json METALD_NODE_PERSIST=$T/persist \\
	METALD_NODE_SEED=$T/seed METALD_GUARD_TCP=22 {script} join &
wait
"""


class ApiInNamespace:
    """metald's app (``api.app.create_app``) on a socket made in a namespace, served from a
    thread; the tenant hubs it applies joins to; every request's method and path recorded."""

    def __init__(self, ns: str, host: str, tmp_path: Path) -> None:
        from api.context import AppContext
        from metald.config import load_config
        from metald.events import EventBus
        from metald.secrets import SecretBox
        from metald.store import Store
        from tests.conftest import LAB_BMC_ENV

        self.sock = socket_in_namespace(ns, socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        url = f"sqlite:///{tmp_path / 'metald.db'}"
        cfg = load_config(
            None,
            environ={
                "METALD_STATE_DIR": str(tmp_path / "state"),
                "METALD_STORE__URL": url,
                **LAB_BMC_ENV,
            },
        )
        self.store = Store(url)
        self.store.migrate()
        self.box = SecretBox.from_file(cfg.secrets_key_path)
        self.ctx = AppContext(cfg=cfg, store=self.store, secrets=self.box, bus=EventBus())
        self.requests: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self, hubs: Any) -> None:
        from api.app import create_app, server_settings
        from tests.api_helpers import use_services

        use_services(self.ctx, tenant_hubs=hubs)

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append(f"{request.method} {request.path}")
            return await handler(request)

        async def serve() -> web.AppRunner:
            app = create_app(self.ctx)
            app.middlewares.append(record)
            runner = web.AppRunner(app, access_log=None, **server_settings())
            await runner.setup()
            await web.SockSite(runner, self.sock).start()
            return runner

        self.thread.start()
        self.runner = asyncio.run_coroutine_threadsafe(serve(), self.loop).result(30)

    def close(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
        self.sock.close()
        self.store.close()


@pytest.fixture
def lab() -> Iterator[Underlay]:
    with underlay() as u:
        yield u


def start_in(ns: str, argv: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
    """``argv`` in namespace ``ns`` as its own process group, without ``ip netns exec``'s /sys
    remount (slurmd needs the host's cgroup mounts)."""
    return subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{ns}", *argv],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        **kw,
    )


def wait_until(what: str, cond: Any, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen; agent:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)


def test_the_unit_runs_the_join_after_cloud_init_and_the_network(tmp_path: Path) -> None:
    unit = UNIT.read_text()
    if shutil.which("systemd-analyze"):
        # systemd's own reading of it (unknown keys, keys in the wrong section, bad values),
        # with the agent where the image installs it replaced by this checkout's
        copy = tmp_path / "metald-join.service"
        copy.write_text(unit.replace("/usr/sbin/metald-node", str(SCRIPT)))
        r = subprocess.run(
            ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, check=False
        )
        assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    assert "ExecStart=/usr/sbin/metald-node join\n" in unit
    assert "After=network-online.target cloud-init.service cloud-config.service\n" in unit
    assert "Wants=network-online.target\n" in unit
    # the first boot needs the join file; a later one the stored state (the file may be gone)
    assert "ConditionPathExists=|/etc/metald/join.json\n" in unit
    assert "ConditionPathExists=|/var/lib/metald-node/state.json\n" in unit
    assert "ConditionPathExists=|/var/lib/cloud/seed/nocloud/vendor-data\n" in unit
    assert "Delegate=yes\n" in unit  # slurmd's cgroup/v2 scope for slurmstepd
    assert "Restart=on-failure\n" in unit and "WantedBy=multi-user.target\n" in unit
    assert "StandardOutput=journal+console\n" in unit  # the join's lines on the serial console
    assert "Environment=METALD_GUARD_TCP=22\n" in unit


def test_the_guard_ports_are_checked(tmp_path: Path) -> None:
    body = (
        f". {SCRIPT}\nfor s in 22 '22,8443' '22 80' '' 0 22x 65536 -1 '22;ls'; do "
        'if p=$(guard_tcp_ports "$s"); then echo "[$s] ok [$p]"; else echo "[$s] refused"; fi; done'
    )
    env = dict(os.environ, METALD_NODE_LIB="1", METALD_NODE_STATE=str(tmp_path))
    out = subprocess.run(["dash", "-c", body], env=env, capture_output=True, text=True).stdout
    assert out.splitlines() == [
        "[22] ok [22]",
        "[22,8443] ok [22, 8443]",
        "[22 80] ok [22, 80]",
        "[] ok []",
        "[0] refused",
        "[22x] refused",
        "[65536] refused",
        "[-1] refused",
        "[22;ls] refused",
    ]


@pytest.mark.parametrize("tenant_user_data", [False, True])
def test_join_info_from_the_file_else_from_metalds_part_of_the_seed(
    tmp_path: Path, tenant_user_data: bool
) -> None:
    """cloud-init writes /etc/metald/join.json from metald's cloud-config, unless the tenant's
    user-data has its own write_files (it replaces vendor-data's): then the seed's
    vendor-data is read. The file wins when both are there."""
    from metald.provision.metadata import nocloud

    join = {"url": "http://10.79.0.1:8080", "token": "tok-seed", "expires_at": "2030-01-01"}
    files = nocloud(
        machine_id="m1", name="n1", pxe_mac=None, ssh_authorized_keys=[], join=join,
        user_data="#cloud-config\nwrite_files: [{path: /x, content: y}]\n" if tenant_user_data
        else None,
    )  # fmt: skip
    seed = tmp_path / "seed"
    seed.mkdir()
    for name, text in files.items():
        (seed / name).write_text(text)
    state = tmp_path / "state"
    body = (
        f". {SCRIPT}\nos_join_info {tmp_path}/join.json {seed}; "
        'echo "rc=$? src=$JOIN_SRC"; cat "$STATE/join-info.json" 2>/dev/null'
    )
    env = dict(os.environ, METALD_NODE_LIB="1", METALD_NODE_STATE=str(state))

    def run() -> tuple[str, str]:
        out = subprocess.run(["dash", "-c", body], env=env, capture_output=True, text=True)
        first, _, rest = out.stdout.partition("\n")
        return first, rest

    part = "vendor-data" if tenant_user_data else "user-data"
    first, info = run()
    assert first == f"rc=0 src=the NoCloud seed's {part} ({seed})"
    assert json.loads(info) == join
    (tmp_path / "join.json").write_text(json.dumps(join | {"token": "tok-file"}))
    first, info = run()
    assert first == f"rc=0 src={tmp_path}/join.json"
    assert json.loads(info)["token"] == "tok-file"
    (tmp_path / "join.json").unlink()
    for name in files:
        (seed / name).unlink()
    first, info = run()
    assert first == "rc=1 src=" and info == ""


def test_an_installed_os_joins_through_metald_and_comes_back_after_a_reboot(
    lab: Underlay, tmp_path: Path
) -> None:
    from metald import machines
    from metald.store.models import Tenant, WgHub, WgPeer
    from metald.tenants import clusters
    from metald.tenants.hubs import LocalHubs
    from metald.tenants.slurm import ControlPlane, render_slurm_conf
    from tests.tenants.conftest import make_env

    api = ApiInNamespace(lab.hub_ns, lab.hub_ip, tmp_path)
    hubs = LocalHubs()
    started: list[subprocess.Popen[bytes]] = []
    node_log = tmp_path / "node.log"
    try:
        env = make_env(api.store, api.box)  # acme (Slurm) with its hub at 10.99.0.1, machine_a
        tenant_id, machine_id = env.tokens.tenant_a, env.tokens.machine_a
        with api.store.session() as s:
            hub = s.exec(select(WgHub).where(WgHub.tenant_id == tenant_id)).one()
            tenant = s.get(Tenant, tenant_id)
            assert tenant is not None and tenant.secrets_enc is not None
            munge_key = json.loads(api.box.decrypt(tenant.secrets_enc))["munge_key"]
            m = machines.get_machine(s, machine_id)
            # this host's slurmd finds no GPU: the seed's 8 would drain the node (gres count)
            m.gpu_count, m.gpu_model = 0, None
            s.add(m)
            s.commit()
            node_name = clusters.node_name(s, m)
            hubs.start_from_store(s, api.box, tenant_id, lab.hub_ns)
            secret, expires = clusters.issue_join_token(s, machine_id, actor="test")
        api.start(hubs)

        # the tenant's control plane on its hub's overlay address
        ctl = tmp_path / "ctl"
        for sub in ("state", "spool", "run", "log"):
            (ctl / sub).mkdir(parents=True)
        (ctl / "munge.key").write_bytes(base64.b64decode(munge_key))
        cp = ControlPlane(
            cluster_name="acme",
            host_name="hub",
            address=hub.address,
            state_dir=str(ctl / "state"),
            spool_dir=str(ctl / "spool"),
            run_dir=str(ctl / "run"),
            log_dir=str(ctl / "log"),
            max_nodes=8,
        )
        (ctl / "slurm.conf").write_text(render_slurm_conf(cp))
        started.append(
            start_in(
                lab.hub_ns,
                ["env", f"NODE={node_name}", "unshare", "--mount", "--uts", "--propagation",
                 "private", "bash", str(ROOT / "tests/bootassets/slurm_controller.sh"),
                 str(ctl), "2"],
                tmp_path / "controller.log",
            )
        )  # fmt: skip

        # the node's files: what cloud-init writes from metald's vendor-data, its /etc/hosts
        join_info = {"url": api.url, "token": secret, "expires_at": expires.isoformat()}
        (tmp_path / "join.json").write_text(json.dumps(join_info, sort_keys=True))
        (tmp_path / "hosts").write_text("127.0.0.1\tlocalhost\n")
        (tmp_path / "bin").mkdir()
        wrapper = tmp_path / "bin/ip"
        wrapper.write_text(IP_WRAPPER.format(ip=shutil.which("ip")))
        wrapper.chmod(0o755)
        (tmp_path / "node.sh").write_text(NODE.format(hostname=HOSTNAME, script=SCRIPT))

        def boot() -> subprocess.Popen[bytes]:
            p = start_in(
                lab.node_ns,
                ["unshare", "--mount", "--uts", "--propagation", "private", "sh",
                 str(tmp_path / "node.sh"), str(tmp_path)],
                node_log,
            )  # fmt: skip
            started.append(p)
            return p

        # ---- first boot: the join
        node = boot()
        wait_until("the node's join", lambda: "metald-node: node ready" in node_log.read_text()
                   or node.poll() is not None, 120, node_log)  # fmt: skip
        assert node.poll() is None, node_log.read_text()
        wait_until("srun on the node", (ctl / "srun.rc").exists, 300, node_log)
        log1 = node_log.read_text()
        # what the node left for its next boot, and the guard it applied, seen from inside
        root = Path(f"/proc/{node.pid}/root")
        guard_file = (root / "run/metald/guard.nft").read_text()
        node_munge = (root / "etc/munge/munge.key").read_bytes()
        joined = json.loads((root / "run/metald/joined.json").read_text())
        hosts = (tmp_path / "hosts").read_text()
        with api.store.session() as s:
            peer = s.exec(select(WgPeer).where(WgPeer.machine_id == machine_id)).one()
        handshake1 = hubs.handshakes(tenant_id).get(peer.public_key)
        procs.stop_group(node)

        persist = tmp_path / "persist"
        key = (persist / "wg.key").read_text().strip()
        pub = subprocess.run(
            ["wg", "pubkey"], input=key + "\n", capture_output=True, text=True, check=True
        ).stdout.strip()
        state = json.loads((persist / "state.json").read_text())

        # ---- second boot: back from the stored state
        (ctl / "go.2").touch()
        node_log.write_text("")
        node = boot()
        wait_until("srun on the rebooted node", (ctl / "srun.2.rc").exists, 300, node_log)
        log2 = node_log.read_text()
        handshake2 = hubs.handshakes(tenant_id).get(peer.public_key)
        procs.stop_group(node)
    finally:
        for p in reversed(started):
            procs.stop_group(p)
        hubs.stop()
        api.close()

    # first boot: joined with the file's token, over metald, as its machine's node
    for line in (
        f"metald-node: no joined state in {persist} yet; joining with {tmp_path}/join.json",
        "metald-node: guard applied on un0 (TCP 22 open)",
        f"metald-node: joining {api.url} as {HOSTNAME}",
        f"metald-node: joined state stored in {persist}",
        f"metald-node: joined hub {hub.endpoint} as {peer.address}/24",
        "metald-node: munged started",
        f"metald-node: slurmd started as {node_name}",
        "metald-node: node ready",
    ):
        assert line in log1, (line, log1[-4000:])
    assert "metald-node: error" not in log1
    assert (ctl / "srun.rc").read_text().strip() == "0", (ctl / "srun.err").read_text()
    assert (ctl / "srun.out").read_text().strip() == HOSTNAME
    # metald stored the key the node made, the hub shook hands with it
    assert peer.public_key == pub == state["public_key"]
    assert handshake1 is not None
    assert json.loads((tmp_path / "join.json").read_text()) == join_info  # left as it was
    assert state["join"]["overlay_address"] == f"{peer.address}/24"
    assert state["join"]["cluster"]["node_name"] == node_name
    assert node_munge == base64.b64decode(munge_key)
    assert "munge_key" not in joined["cluster"]  # what stays in /run after the start
    assert f"{peer.address}\t{HOSTNAME}" in hosts
    # the guard: metald's, on the node's underlay, with SSH open
    assert guard_file == guard.render(["un0"], mesh_port=mesh.NODE_LISTEN_PORT, tcp_ports=[22])
    # the joined state: private, on the OS's disk
    assert stat.S_IMODE(persist.stat().st_mode) == 0o700
    for f in ("wg.key", "state.json"):
        assert stat.S_IMODE((persist / f).stat().st_mode) == 0o600

    # second boot: no join call, the same key back on the hub, registered again, srun again
    for line in (
        f"metald-node: joined before: WireGuard key and join answer from {persist}; no join call",
        f"metald-node: back on hub {hub.endpoint} as {peer.address}/24",
        f"metald-node: slurmd started as {node_name}",
    ):
        assert line in log2, (line, log2[-4000:])
    assert "metald-node: joining" not in log2 and "metald-node: error" not in log2
    assert (ctl / "srun.2.rc").read_text().strip() == "0", (ctl / "srun.2.err").read_text()
    assert (ctl / "srun.2.out").read_text().strip() == HOSTNAME
    assert handshake2 is not None and handshake2 > handshake1
    assert api.requests.count("POST /api/v1/join") == 1, api.requests
    # secrets never on the console
    for log in (log1, log2):
        for s in (secret, munge_key, key):
            assert s not in log


def test_no_join_info_is_no_cluster_and_no_failure(tmp_path: Path) -> None:
    """A claim without a cluster: metald's cloud-config has no join entry. The agent says so
    and exits 0: the unit ends inactive instead of failing and restarting every 15 s."""
    from metald.provision.metadata import nocloud

    seed = tmp_path / "seed"
    seed.mkdir()
    files = nocloud(
        machine_id="m1", name="n1", pxe_mac=None, ssh_authorized_keys=[],
        user_data="#cloud-config\nwrite_files: [{path: /x, content: y}]\n",
    )  # fmt: skip
    for name, text in files.items():
        (seed / name).write_text(text)
    # it runs in this host's namespaces: should it go on, nothing here changes the host
    fence = tmp_path / "bin"
    fence.mkdir()
    for tool in ("nft", "ip", "wg", "munged", "slurmd", "curl"):
        (fence / tool).write_text("#!/bin/sh\necho fenced >&2\nexit 1\n")
        (fence / tool).chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{fence}:{os.environ['PATH']}",
        METALD_NODE_STATE=str(tmp_path / "state"),
        METALD_NODE_PERSIST=str(tmp_path / "persist"),
        METALD_JOIN_INFO=str(tmp_path / "join.json"),
        METALD_NODE_SEED=str(seed),
    )
    r = subprocess.run([str(SCRIPT), "join"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "this machine joins no cluster" in r.stdout
    assert "joining" not in r.stdout and not (tmp_path / "persist").exists()
