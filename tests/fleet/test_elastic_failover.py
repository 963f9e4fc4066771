"""kill -9 of the metald instance running an elastic pool's control plane between
ResumeProgram and the join (docs/elastic.md).

Real parts: PostgreSQL, two ``metald serve`` processes each in its own network namespace,
wireguard-go hubs, slurmctld + munged in the hub's namespace, slurmd in node namespaces. A job
for 2 nodes of the pool e[1-3] makes the owner's slurmctld run ResumeProgram; the owner
claims a machine for e1 and e2 and is killed (SIGKILL) before either joins. The survivor
brings the hub and the controller state up; the two machines (ready rows in the store, their
provisioning marked done by hand: the boot path is the QEMU proof's, tests/e2e) join through
the survivor as ``slurmd -N e1`` / ``-N e2``, and the job completes. No node name ever held
two claims, and no third machine was claimed.

METALD_LAB_LONG=1: about a minute (fleet timings, slurmctld's 30 s configuring timer). The
fast counterpart, a lost resume request claimed from slurmctld's node states, is
tests/claims/test_elastic_pools.py.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select

from metald import machines
from metald.lifecycle import Trigger
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Claim, Machine
from metald.tenants import clusters, controlplane, ctlstate, keys
from metald.tenants.runtime import clear_leftovers, veth_name
from netconfig import netns
from tests.claims.helpers import DISK_SPEC, add_ready
from tests.fleet.test_hub_failover import (
    DEAD_AFTER_S,
    HEARTBEAT_S,
    NAMES,
    NET,
    _alive,
    _conf,
    _curl,
    _hub_pids,
    _job_id_sequence,
    _kill_instance,
    _underlay,
)
from tests.fleet.test_hub_failover import pytestmark as _hub_marks
from tests.tenants.test_wireguard_e2e import node_up
from tests.test_daemon import BIN, share_secrets_key
from tests.waiting import wait_for

pytestmark = [
    *_hub_marks,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="about a minute (fleet failover, slurmctld's configuring timer): METALD_LAB_LONG=1",
    ),
]


def _elastic_claims(store: Store) -> list[tuple[str, str, list[str]]]:
    """(key, state, machine ids) of every claim made for a pool node."""
    with store.session() as s:
        rows = s.exec(select(Claim).where(col(Claim.idempotency_key).startswith("elastic:")))
        out = []
        for c in rows:
            ms = s.exec(select(Machine.id).where(Machine.claim_id == c.id)).all()
            out.append((str(c.idempotency_key), c.state, sorted(ms)))
        return sorted(out)


def test_kill_9_between_resume_program_and_join_survivor_finishes_one_claim_per_name(
    tmp_path: Path,
    pg_server,  # type: ignore[no-untyped-def]
) -> None:
    tag = f"{os.getpid() % 100000}{secrets.token_hex(1)}"
    tcp_url = pg_server.new_database()
    db = tcp_url.rsplit("/", 1)[1]
    url = f"postgresql+psycopg://metald@/{db}?host={pg_server.dir}&port={pg_server.port}"
    share_secrets_key(tmp_path, NAMES)
    procs: list[subprocess.Popen[bytes]] = []
    node_procs: list[subprocess.Popen[bytes]] = []
    node_devs: list[Any] = []
    store = Store(tcp_url)
    with _underlay(tag) as (sw, inst, nodes):
        try:
            env = {k: v for k, v in os.environ.items() if not k.startswith("METALD_")}
            for i, ns in enumerate(inst):
                log = open(tmp_path / f"{NAMES[i]}.log", "wb")  # noqa: SIM115 - closed with it
                argv = [str(BIN / "metald"), "serve", "--config", str(_conf(tmp_path, i, url))]
                procs.append(
                    subprocess.Popen(
                        netns.exec_argv(ns, argv), stdout=log, stderr=subprocess.STDOUT, env=env
                    )
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

            def see_each_other(i: int) -> bool:
                got = _curl(inst[i], "GET", f"http://{NET}.1{i}:8080/api/v1/instances",
                            token=admin)  # fmt: skip
                return sorted(m["name"] for m in got["items"] if m["alive"]) == NAMES

            for i in range(2):
                wait_for(f"{NAMES[i]} sees both", lambda i=i: see_each_other(i), 30)

            def api(i: int, method: str, path: str, body: Any = None) -> Any:
                return _curl(inst[i], method, f"http://{NET}.1{i}:8080{path}", body, admin)

            tid = api(0, "POST", "/api/v1/tenants", {"name": "acme", "cluster_kind": "slurm"})["id"]
            api(0, "POST", f"/api/v1/tenants/{tid}/hub", {})
            img = api(0, "POST", "/api/v1/images", {"name": "node", "kind": "disk", **DISK_SPEC})
            add_ready(store, 3, labels={"pool": "elastic"}, prefix=f"el{tag}")
            pool = api(0, "POST", f"/api/v1/tenants/{tid}/elastic-pools", {
                "name": "gpu", "prefix": "e", "max_nodes": 3, "image_id": img["id"],
                "selector": {"labels": {"pool": "elastic"}}, "suspend_time_s": 3600,
                "resume_timeout_s": 600,
            })  # fmt: skip

            def running_on() -> list[int]:
                return [
                    i for i, n in enumerate(NAMES)
                    if (tmp_path / n / "tenants" / tid / "slurm" / controlplane.INFO).exists()
                ]  # fmt: skip

            wait_for("the hub runs on one instance", lambda: len(running_on()) == 1, 30)
            owner = running_on()[0]
            survivor = 1 - owner
            owner_dir, survivor_dir = tmp_path / NAMES[owner], tmp_path / NAMES[survivor]

            def sinfo(d: Path) -> dict[str, str]:
                r = controlplane.exec_in(d, tid, ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=10)
                return dict(ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)

            wait_for("the pool's nodes in the owner's cluster",
                     lambda: set(sinfo(owner_dir)) >= {"e1", "e2", "e3"}, 30)  # fmt: skip
            r = controlplane.exec_in(
                owner_dir, tid,
                ["sbatch", "--parsable", "-p", pool["partition"], "-N2", "--wrap", "srun hostname"],
                timeout=10,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            job = r.stdout.strip()

            def live() -> dict[str, list[str]]:
                return {
                    k.rsplit(":", 1)[1]: ms
                    for k, st, ms in _elastic_claims(store)
                    if st in ("pending", "allocated")
                }

            claimed = wait_for("the owner claims e1 and e2",
                               lambda: (c := live()) and sorted(c) == ["e1", "e2"] and c, 30)  # fmt: skip
            # The controller state in the store holds the job (what the survivor restores).
            box = SecretBox((tmp_path / NAMES[0] / "secrets.key").read_bytes().strip())

            def saved_job_seq() -> int:
                with store.session() as s:
                    data = ctlstate.read(s, box, tid)
                return (_job_id_sequence(data) or 0) if data else 0

            wait_for("the job in the stored controller state",
                     lambda: saved_job_seq() > int(job), 30)  # fmt: skip

            # Killed between ResumeProgram and the join: no machine has joined yet.
            hub_pids = _hub_pids(owner_dir, tid)
            _kill_instance("metald", procs[owner], hub_pids, sw, owner)
            killed = time.monotonic()
            wait_for("the dead metald's hub is down",
                     lambda: not any(_alive(p) for p in hub_pids)
                     and veth_name(tid) not in netns.links(inst[owner]), 20)  # fmt: skip
            wait_for("the survivor runs the hub",
                     lambda: survivor in running_on()
                     and set(sinfo(survivor_dir)) >= {"e1", "e2", "e3"}, 60)  # fmt: skip
            t_hub = time.monotonic() - killed

            # The machines finish provisioning (the deploy agent's report, by hand) and join
            # through the survivor under the pool's names.
            for j, name in enumerate(["e1", "e2"]):
                (mid,) = claimed[name]
                with store.session() as s:
                    m = s.get(Machine, mid)
                    assert m is not None
                    if m.state == "claimed":
                        machines.transition(s, mid, Trigger.PROVISION, actor="test")
                    machines.transition(s, mid, Trigger.PROVISIONED, actor="test")
                    token, _exp = clusters.issue_join_token(s, mid, actor="test")
                priv = keys.generate_private_key()
                got = _curl(nodes[j], "POST", f"http://{NET}.1{survivor}:8080/api/v1/join",
                            {"token": token, "public_key": keys.public_key(priv)})  # fmt: skip
                c = got["cluster"]
                assert c["node_name"] == name and "-Z" not in c["slurmd_args"], c
                node_devs.append(node_up(nodes[j], f"ef{tag}{j}"[:15], priv, got))
                node_procs.append(
                    controlplane.start_machine(
                        nodes[j],
                        name,
                        tmp_path / f"node{j}",
                        base64.b64decode(c["munge_key"]),
                        # -b: a fresh boot (a namespace shares the host's uptime).
                        "slurmd",
                        "-D",
                        "-b",
                        *c["slurmd_args"],
                    )  # fmt: skip
                )

            def job_state() -> str:
                out = controlplane.exec_in(
                    survivor_dir, tid, ["scontrol", "show", "job", job], timeout=10
                ).stdout
                return next((w[9:] for w in out.split() if w.startswith("JobState=")), "")

            wait_for("the job completes on the survivor", lambda: job_state() == "COMPLETED", 120)
            took = time.monotonic() - killed
            # One claim per name, ever: the survivor's resumes (slurmctld's again, the node
            # states' reconcile) found e1 and e2 claimed; e3 never was.
            rows = _elastic_claims(store)
            assert [(k.rsplit(":", 1)[1], st) for k, st, _ in rows] == [
                ("e1", "allocated"), ("e2", "allocated")
            ], rows  # fmt: skip
            assert live() == claimed
            log = (survivor_dir.parent / f"{NAMES[survivor]}.log").read_text()
            assert "controller state restored from the store" in log, log[-3000:]
            print(
                f"\nkill -9 between ResumeProgram and the join: survivor runs the hub "
                f"{t_hub:.1f} s after, job COMPLETED {took:.1f} s after (heartbeat "
                f"{HEARTBEAT_S} s, dead after {DEAD_AFTER_S} s); claims {rows}"
            )
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
