"""Slurm over the tunnel (lab): slurmctld + munged in the hub namespace, a dynamic node
(`slurmd -Z --conf-server`) in the node namespace with only what the join call returned;
`sinfo` on the control plane shows the node idle, and metald marks the machine active."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from sqlmodel import select

from metald.lifecycle import State
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Machine, Tenant, WgHub
from metald.tenants import clusters, controlplane, keys, slurm
from metald.tenants.hubs import LocalHubs
from tests.tenants.conftest import make_env
from tests.tenants.nslab import underlay, wait_for
from tests.tenants.test_wireguard_e2e import node_up

pytestmark = [
    pytest.mark.root,
    pytest.mark.lab,
    pytest.mark.skipif(
        not all(
            shutil.which(x) for x in ("slurmctld", "slurmd", "sinfo", "munged", "wireguard-go")
        ),
        reason="needs slurmctld slurmd slurm-client munge wireguard-go",
    ),
]


def in_machine(pid: int, *argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        controlplane.exec_argv(pid, list(argv)),
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
    )


def test_slurm_node_joins_over_wireguard(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'metald.db'}")
    store.migrate()
    box = SecretBox(Fernet.generate_key())
    env = make_env(store, box)
    tenant_id, machine_id = env.tokens.tenant_a, env.tokens.machine_a
    with store.session() as s:  # a lab node has no GPUs to offer slurmd
        m = s.get(Machine, machine_id)
        assert m is not None
        m.gpu_count, m.gpu_model = 0, None
        s.add(m)
        s.commit()
    hubs = LocalHubs()
    ctld = node = None
    node_dev = None
    hub_host = f"ctl{secrets.token_hex(3)}"
    try:
        with underlay() as u, store.session() as s:
            hub = s.exec(select(WgHub).where(WgHub.tenant_id == tenant_id)).one()
            tenant = s.get(Tenant, tenant_id)
            assert tenant is not None and tenant.overlay_prefix
            hubs.start_from_store(s, box, tenant_id, u.hub_ns)
            munge_key = base64.b64decode(clusters.load_secrets(box, tenant)["munge_key"])
            conf = tmp_path / "ctl" / "slurm.conf"
            conf.parent.mkdir(mode=0o700)
            conf.write_text(
                slurm.render_slurm_conf(
                    slurm.ControlPlane(
                        cluster_name="acme",
                        host_name=hub_host,
                        address=hub.address,
                        state_dir="/var/spool/slurmctld",
                        spool_dir="/var/spool/slurmd",
                        run_dir="/run/slurm",
                        log_dir="/var/spool/log",
                        max_nodes=16,
                    )
                )
            )
            ctl_env = {"SLURM_CONF": str(conf)}
            ctld = controlplane.start_machine(
                u.hub_ns, hub_host, conf.parent, munge_key, "slurmctld", "-D", "-f", str(conf)
            )

            secret, _ = clusters.issue_join_token(s, machine_id, actor="test")
            node_priv = keys.generate_private_key()
            node_pub = keys.public_key(node_priv)
            result = clusters.join(s, box, secret, node_pub)
            hubs.add_peer(tenant_id, node_pub, result.peer.address)
            joined = result.response()
            node_dev = node_up(u.node_ns, f"mn{secrets.token_hex(4)}", node_priv, joined)
            cluster = joined["cluster"]
            node = controlplane.start_machine(
                u.node_ns,
                cluster["node_name"],
                tmp_path / "node",
                base64.b64decode(cluster["munge_key"]),
                "slurmd", "-D", *cluster["slurmd_args"],
            )  # fmt: skip

            def node_state() -> str:
                r = in_machine(ctld.pid, "sinfo", "-h", "-N", "-o", "%N %t", env=ctl_env)
                return r.stdout.strip()

            assert wait_for(lambda: node_state() == f"{cluster['node_name']} idle", 30), (
                node_state(),
                (tmp_path / "node" / "out.log").read_text()[-2000:],
            )
            # The node registered from its overlay address: the tunnel carries Slurm.
            r = in_machine(ctld.pid, "scontrol", "show", "node", cluster["node_name"], env=ctl_env)
            assert f"NodeAddr={result.peer.address} " in r.stdout, r.stdout
            seen = hubs.handshakes(tenant_id)[node_pub]
            got = clusters.observe(
                s,
                machine_id,
                handshake_at=seen,
                scheduler_reports_node=cluster["node_name"] in node_state(),
            )
            assert got.state == State.ACTIVE
    finally:
        controlplane.stop_process(node)
        controlplane.stop_process(ctld)
        if node_dev is not None:
            node_dev.stop()
        hubs.stop()
        store.close()
