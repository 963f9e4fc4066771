"""Two tenants' Slurm clusters in the virtual rack, through the real boot path.

Tenants alpha and beta each get a WireGuard hub and a Slurm control plane (slurmctld + munged)
that metald runs in the hub's namespace on the lab bridge. alpha claims 2 machines and beta 1,
with the tenant node image (stateless: iPXE loads it into RAM); each node fetches its join
token from metald, generates its WireGuard key, joins its tenant's hub with kernel WireGuard,
applies its underlay guard, and starts slurmd against its controller over the tunnel. metald
marks each active once the handshake is seen and slurmctld reports the node.

Then: sinfo and ``srun hostname`` on each cluster; alpha's two nodes become direct WireGuard
peers of each other (the mesh; beta's node gets none of alpha's), and a node-to-node TCP
transfer crosses the receiving node's underlay but not the hub's (kernel byte counters on the
hub's interface); a reachability matrix probed from every node (through srun: the nodes have
no other shell) shows each reaches only its own hub and control plane, its own tenant's nodes
over the overlay, plus metald's API (join, mesh and agent endpoints), and nothing else; claim
events carry each tenant's VLAN and PKey. Releasing one of alpha's machines takes it off the
other node's WireGuard peers and guard (acknowledged before the wipe's first BMC command), out
of alpha's cluster and off the hub, wipes it, and returns it to ready; the matrix still holds.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

from metald.provision.metadata import hostname
from metald.tenants import controlplane
from metald.tenants.runtime import ns_name
from tests import waiting
from tests.tenants.nslab import tcp_connects

pytestmark = [pytest.mark.lab, pytest.mark.root]

ACTIVE_TIMEOUT_S = 480
READY_TIMEOUT_S = 480

# busybox sh on the node: "host:port ok|no" per target (nc connects, or fails within 2 s),
# all targets at once (a dropped SYN costs its 2 s once, not once per target).
PROBE = (
    'for t in "$@"; do ('
    'if nc -w 2 "${t%:*}" "${t#*:}" </dev/null >/dev/null 2>&1; '
    'then echo "$t ok"; else echo "$t no"; fi) & done; wait'
)

# busybox sh on the node: "path status" per path of metald's API (the HTTP status, or none),
# all paths at once. The request's writer stays open a moment: aiohttp may drop a request
# half-closed early.
HTTP_PROBE = (
    'api=$1; shift; for p in "$@"; do ('
    's=$( (printf "GET %s HTTP/1.0\\r\\nHost: metald\\r\\n\\r\\n" "$p"; sleep 3) '
    '| nc -w 5 "${api%:*}" "${api#*:}" | head -n 1 | cut -d " " -f 2); '
    'echo "$p ${s:-none}") & done; wait'
)


def wait_for(what: str, fn, timeout: float, rack) -> float:  # type: ignore[no-untyped-def]
    """``tests.waiting.wait_for``; how long it took."""
    t0 = time.monotonic()
    waiting.wait_for(what, fn, timeout, every=2, explain=rack.diagnostics)
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


# busybox sh on two nodes (one srun, one task each): the receiver listens and prints how many
# bytes it got (its nc's stdin is a fifo this shell holds open: an nc whose stdin ends stops
# reading the connection); the sender sends XFER_BYTES of zeros to the receiver's overlay
# address, retrying until it listens.
XFER_BYTES = 320 * 65536
XFER = (
    'if [ "$(hostname)" = "$1" ]; then f=/tmp/xfer.$$; mkfifo $f; '
    "nc -l -p 5001 <$f | wc -c & exec 3>$f; wait; exec 3>&-; rm -f $f; else "
    "for i in 1 2 3 4 5 6 7 8 9 10; do "
    'dd if=/dev/zero bs=65536 count=320 2>/dev/null | nc -w 5 "$2" 5001 && exit 0; sleep 1; '
    "done; exit 1; fi"
)


def wg_peers(rack, tenant_id: str, node: str) -> set[str]:  # type: ignore[no-untyped-def]
    r = ctl_exec(rack, tenant_id, "srun", "-w", node, "wg", "show", "wg0", "peers")
    return set(r.stdout.split()) if r.returncode == 0 else {"?"}


def guard_sources(rack, tenant_id: str, node: str) -> str:  # type: ignore[no-untyped-def]
    r = ctl_exec(rack, tenant_id, "srun", "-w", node, "nft", "list", "set", "inet", "metald_guard", "wg_sources")  # fmt: skip
    return r.stdout


def node_rx(rack, tenant_id: str, node: str, ifname: str) -> int:  # type: ignore[no-untyped-def]
    r = ctl_exec(rack, tenant_id, "srun", "-w", node, "cat", f"/sys/class/net/{ifname}/statistics/rx_bytes")  # fmt: skip
    return int(r.stdout.strip())


def hub_rx(tenant_id: str) -> int:
    """Bytes received on the hub's underlay interface (in the hub's namespace)."""
    r = subprocess.run(
        ["ip", "-n", ns_name(tenant_id), "-j", "-s", "link", "show", "dev", "uh0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    import json

    return int(json.loads(r.stdout)[0]["stats64"]["rx"]["bytes"])


def underlay_if(rack, tenant_id: str, node: str) -> str:  # type: ignore[no-untyped-def]
    r = ctl_exec(rack, tenant_id, "srun", "-w", node, "ip", "-4", "-o", "addr", "show")
    for line in r.stdout.splitlines():
        parts = line.split()
        if parts[1] not in ("lo", "wg0"):
            return parts[1]
    raise AssertionError(f"no underlay interface on {node}: {r.stdout} {r.stderr}")


@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="two tenants' Slurm clusters booted in QEMU (~3 min): METALD_LAB_LONG=1; make test keeps tests/tenants/ (isolation in namespaces) and a QEMU node's join and srun over WireGuard (tests/bootassets/test_node_qemu.py)",
)
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

    # Claim events carry each tenant's VLAN and InfiniBand PKey for switch/fabric automation.
    events = [
        e for e in rack.json("events", "--limit", "1000")["items"] if e["kind"] == "claim.created"
    ]
    vlans = {e["data"]["claim_id"]: e["data"]["network"]["vlan"] for e in events}
    assert vlans[claim_a["id"]] == a["vlan"] and vlans[claim_b["id"]] == b["vlan"]
    pkeys = {e["data"]["claim_id"]: e["data"]["network"]["pkey"] for e in events}
    assert None not in (pkeys[claim_a["id"]], pkeys[claim_b["id"]])
    assert pkeys[claim_a["id"]] != pkeys[claim_b["id"]]

    # The mesh: alpha's nodes are direct WireGuard peers of each other, beta's node has only
    # its hub (never a key of alpha's).
    peer_rows = {n: rack.api("GET", f"/api/v1/tenants/{t['id']}/hub")[1]["peers"] for n, t in tenants.items()}  # fmt: skip
    key_of = {
        hostname(p["machine_id"], rack.json("machines", "show", p["machine_id"]).get("name")): p["public_key"]
        for rows in peer_rows.values()
        for p in rows
    }  # fmt: skip
    hub_key = {n: t["hub"]["public_key"] for n, t in tenants.items()}
    a1, a2 = sorted(nodes_a)
    (b1,) = nodes_b
    want_peers = {
        a1: {hub_key["alpha"], key_of[a2]},
        a2: {hub_key["alpha"], key_of[a1]},
        b1: {hub_key["beta"]},
    }
    node_tid = {a1: a["id"], a2: a["id"], b1: b["id"]}
    t_mesh = wait_for(
        "alpha's nodes to peer with each other",
        lambda: all(wg_peers(rack, node_tid[n], n) == want for n, want in want_peers.items()),
        60,
        rack,
    )
    # A node-to-node transfer goes straight between the nodes: the receiver's underlay sees it,
    # the hub's underlay interface does not (srun's own control traffic does cross the hub).
    overlay_of = {hostname(p["machine_id"], rack.json("machines", "show", p["machine_id"]).get("name")): p["address"] for p in peer_rows["alpha"]}  # fmt: skip
    a2_if = underlay_if(rack, a["id"], a2)
    hub0, a2_0 = hub_rx(a["id"]), node_rx(rack, a["id"], a2, a2_if)
    r = ctl_exec(rack, a["id"], "srun", "-N2", "-w", f"{a1},{a2}", "sh", "-c", XFER, "xfer", a2, overlay_of[a2], timeout=120)  # fmt: skip
    assert r.returncode == 0 and r.stdout.split() == [str(XFER_BYTES)], (r.stdout, r.stderr)
    through_hub, at_a2 = hub_rx(a["id"]) - hub0, node_rx(rack, a["id"], a2, a2_if) - a2_0
    print(
        f"\nnode-to-node {XFER_BYTES} B: receiver's underlay +{at_a2} B, hub's underlay +{through_hub} B"
    )
    assert at_a2 >= XFER_BYTES, at_a2
    assert through_hub < XFER_BYTES // 10, through_hub

    # Reachability, probed from every node.
    metald_api = f"{rack.state['boot_address']}:8080"

    def reachability(node_tenant: dict[str, str]) -> None:
        hub_ip = {n: t["hub"]["address"] for n, t in tenants.items()}
        hub_underlay = {n: t["hub"]["endpoint"].split(":")[0] for n, t in tenants.items()}
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
                    # Within a tenant, nodes reach each other over the mesh (srun steps need it).
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

    reachability({n: "alpha" for n in nodes_a} | {n: "beta" for n in nodes_b})

    # Release one of alpha's machines: out of alpha's cluster, off the hub, wiped, ready.
    gone = ids_a[0]
    peers_before = {p["machine_id"]: p for p in rack.api("GET", f"/api/v1/tenants/{a['id']}/hub")[1]["peers"]}  # fmt: skip
    assert set(peers_before) == set(ids_a)
    gone_node = hostname(gone, rack.json("machines", "show", gone).get("name"))
    kept = a2 if gone_node == a1 else a1
    gone_ip = underlay_ip(rack, a["id"], gone_node)
    assert gone_ip in guard_sources(rack, a["id"], kept)
    t1 = time.monotonic()
    rack.ctl("claims", "release", claim_a["id"], "--machine", gone, "--yes")
    # The release answered after the remaining node acknowledged the mesh without the released
    # one, and before the wipe's first BMC command (events are ordered by id).
    st, page = rack.api("GET", "/api/v1/events?kind=tenant.mesh.released&limit=1000")
    assert st == 200, page
    (released,) = [e for e in page["items"] if e["data"]["machines"] == [gone]]
    assert released["data"]["acknowledged"] is True and released["data"]["pending"] == []
    st, page = rack.api("GET", "/api/v1/events?kind=claim.machines.released&limit=1000")
    (commit,) = [e for e in page["items"] if e["data"]["machines"] == [gone]]
    assert commit["id"] < released["id"]

    def wipe_boot() -> list[dict[str, Any]]:
        return [
            e
            for e in rack.json("events", "--machine", gone, "--limit", "1000")["items"]
            if e["id"] > commit["id"] and e["kind"].startswith(("bmc.", "provision.network-boot"))
        ]

    wait_for("the wipe's network boot", lambda: bool(wipe_boot()), 120, rack)
    later = wipe_boot()
    assert later and all(e["id"] > released["id"] for e in later), later
    # On the node itself: the released machine is off its WireGuard peers and guard.
    assert wg_peers(rack, a["id"], kept) == {hub_key["alpha"]}
    assert gone_ip not in guard_sources(rack, a["id"], kept)
    hub_now = rack.api("GET", f"/api/v1/tenants/{a['id']}/hub")[1]
    assert [p["machine_id"] for p in hub_now["peers"]] == [ids_a[1]]
    wait_for("alpha's cluster to drop the node", lambda: len(sinfo(rack, a["id"])) == 1, 60, rack)
    assert rack.json("machines", "show", ids_a[1])["state"] == "active"
    assert ctl_exec(rack, a["id"], "srun", "-N1", "hostname").returncode == 0
    reachability({kept: "alpha", b1: "beta"})  # zero cross-tenant paths after the release too
    wait_for(
        "the released machine wiped and ready",
        lambda: rack.json("machines", "show", gone)["state"] == "ready",
        READY_TIMEOUT_S,
        rack,
    )
    t_release = time.monotonic() - t1
    print(
        f"\nclaims -> 3 nodes active in their tenants' clusters: {t_active:.1f} s; "
        f"release one -> wiped and ready: {t_release:.1f} s; mesh converged {t_mesh:.1f} s "
        f"after active; release acknowledged by the mesh in {released['data']['waited_ms']} ms"
    )
