"""Two tenants' Slurm clusters in the virtual rack, through the real boot path.

Tenants alpha and beta each get a WireGuard hub and a Slurm control plane (slurmctld + munged)
that metald runs in the hub's namespace on the lab bridge. alpha claims 2 machines and beta 1,
with the tenant node image (stateless: iPXE loads it into RAM); each node fetches its join
token from metald, generates its WireGuard key, joins its tenant's hub with kernel WireGuard,
applies its underlay guard, and starts slurmd against its controller over the tunnel. metald
marks each active once the handshake is seen and slurmctld reports the node.

Then: sinfo and ``srun hostname`` on each cluster; a reachability matrix probed from every node
(through srun: the nodes have no other shell) shows each reaches only its own hub and control
plane, plus metald's API (join and agent endpoints), and nothing else; claim events carry each
tenant's VLAN. Releasing one of alpha's machines takes it out of alpha's cluster and off the
hub, wipes it, and returns it to ready.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from metald.provision.metadata import hostname
from metald.tenants import controlplane
from tests.tenants.nslab import tcp_connects

pytestmark = [pytest.mark.lab, pytest.mark.root]

ACTIVE_TIMEOUT_S = 480
READY_TIMEOUT_S = 480

# busybox sh on the node: "host:port ok|no" per target (nc connects, or fails within 2 s).
PROBE = (
    'for t in "$@"; do '
    'if nc -w 2 "${t%:*}" "${t#*:}" </dev/null >/dev/null 2>&1; '
    'then echo "$t ok"; else echo "$t no"; fi; done'
)

# busybox sh on the node: "path status" per path of metald's API (the HTTP status, or none).
# The request's writer stays open a moment: aiohttp may drop a request half-closed early.
HTTP_PROBE = (
    'api=$1; shift; for p in "$@"; do '
    's=$( (printf "GET %s HTTP/1.0\\r\\nHost: metald\\r\\n\\r\\n" "$p"; sleep 3) '
    '| nc -w 5 "${api%:*}" "${api#*:}" | head -n 1 | cut -d " " -f 2); '
    'echo "$p ${s:-none}"; done'
)


def wait_for(what: str, fn, timeout: float, rack) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not fn():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}\n{rack.diagnostics()}")
        time.sleep(2)
    return time.monotonic() - t0


def ctl_exec(rack, tenant_id: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]  # fmt: skip
    return controlplane.exec_in(rack.state_dir, tenant_id, list(argv), timeout=timeout)


def sinfo(rack, tenant_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    r = ctl_exec(rack, tenant_id, "sinfo", "-h", "-N", "-o", "%N %t")
    return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)


def underlay_ip(rack, tenant_id: str, node: str) -> str:  # type: ignore[no-untyped-def]
    r = ctl_exec(rack, tenant_id, "srun", "-w", node, "ip", "-4", "-o", "addr", "show")
    for line in r.stdout.splitlines():
        parts = line.split()
        if parts[1] not in ("lo", "wg0"):
            return parts[3].split("/")[0]
    raise AssertionError(f"no underlay address on {node}: {r.stdout} {r.stderr}")


def test_two_tenants_join_isolated_and_release(enrolled_rack) -> None:  # type: ignore[no-untyped-def]
    rack = enrolled_rack.rack
    macs = [m["mac"] for m in rack.machines]
    rack.wait_state(macs, "ready", READY_TIMEOUT_S)  # the claims test's wipes are done

    tenants: dict[str, dict[str, Any]] = {}
    for name in ("alpha", "beta"):
        st, t = rack.api("POST", "/api/v1/tenants", {"name": name, "cluster_kind": "slurm"})
        assert st == 201, t
        st, hub = rack.api("POST", f"/api/v1/tenants/{t['id']}/hub", {})
        assert st == 201, hub
        tenants[name] = {**t, "hub": hub}
    a, b = tenants["alpha"], tenants["beta"]
    assert a["vlan"] != b["vlan"]
    assert a["hub"]["overlay_prefix"] != b["hub"]["overlay_prefix"]

    img = rack.json("images", "create", "tenant-node", *rack.publish_node_image())
    t0 = time.monotonic()
    claim_a = rack.json("claims", "create", "--tenant", a["id"], "--count", "2", "--image", img["id"])  # fmt: skip
    claim_b = rack.json("claims", "create", "--tenant", b["id"], "--count", "1", "--image", img["id"])  # fmt: skip
    ids_a = [m["id"] for m in claim_a["machines"]]
    ids_b = [m["id"] for m in claim_b["machines"]]

    def states() -> dict[str, str]:
        return {i: rack.json("machines", "show", i)["state"] for i in ids_a + ids_b}

    wait_for("all three active", lambda: set(states().values()) == {"active"}, ACTIVE_TIMEOUT_S, rack)  # fmt: skip
    t_active = time.monotonic() - t0

    # Each cluster sees exactly its own nodes, idle, and runs jobs on them.
    nodes_a, nodes_b = sinfo(rack, a["id"]), sinfo(rack, b["id"])
    assert sorted(nodes_a.values()) == ["idle", "idle"], nodes_a
    assert list(nodes_b.values()) == ["idle"], nodes_b
    assert not set(nodes_a) & set(nodes_b)
    r = ctl_exec(rack, a["id"], "srun", "-N2", "hostname")
    assert r.returncode == 0 and sorted(r.stdout.split()) == sorted(nodes_a), (r.stdout, r.stderr)
    r = ctl_exec(rack, b["id"], "srun", "-N1", "hostname")
    assert r.returncode == 0 and r.stdout.split() == list(nodes_b), (r.stdout, r.stderr)

    # Claim events carry each tenant's VLAN for switch automation.
    events = [
        e for e in rack.json("events", "--limit", "1000")["items"] if e["kind"] == "claim.created"
    ]
    vlans = {e["data"]["claim_id"]: e["data"]["network"]["vlan"] for e in events}
    assert vlans[claim_a["id"]] == a["vlan"] and vlans[claim_b["id"]] == b["vlan"]

    # Reachability, probed from every node.
    metald_api = f"{rack.state['boot_address']}:8080"
    hub_ip = {n: t["hub"]["address"] for n, t in tenants.items()}
    hub_underlay = {n: t["hub"]["endpoint"].split(":")[0] for n, t in tenants.items()}
    node_tenant = {n: "alpha" for n in nodes_a} | {n: "beta" for n in nodes_b}
    node_ip = {n: underlay_ip(rack, tenants[t]["id"], n) for n, t in node_tenant.items()}
    node_overlay = {}
    for t in tenants.values():
        for p in rack.api("GET", f"/api/v1/tenants/{t['id']}/hub")[1]["peers"]:
            name = rack.json("machines", "show", p["machine_id"]).get("name")
            node_overlay[hostname(p["machine_id"], name)] = p["address"]
    assert set(node_overlay) == set(node_tenant)
    matrix: dict[str, dict[str, str]] = {}
    expected: dict[str, dict[str, str]] = {}
    for node, tname in node_tenant.items():
        other = "beta" if tname == "alpha" else "alpha"
        targets = {
            f"own control plane (overlay {hub_ip[tname]}:6817)": (f"{hub_ip[tname]}:6817", "ok"),
            f"metald API ({metald_api})": (metald_api, "ok"),
            f"other tenant's control plane (overlay {hub_ip[other]}:6817)": (f"{hub_ip[other]}:6817", "no"),
            "own hub's slurmctld on the underlay": (f"{hub_underlay[tname]}:6817", "no"),
            "other hub's slurmctld on the underlay": (f"{hub_underlay[other]}:6817", "no"),
        }  # fmt: skip
        for peer, ptenant in node_tenant.items():
            if peer != node:
                kind = "same" if ptenant == tname else "other"
                targets[f"{kind} tenant's node {peer} slurmd on the underlay"] = (
                    f"{node_ip[peer]}:6818",
                    "no",
                )
                # Within a tenant, nodes reach each other through the hub (srun steps need it).
                targets[f"{kind} tenant's node {peer} slurmd over the overlay"] = (
                    f"{node_overlay[peer]}:6818",
                    "ok" if kind == "same" else "no",
                )
        r = ctl_exec(
            rack, tenants[tname]["id"], "srun", "-w", node, "sh", "-c", PROBE, "probe",
            *(t for t, _ in targets.values()), timeout=120,
        )  # fmt: skip
        got = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if line.strip())
        matrix[node] = {label: got.get(t, "?") for label, (t, _) in targets.items()}
        expected[node] = {label: want for label, (_, want) in targets.items()}
        # Over HTTP, metald answers a tenant's machine only on the join and agent endpoints
        # (metald/nodeguard.py): the rest of the API is 403 before any token is read.
        paths = {
            "metald API: GET /api/v1/machines (no token)": ("/api/v1/machines", "403"),
            "metald API: GET /healthz": ("/healthz", "403"),
            "metald agent endpoint: GET /api/v1/agent/next (no token)": ("/api/v1/agent/next", "401"),
        }  # fmt: skip
        r = ctl_exec(
            rack, tenants[tname]["id"], "srun", "-w", node, "sh", "-c", HTTP_PROBE, "probe",
            metald_api, *(p for p, _ in paths.values()), timeout=120,
        )  # fmt: skip
        got = dict(line.rsplit(" ", 1) for line in r.stdout.splitlines() if line.strip())
        matrix[node] |= {label: got.get(p, "?") for label, (p, _) in paths.items()}
        expected[node] |= {label: want for label, (_, want) in paths.items()}
    # From the provisioning network itself (metald's namespace): nodes' slurmd is guarded.
    for node, ip in node_ip.items():
        label = "from the provisioning network: slurmd on the underlay"
        matrix.setdefault(f"(lab) -> {node}", {})[label] = (
            "ok" if tcp_connects(rack.lab.netns, ip, 6818) else "no"
        )
        expected.setdefault(f"(lab) -> {node}", {})[label] = "no"
    print("\nreachability (ok = TCP connection accepted; numbers: metald's HTTP status):")
    for src, row in matrix.items():
        for label, res in row.items():
            print(f"  {src:>28} -> {label:<60} {res}")
    assert matrix == expected

    # Release one of alpha's machines: out of alpha's cluster, off the hub, wiped, ready.
    gone = ids_a[0]
    peers_before = {p["machine_id"]: p for p in rack.api("GET", f"/api/v1/tenants/{a['id']}/hub")[1]["peers"]}  # fmt: skip
    assert set(peers_before) == set(ids_a)
    t1 = time.monotonic()
    rack.ctl("claims", "release", claim_a["id"], "--machine", gone)
    hub_now = rack.api("GET", f"/api/v1/tenants/{a['id']}/hub")[1]
    assert [p["machine_id"] for p in hub_now["peers"]] == [ids_a[1]]
    wait_for("alpha's cluster to drop the node", lambda: len(sinfo(rack, a["id"])) == 1, 60, rack)
    assert rack.json("machines", "show", ids_a[1])["state"] == "active"
    assert ctl_exec(rack, a["id"], "srun", "-N1", "hostname").returncode == 0
    wait_for(
        "the released machine wiped and ready",
        lambda: rack.json("machines", "show", gone)["state"] == "ready",
        READY_TIMEOUT_S,
        rack,
    )
    t_release = time.monotonic() - t1
    print(
        f"\nclaims -> 3 nodes active in their tenants' clusters: {t_active:.1f} s; "
        f"release one -> wiped and ready: {t_release:.1f} s"
    )
