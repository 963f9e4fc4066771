"""kill -9 the instance running a tenant's hub: a survivor brings the hub and its Slurm
controller up with the same keys, endpoint address and controller state, the nodes reconnect
by themselves (no join), and ``srun`` across them works again.

Real parts: PostgreSQL, two metald processes each in its own network namespace (its own
"host") with a bridge uplinked to one underlay switch, wireguard-go hubs, slurmctld + munged in
the hub's namespace, and two nodes (namespaces on the switch) that joined through metald's
join endpoint and run wireguard-go and ``slurmd -Z`` with only what the join returned.

"The instance dies" is what a host's death does: metald gets SIGKILL, so do the hub processes
it started, and the host drops off the underlay (its uplink is cut).

METALD_TEST_FLEET_TIMINGS="2,10" measures with the default heartbeat and dead time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, func, select

from metald import machines
from metald.lifecycle import Trigger
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Event, JoinToken, Machine, TenantCtlState, WgPeer
from metald.tenants import clusters, controlplane, ctlstate, keys
from metald.tenants.runtime import clear_leftovers, veth_name
from netconfig import netns
from tests.tenants.test_wireguard_e2e import node_up
from tests.test_daemon import BIN, share_secrets_key
from tests.waiting import wait_for
from vmlab.pg import pg_bindir

TOOLS = ("slurmctld", "slurmd", "srun", "sinfo", "munged", "wireguard-go", "wg", "nft", "curl")
pytestmark = [
    pytest.mark.root,
    pytest.mark.postgres,
    pytest.mark.skipif(
        not all(shutil.which(x) for x in TOOLS) or pg_bindir() is None,
        reason="needs slurmctld slurmd slurm-client munge wireguard-go wireguard-tools "
        "nftables curl postgresql",
    ),
]

#: Fleet timings: short for the suite. METALD_TEST_FLEET_TIMINGS="2,10" measures the defaults.
HEARTBEAT_S, DEAD_AFTER_S = (
    float(x) for x in os.environ.get("METALD_TEST_FLEET_TIMINGS", "0.5,3").split(",")
)
NET = "10.77.0"
NAMES = ["hub0", "hub1"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _attach(sw: str, ns: str, sw_if: str, ns_if: str) -> None:
    """A veth from ``ns`` to the switch's bridge."""
    netns.veth(ns, ns_if, sw, sw_if)
    _ip("-n", sw, "link", "set", sw_if, "master", "br0", "up")


def _curl(ns: str, method: str, url: str, body: Any = None, token: str | None = None) -> Any:
    from vmlab.rack import curl_json

    st, out = curl_json(ns, method, url, body, token)
    assert st < 300, (method, url, st, out)
    return out


def _conf(tmp: Path, i: int, url: str) -> Path:
    name = NAMES[i]
    conf = tmp / f"{name}.toml"
    conf.write_text(
        f'state_dir = "{tmp / name}"\ninstance = "{name}"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "{NET}.1{i}:8080"\npublic_url = "http://{NET}.1{i}:8080"\n'
        f"[fleet]\nheartbeat_s = {HEARTBEAT_S}\ndead_after_s = {DEAD_AFTER_S}\n"
        "[bmc]\npower_sync_interval_s = 0\n"
        "[tenants]\nhubs = true\ncontrol_planes = true\nobserve_interval_s = 1\n"
        f'underlay_bridge = "bru"\nhub_addresses = "{NET}.248/29"\n'
    )
    return conf


def _job_id_sequence(snapshot: bytes) -> int | None:
    """The job id counter slurmctld saved in ``job_state``: after its header (a packstr
    version, a 16-bit protocol version, a 64-bit time) comes the 32-bit id the next job
    gets."""
    data = ctlstate.files(snapshot).get("job_state")
    if data is None:
        return None
    (n,) = struct.unpack_from(">I", data, 0)
    return struct.unpack_from(">I", data, 4 + n + 2 + 8)[0]


