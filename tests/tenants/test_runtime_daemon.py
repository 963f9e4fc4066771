"""The tenant runtime inside a real metald (lab namespace, no VMs): creating a hub brings up its
namespace, guard, wireguard-go and slurmctld; a node (a namespace on the lab bridge) that
follows the node image's protocol joins and becomes active; release takes its peer off the hub
and its node out of the cluster, and the node can no longer reach the tenant."""

from __future__ import annotations

import base64
import secrets
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from metald.auth import issue_token
from metald.store import Store
from metald.store.models import Machine
from metald.tenants import controlplane, keys
from tests.tenants.nslab import tcp_connects, wait_for
from tests.tenants.test_wireguard_e2e import node_up

pytestmark = [
    pytest.mark.root,
    pytest.mark.lab,
    pytest.mark.skipif(
        not all(
            shutil.which(x)
            for x in ("slurmctld", "slurmd", "sinfo", "munged", "wireguard-go", "nft", "curl")
        ),
        reason="needs slurmctld slurmd slurm-client munge wireguard-go nftables curl",
    ),
]


def test_daemon_runs_hub_and_control_plane_node_joins_and_release_removes_it(
    tmp_path: Path,
) -> None:
    from vmlab.rack import LabRack, curl_json, tenants_config

    rack = LabRack(
        f"rt{secrets.token_hex(2)}", tmp_path, machines=0, uefi=0, extra_config=tenants_config
    )
    node_proc = None
    node_dev = None
    try:
        st, tid = rack.api("POST", "/api/v1/tenants", {"name": "acme", "cluster_kind": "slurm"})
        assert st == 201, tid
        tid = tid["id"]
        st, hub = rack.api("POST", f"/api/v1/tenants/{tid}/hub", {})
        assert st == 201, hub
        assert hub["endpoint"] == f"10.{rack.state['slot']}.0.249:51820"
        info = rack.state_dir / "tenants" / tid / "slurm" / controlplane.INFO
        assert wait_for(info.exists, 10), rack.log.read_text()[-3000:]

        # A ready machine (enrollment is tested elsewhere), claimed with a stateless image.
        store = Store(f"sqlite:///{rack.state_dir / 'metald.db'}")
        with store.session() as s:
            m = Machine(name="gpu-a1", state="ready", gpu_count=0, inventory={"schema_version": 1})
            s.add(m)
            s.commit()
            mid = m.id
        st, img = rack.api(
            "POST",
            "/api/v1/images",
            {"name": "node", "kind": "stateless", "kernel": "node/vmlinuz", "initrd": "node/i"},
        )
        assert st == 201, img
        st, claim = rack.api(
            "POST", "/api/v1/claims", {"tenant_id": tid, "count": 1, "image_id": img["id"]}
        )
        assert st == 201, claim
        with store.session() as s:
            _row, agent = issue_token(s, name="agent", role="agent", scope=[mid])
        store.close()

        # The node, as the node image's init does it (docs/node-image.md).
        node = rack.lab.add_namespace("node1")
        ns = node["netns"]
        st, todo = curl_json(ns, "GET", f"{rack.url}/api/v1/agent/provision", token=agent)
        assert st == 200 and todo["action"] == "provision", todo
        join = todo["join"]
        assert join["url"] == rack.url
        st, _ = curl_json(
            ns, "POST", f"{rack.url}/api/v1/agent/progress", {"phase": "booted", "done": True},
            token=agent,
        )  # fmt: skip
        assert st == 200
        priv = keys.generate_private_key()
        pub = keys.public_key(priv)
        st, joined = curl_json(
            ns, "POST", f"{join['url']}/api/v1/join", {"token": join["token"], "public_key": pub}
        )
        assert st == 200, joined
        node_dev = node_up(ns, f"mn{secrets.token_hex(4)}", priv, joined)
        cluster = joined["cluster"]
        node_proc = controlplane.start_machine(
            ns, cluster["node_name"], tmp_path / "node", base64.b64decode(cluster["munge_key"]),
            "slurmd", "-D", *cluster["slurmd_args"],
        )  # fmt: skip

        def machine() -> dict[str, Any]:
            return rack.api("GET", f"/api/v1/machines/{mid}")[1]

        assert wait_for(lambda: machine()["state"] == "active", 60), (
            machine(),
            rack.log.read_text()[-3000:],
            (tmp_path / "node" / "out.log").read_text()[-2000:],
        )
        hub_ip = joined["hub"]["address"]
        assert tcp_connects(ns, hub_ip, 6817)  # slurmctld over the tunnel
        # The hub's guard: slurmctld is not reachable on the underlay.
        assert not tcp_connects(ns, hub["endpoint"].split(":")[0], 6817)
        r = controlplane.exec_in(rack.state_dir, tid, ["srun", "-N1", "hostname"], timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == cluster["node_name"], r.stderr

        # metald crashes (SIGKILL) and starts again: the hub and control plane are rebuilt from
        # the store (stale wireguard-go/slurmctld stopped), the hub dials the node where it was
        # last seen, and the node is back in the cluster without doing anything.
        killed_at = time.time()
        rack.restart_metald(crash=True)

        def fresh_handshake() -> bool:
            peers = rack.api("GET", f"/api/v1/tenants/{tid}/hub")[1]["peers"]
            at = peers[0]["last_handshake_at"] if peers else None
            return at is not None and datetime.fromisoformat(at).timestamp() > killed_at

        assert wait_for(fresh_handshake, 40), rack.log.read_text()[-3000:]
        assert machine()["state"] == "active"
        assert wait_for(lambda: tcp_connects(ns, hub_ip, 6817), 20)
        r = controlplane.exec_in(rack.state_dir, tid, ["srun", "-N1", "hostname"], timeout=90)
        assert r.returncode == 0 and r.stdout.strip() == cluster["node_name"], r.stderr

        # Release: the peer leaves the hub, the node leaves the cluster, the tunnel is dead.
        st, out = rack.api("POST", f"/api/v1/claims/{claim['id']}/release")
        assert st == 200 and out["machines"][0]["state"] == "wiping", out
        st, hub_now = rack.api("GET", f"/api/v1/tenants/{tid}/hub")
        assert hub_now["peers"] == []

        def in_cluster() -> bool:
            r = controlplane.exec_in(rack.state_dir, tid, ["sinfo", "-h", "-N", "-o", "%N"])
            return cluster["node_name"] in r.stdout

        # A deadline, not a time goal: 20 s once ran out at load ~10 (18 s for the whole test
        # on a quiet box).
        assert wait_for(lambda: not in_cluster(), 60)
        time.sleep(1)
        assert not tcp_connects(ns, hub_ip, 6817)
    finally:
        controlplane.stop_process(node_proc)
        if node_dev is not None:
            node_dev.stop()
        rack.down()