def _srun(state_dir: Path, tid: str) -> list[int]:
    """``srun -N2`` inside the tenant's control plane; the job id each node printed."""
    r = controlplane.exec_in(
        state_dir, tid, ["srun", "-N2", "-I5", "sh", "-c", "echo $SLURM_JOB_ID $(hostname)"],
        timeout=30,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.split("\n"))
    return [int(line.split()[0]) for line in lines if line.strip()]


def _srun_works(state_dir: Path, tid: str) -> list[int] | None:
    try:
        return _srun(state_dir, tid)
    except (AssertionError, OSError, ValueError, subprocess.TimeoutExpired):
        return None


@contextlib.contextmanager
def _underlay(tag: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """A switch namespace with a bridge; two instance "hosts" (a bridge ``bru`` holding the
    instance's address, uplinked to the switch); two node namespaces on the switch."""
    sw = f"hfsw-{tag}"
    inst = [f"hfi{i}-{tag}" for i in range(2)]
    nodes = [f"hfn{j}-{tag}" for j in range(2)]
    from vmlab.netns import add_bridge

    try:
        netns.create(sw)
        add_bridge(sw, "br0", [], 24)
        for i, ns in enumerate(inst):
            netns.create(ns)
            add_bridge(ns, "bru", [f"{NET}.1{i}"], 24)
            _attach(sw, ns, f"i{i}", "up0")
            _ip("-n", ns, "link", "set", "up0", "master", "bru", "up")
        for j, ns in enumerate(nodes):
            netns.create(ns)
            _attach(sw, ns, f"n{j}", "un0")
            netns.address(ns, "un0", f"{NET}.2{j}/24")
        yield sw, inst, nodes
    finally:
        for ns in [*nodes, *inst, sw]:
            netns.delete(ns)


def _make_machines(store: Store, tid: str, tag: str) -> list[str]:
    """Two machines of the tenant, provisioned (the lifecycle up to there is tested
    elsewhere)."""
    ids = []
    with store.session() as s:
        for j in range(2):
            m = machines.create_machine(
                s, macs=[f"52:54:00:77:00:{j + 1:02x}"], actor="test", name=f"n{tag}x{j}"
            )
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            machines.transition(
                s, m.id, Trigger.INSPECTED, actor="test",
                updates={"inventory": {"schema_version": 1}, "gpu_count": 0},
            )  # fmt: skip
            machines.transition(s, m.id, Trigger.CLAIM, actor="test", updates={"tenant_id": tid})
            machines.transition(s, m.id, Trigger.PROVISION, actor="test")
            machines.transition(s, m.id, Trigger.PROVISIONED, actor="test")
            ids.append(m.id)
    return ids


def _hub_pids(state_dir: Path, tid: str) -> list[int]:
    """The hub's wireguard-go and control plane processes metald started."""
    wd = state_dir / "tenants" / tid
    info = json.loads((wd / "slurm" / controlplane.INFO).read_text())
    return [int((wd / "wg.pid").read_text()), int(info["pid"])]


def _alive(pid: int) -> bool:
    try:
        return b"State:\tZ" not in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return False


def _kill_instance(
    how: str, proc: subprocess.Popen[bytes], hub_pids: list[int], sw: str, i: int
) -> None:
    """``host``: the host dies: metald and every hub process it started get SIGKILL, and the
    host drops off the underlay. ``metald``: only the metald process gets SIGKILL."""
    proc.send_signal(signal.SIGKILL)
    if how == "host":
        for pid in hub_pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # the control plane's whole group
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _ip("-n", sw, "link", "del", f"i{i}")
    proc.wait()


@pytest.mark.parametrize("how", ["metald", "host"])
def test_kill_9_the_hub_instance_srun_works_again_no_node_joins_again(
    how: str,
    tmp_path: Path,
    pg_server,  # type: ignore[no-untyped-def]
) -> None:
    tag = f"{os.getpid() % 100000}{secrets.token_hex(1)}"
    tcp_url = pg_server.new_database()
    db = tcp_url.rsplit("/", 1)[1]
    # The instances live in their own network namespaces: they reach PostgreSQL over its unix
    # socket (which is not namespaced), as they would reach a database host over a network.
    url = f"postgresql+psycopg://metald@/{db}?host={pg_server.dir}&port={pg_server.port}"
    share_secrets_key(tmp_path, NAMES)
    box = SecretBox((tmp_path / NAMES[0] / "secrets.key").read_bytes().strip())
    procs: list[subprocess.Popen[bytes]] = []
    node_procs: list[subprocess.Popen[bytes]] = []
    node_devs: list[Any] = []
    store = Store(tcp_url)
    with _underlay(tag) as (sw, inst, nodes):
        try:
            # metald reads METALD_* variables as configuration: not the test's own.
            env = {k: v for k, v in os.environ.items() if not k.startswith("METALD_TEST_")}
            for i, ns in enumerate(inst):
                log = open(tmp_path / f"{NAMES[i]}.log", "wb")  # noqa: SIM115 - closed with it
                procs.append(
                    subprocess.Popen(
                        [
                            *netns.exec_argv(
                                ns,
                                [
                                    str(BIN / "metald"),
                                    "serve",
                                    "--config",
                                    str(_conf(tmp_path, i, url)),
                                ],
                            )
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )  # fmt: skip
                )

            def api_up(i: int) -> bool:
                assert procs[i].poll() is None, (tmp_path / f"{NAMES[i]}.log").read_text()
                try:
                    _curl(inst[i], "GET", f"http://{NET}.1{i}:8080/healthz")
                    return True
                except (RuntimeError, AssertionError):
                    return False

            for i in range(2):
                wait_for(f"{NAMES[i]} answers", lambda i=i: api_up(i), 60)
            admin = next(
                (tmp_path / n / "admin.token").read_text().strip()
                for n in NAMES
                if (tmp_path / n / "admin.token").exists()
            )
            api = f"http://{NET}.10:8080"

            def see_each_other(i: int) -> bool:
                got = _curl(inst[i], "GET", f"http://{NET}.1{i}:8080/api/v1/instances",
                            token=admin)  # fmt: skip
                return sorted(m["name"] for m in got["items"] if m["alive"]) == NAMES

            for i in range(2):  # else each may take the hub for its own at first
                wait_for(f"{NAMES[i]} sees both", lambda i=i: see_each_other(i), 30)
            tid = _curl(inst[0], "POST", f"{api}/api/v1/tenants",
                        {"name": "acme", "cluster_kind": "slurm"}, admin)["id"]  # fmt: skip
            hub = _curl(inst[0], "POST", f"{api}/api/v1/tenants/{tid}/hub", {}, admin)

            def running_on() -> list[int]:
                return [
                    i for i, n in enumerate(NAMES)
                    if (tmp_path / n / "tenants" / tid / "slurm" / controlplane.INFO).exists()
                ]  # fmt: skip

            wait_for("the hub runs on one instance", lambda: len(running_on()) == 1, 30)
            owner = running_on()[0]
            survivor = 1 - owner
            owner_dir, survivor_dir = tmp_path / NAMES[owner], tmp_path / NAMES[survivor]

            # Two nodes join (through the instance that does not run the hub: the join is a
            # store write; the owner applies the peer at its next sync).
            mids = _make_machines(store, tid, tag)
            joined = []
            for j, mid in enumerate(mids):
                with store.session() as s:
                    token, _exp = clusters.issue_join_token(s, mid, actor="test")
                priv = keys.generate_private_key()
                got = _curl(nodes[j], "POST", f"http://{NET}.1{survivor}:8080/api/v1/join",
                            {"token": token, "public_key": keys.public_key(priv)})  # fmt: skip
                assert got["hub"]["endpoint"] == hub["endpoint"]
                node_devs.append(node_up(nodes[j], f"hf{tag}{j}"[:15], priv, got))
                c = got["cluster"]
                node_procs.append(
                    controlplane.start_machine(
                        nodes[j],
                        c["node_name"],
                        tmp_path / f"node{j}",
                        base64.b64decode(c["munge_key"]),
                        "slurmd",
                        "-D",
                        *c["slurmd_args"],
                    )  # fmt: skip
                )
                joined.append(got)

            def states() -> set[str]:
                with store.session() as s:
                    return {
                        m.state for m in s.exec(select(Machine).where(col(Machine.id).in_(mids)))
                    }

            wait_for("both nodes active", lambda: states() == {"active"}, 60)
            wait_for("srun -N2 works", lambda: _srun_works(owner_dir, tid), 30)
            before_ids = _srun(owner_dir, tid)
            last_job = max(before_ids)

            # The snapshot in the store has caught up with the job counter.
            def snapshot_job_seq() -> int | None:
                with store.session() as s:
                    data = ctlstate.read(s, box, tid)
                return _job_id_sequence(data) if data else None

            wait_for("the job counter is in the store",
                   lambda: (snapshot_job_seq() or 0) > last_job, 30)  # fmt: skip

            def joins() -> tuple[int, int, list[tuple[str, str]]]:
                with store.session() as s:
                    added = s.exec(
                        select(func.count()).select_from(Event)
                        .where(Event.kind == "tenant.peer.added")
                    ).one()  # fmt: skip
                    used = s.exec(
                        select(func.count()).select_from(JoinToken)
                        .where(col(JoinToken.used_at).is_not(None))
                    ).one()  # fmt: skip
                    peers = sorted(
                        (p.id, p.public_key)
                        for p in s.exec(select(WgPeer).where(WgPeer.tenant_id == tid))
                    )
                return added, used, peers

            before = joins()
            assert before[0] == 2 and before[1] == 2 and len(before[2]) == 2

            hub_pids = _hub_pids(owner_dir, tid)
            _kill_instance(how, procs[owner], hub_pids, sw, owner)
            killed = time.monotonic()
            if how == "metald":
                # Its host lives on: the hub's reaper takes the orphaned hub down (its
                # processes, and its veth off the host's bridge), so the endpoint address
                # answers only on the survivor.
                veth = veth_name(tid)
                wait_for("the dead metald's hub is down",
                       lambda: not any(_alive(p) for p in hub_pids)
                       and veth not in netns.links(inst[owner]), 20)  # fmt: skip
            after_ids = wait_for("srun -N2 works on the survivor",
                               lambda: _srun_works(survivor_dir, tid), 60)  # fmt: skip
            took = time.monotonic() - killed
            print(
                f"\nkill -9 of the hub's instance ({how}) -> srun -N2 works again: {took:.1f} s "
                f"(heartbeat {HEARTBEAT_S} s, dead after {DEAD_AFTER_S} s)"
            )

            # The controller's state moved with the hub: the job counter went on.
            assert min(after_ids) > last_job, (before_ids, after_ids)
            log = (tmp_path / f"{NAMES[survivor]}.log").read_text()
            assert "controller state restored from the store" in log, log[-3000:]
            # The joins went through the instance that did not run the hub: nothing failed
            # there (the owner applied the stored peers).
            assert "could not add the peer" not in log, log[-3000:]
            # No node joined again: no join, no token used, the same peers; the nodes' own
            # processes ran on untouched.
            assert joins() == before
            assert all(p.poll() is None for p in node_procs)
            with store.session() as s:
                row = s.get(TenantCtlState, tid)
                assert row is not None and row.owner == NAMES[survivor]
            # The same endpoint address, and the same keys (the nodes' tunnels were not
            # reconfigured: their hub peer is the one the join gave them).
            now = _curl(inst[survivor], "GET", f"http://{NET}.1{survivor}:8080/api/v1/tenants/"
                        f"{tid}/hub", token=admin)  # fmt: skip
            assert now["endpoint"] == hub["endpoint"]
            assert now["public_key"] == joined[0]["hub"]["public_key"]
            assert took < 60
        finally:
            for p in node_procs:
                controlplane.stop_process(p)
            for d in node_devs:
                d.stop()
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(30)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
            for n in NAMES:
                clear_leftovers(tmp_path / n)
            store.close()
