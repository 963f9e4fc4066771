"""``metalctl machines``: list, show, register, label, and the technician's actions."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from metald.lifecycle import HANDOFF, TIMEOUTS, State
from metald.units import disk_size, mib

from . import attestation, bmc, bulk, commissioning, console, repairs, topology
from .client import Client
from .names import shown, tenant_names
from .options import POWER_ACTIONS, Subparsers, UsageError, confirm, key_values, machine_ref
from .output import emit, emit_table
from .progress import Progress

#: Names first (every command takes the name); the id prefix is enough to name one too.
COLUMNS = [
    ("NAME", "name_s"),
    ("STATE", "state"),
    ("GPUS", "gpus"),
    ("MEMORY", "mem"),
    ("RACK", "rack"),
    ("LABELS", "labels_s"),
    ("TENANT", "tenant"),
    ("ID", "short_id"),
    ("WHY", "why"),
]
#: States a machine is held in for a reason someone gave (or a failure): WHY shows it.
HELD = frozenset({"maintenance", "broken", "repairing", "retired", "attestation-failed"})
SHOW_FIELDS = (
    "id",
    "name",
    "state",
    "version",
    "rack",
    "rack_position",
    "power_domain",
    "nvlink_domain",
    "nvlink_ready",
    "ib_leaf",
    "firmware",
    "arch",
    "vendor",
    "product",
    "serial",
    "system_uuid",
    "cpu_model",
    "cpu_count",
    "memory_mb",
    "gpu_model",
    "gpu_count",
    "power_state",
    "tenant_id",
    "state_reason",
    "last_error",
)
#: Actions that take machines out of service (asked about when run on several at once).
DISRUPTIVE_ACTIONS = frozenset({"maintenance-on", "mark-broken", "retire", "inspect"})
ACTIONS = ("inspect", "maintenance-on", "maintenance-off", "mark-broken", "repair", "retire")
ACTION_HELP = {
    "inspect": "boot the discovery image again to refresh the inventory",
    "maintenance-on": "take machines out of service (--reason says why)",
    "maintenance-off": "put machines back in service",
    "mark-broken": "mark machines broken (the repair queue takes them)",
    "repair": "take broken machines into maintenance for a technician to work on",
    "retire": "retire machines for good (--reason required)",
}
STEP_HELP = {
    "retry": "start a failed operation again (inspect, provision or wipe)",
    "wipe": "wipe a machine's disks (from releasing, wipe-failed, maintenance, repairing)",
    "confirm-wipe": "declare a machine's disks wiped by hand (--reason required)",
}
LIST_FILTERS = ("gpu_model", "gpu_count", "min_gpu_count", "rack", "arch", "limit", "offset")


def register(sub: Subparsers) -> None:
    m = sub.add_parser("machines", help="list, show, register, label and act on machines")
    msub = m.add_subparsers(dest="sub", required=True)
    ml = msub.add_parser("list", help="the machines, filtered by state, labels, GPUs, rack")
    ml.add_argument(
        "--state", action="append", default=[], choices=[s.value for s in State], metavar="STATE"
    )
    ml.add_argument("--label", action="append", default=[], help="key=value")
    ml.add_argument(
        "--selector", "-l", help="key=value[,key=value...]: machines with all these labels"
    )
    ml.add_argument("--gpu-model", dest="gpu_model")
    ml.add_argument("--gpu-count", dest="gpu_count", type=int)
    ml.add_argument("--min-gpu-count", dest="min_gpu_count", type=int)
    ml.add_argument("--rack")
    ml.add_argument("--arch", choices=("amd64", "arm64"), help="CPU architecture")
    ml.add_argument("--limit", type=int)
    ml.add_argument("--offset", type=int)
    ml.set_defaults(func=list_machines)
    ms = msub.add_parser("show", help="one machine in detail")
    machine_ref(ms.add_argument("id", help="id, name or id prefix"))
    ms.set_defaults(func=show)
    mt = msub.add_parser(
        "topology", help="its NVLink domain, link matrix, InfiniBand ports, rack and power domain"
    )
    machine_ref(mt.add_argument("id", help="id, name or id prefix"))
    mt.set_defaults(func=topology.machine_topology)
    mr = msub.add_parser("register", help="register a machine by its MAC(s) before it boots")
    mr.add_argument("--mac", action="append", required=True)
    mr.add_argument("--name")
    mr.add_argument("--label", action="append", default=[])
    mr.set_defaults(func=register_machine)
    mlab = msub.add_parser(
        "label", help="key=value sets, key- removes; rack=r07 sets the machine's rack"
    )
    machine_ref(mlab.add_argument("id", help="id, name or id prefix"))
    mlab.add_argument("labels", nargs="+")
    mlab.set_defaults(func=label)
    for action in ACTIONS:
        pa = msub.add_parser(action, help=ACTION_HELP[action])
        machine_ref(pa.add_argument("id", nargs="*", help="ids, names or id prefixes"))
        pa.add_argument("--selector", "-l", help="every machine matching key=value[,...]")
        pa.add_argument("--reason", required=action == "retire")
        pa.add_argument("--wait", action="store_true", help="until each has settled")
        pa.add_argument("--timeout", type=float, default=1800.0, help="seconds --wait waits")
        pa.set_defaults(func=act)
    pw = msub.add_parser("power", help="power action on named machines or a --selector")
    pw.add_argument("action", choices=POWER_ACTIONS)
    machine_ref(pw.add_argument("id", nargs="*", help="ids, names or id prefixes"))
    pw.add_argument("--selector", "-l", help="every machine matching key=value[,...]")
    pw.add_argument("--wait", action="store_true", help="until each reports the new state")
    pw.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits at most")
    pw.set_defaults(func=bmc.power_many)
    for step, needs_reason in (("retry", False), ("wipe", False), ("confirm-wipe", True)):
        ps = msub.add_parser(step, help=STEP_HELP[step])
        ps.add_argument("id", help="id, name or id prefix")
        ps.add_argument("--reason", required=needs_reason)
        ps.set_defaults(func=workflow_step)
    jt = msub.add_parser("join-token", help="a one-time token for the node to join its tenant")
    machine_ref(jt.add_argument("id", help="id, name or id prefix"))
    jt.add_argument("--ttl", type=int, default=1800, help="seconds it stays valid (60-86400)")
    jt.set_defaults(func=join_token)
    mp = msub.add_parser("peer-revoke", help="take the machine off its tenant's hub")
    machine_ref(mp.add_argument("id", help="id, name or id prefix"))
    mp.set_defaults(func=revoke_peer)
    mn = msub.add_parser("rename", help="give a machine a new (unique) name")
    machine_ref(mn.add_argument("id", help="id, name or id prefix"))
    mn.add_argument("name")
    mn.set_defaults(func=rename)
    commissioning.register(msub)
    attestation.register(msub)
    repairs.register(msub)
    console.add_to(msub)


def row(m: dict[str, Any]) -> dict[str, Any]:
    r = dict(m)
    r["name_s"] = m.get("name") or "-"
    r["short_id"] = m["id"][:8]
    r["gpus"] = f"{m['gpu_count']}x {m['gpu_model']}" if m.get("gpu_count") else "-"
    r["mem"] = mib(m.get("memory_mb")) or None
    r["labels_s"] = ",".join(f"{k}={v}" for k, v in sorted((m.get("labels") or {}).items()))
    held = m.get("state") in HELD or str(m.get("state", "")).endswith("-failed")
    r["why"] = m.get("last_error") or (m.get("state_reason") if held else None) or ""
    return r


def list_machines(args: argparse.Namespace, c: Client) -> None:
    labels = list(args.label)
    if args.selector:
        labels += [p.strip() for p in args.selector.split(",") if p.strip()]
    for lb in labels:
        if "=" not in lb:
            raise UsageError(f"label {lb!r} must be key=value")
    q = [("state", s) for s in args.state] + [("label", lb) for lb in labels]
    for key in LIST_FILTERS:
        if getattr(args, key) is not None:
            q.append((key, str(getattr(args, key))))
    page = c.call("GET", "/api/v1/machines", query=q)
    tenants = tenant_names(c, (m.get("tenant_id") for m in page["items"]))
    emit_table(
        args,
        page,
        COLUMNS,
        row=lambda m: dict(row(m), tenant=shown(tenants, m.get("tenant_id"))),
        footer=lambda p: f"({len(p['items'])} of {p['total']})",
    )


def _details(m: dict[str, Any]) -> str:
    lines = [f"{k + ':':15} {'' if m.get(k) is None else m[k]}" for k in SHOW_FIELDS]
    labels = ", ".join(f"{k}={v}" for k, v in sorted(m["labels"].items()))
    nics = ", ".join(n["mac"] + (" (pxe)" if n["pxe"] else "") for n in m["nics"])
    disks = ((m.get("inventory") or {}).get("normalized") or {}).get("disks") or []
    lines += [
        f"{'memory:':15} {mib(m.get('memory_mb'))}",
        f"{'disks:':15} "
        + ", ".join(f"{d.get('name')} {disk_size(d.get('size_bytes'))}" for d in disks),
        f"{'labels:':15} {labels}",
        f"{'nics:':15} {nics}",
        f"{'actions:':15} {', '.join(m['allowed_actions'])}",
    ]
    return "\n".join(lines)


def show(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.call("GET", f"/api/v1/machines/{args.id}"), _details)


def register_machine(args: argparse.Namespace, c: Client) -> None:
    body: dict[str, Any] = {"macs": args.mac}
    if args.name:
        body["name"] = args.name
    if args.label:
        body["labels"] = key_values(args.label)
    m = c.call("POST", "/api/v1/machines", body)
    emit(args, m, lambda m: f"registered {m['name'] or m['id']} ({m['id'][:8]}, {m['state']})")


def label(args: argparse.Namespace, c: Client) -> None:
    """Labels, and ``rack=r07`` / ``power_domain=feed-a`` (``-`` to clear): the machine's rack
    and power domain fields (what claims match and spread over); they are never labels."""
    patch = key_values(args.labels)
    m = None
    fields = {k: patch.pop(k) for k in ("rack", "power_domain") if k in patch}
    if fields:
        m = c.call("PATCH", f"/api/v1/machines/{args.id}", fields)
    if patch or m is None:
        m = c.call("PATCH", f"/api/v1/machines/{args.id}/labels", {"labels": patch})
    emit(
        args,
        m,
        lambda m: (
            f"{m['name'] or m['id']}: "
            + ",".join(f"{k}={v}" for k, v in sorted(m["labels"].items()))
            + (f" (rack {m['rack']})" if m.get("rack") else "")
        ),
    )


def workflow_step(args: argparse.Namespace, c: Client) -> None:
    if args.sub in ("wipe", "confirm-wipe"):
        confirm(args, f"{args.sub} machine {args.id} (its disks are erased or declared erased)")
    body = {"reason": args.reason} if args.reason else {}
    m = c.call("POST", f"/api/v1/machines/{args.id}/{args.sub}", body)
    emit(args, m, lambda m: f"{m['name'] or m['id']}: {m['state']}")


def join_token(args: argparse.Namespace, c: Client) -> None:
    t = c.call("POST", f"/api/v1/machines/{args.id}/join-token", {"ttl_seconds": args.ttl})
    emit(args, t, lambda t: f"{t['token']}\n(valid until {t['expires_at']}; shown only now)")


def revoke_peer(args: argparse.Namespace, c: Client) -> None:
    confirm(args, f"take machine {args.id} off its tenant's hub")
    p = c.call("DELETE", f"/api/v1/machines/{args.id}/peer")
    emit(args, p, lambda p: f"{args.id}: off the hub")


def rename(args: argparse.Namespace, c: Client) -> None:
    m = c.call("PATCH", f"/api/v1/machines/{args.id}", {"name": args.name})
    emit(args, m, lambda m: f"{m['id'][:8]}: named {m['name']}")


#: States a machine leaves on its own (an operation under way, or a hand-off): ``--wait``
#: waits until it is in none of them.
MOVING = frozenset(s.value for s in (*TIMEOUTS, *HANDOFF))
WAIT_INTERVAL_S = 2.0


def wait_settled(c: Client, states: dict[str, str], timeout: float) -> dict[str, str]:
    """Poll each machine (id to its last state) until none is moving or ``timeout`` passes;
    progress redrawn in place on a terminal. The last states."""
    frames = Progress(sys.stderr)
    names: dict[str, str] = {}
    started = time.monotonic()
    while True:
        moving = [i for i, s in states.items() if s in MOVING]
        elapsed = time.monotonic() - started
        frames.show(
            f"{len(states) - len(moving)}/{len(states)} settled ({elapsed:.0f} s)"
            + "".join(f"\n  {names.get(i, i[:8])}: {states[i]}" for i in moving[:10])
        )
        if not moving or elapsed >= timeout:
            return states
        time.sleep(WAIT_INTERVAL_S)
        for i in moving:
            m = c.call("GET", f"/api/v1/machines/{i}")
            names[i] = m.get("name") or i[:8]
            states[i] = m["state"]


def act(args: argparse.Namespace, c: Client) -> int | None:
    """One named machine: its new state. Several, or a --selector: confirm the lot when the
    action is disruptive, act on each, a line per machine, exit 1 if any failed. ``--wait``:
    then until each has settled (a state it does not leave on its own); ending in a failed
    state, or still moving at --timeout, is a failure."""
    body = {"action": args.sub}
    if args.reason:
        body["reason"] = args.reason
    single = len(args.id) == 1 and not args.selector
    if single and args.sub == "retire":
        confirm(args, f"retire machine {args.id[0]} (it never boots from metald again)")
    if single and not args.wait:
        m = c.call("POST", f"/api/v1/machines/{args.id[0]}/actions", body)
        emit(args, m, lambda m: f"{m['name'] or m['id']}: {m['state']}")
        return None
    machines = bulk.select(c, args.id, args.selector)
    if not single and args.sub in DISRUPTIVE_ACTIONS:
        bulk.confirm_many(args, args.sub, machines)
    states: dict[str, str] = {}

    def one(m: dict[str, Any]) -> str:
        states[m["id"]] = c.call("POST", f"/api/v1/machines/{m['id']}/actions", body)["state"]
        return states[m["id"]]

    results = bulk.apply(machines, one)
    if args.wait:
        states = wait_settled(c, states, args.timeout)
        for r in results:
            if r["result"] != "ok":
                continue
            state = states[r["id"]]
            r["detail"] = state
            if state in MOVING:
                r.update(result="failed", detail=f"still {state} after {args.timeout:g} s")
            elif state.endswith("-failed"):
                r["result"] = "failed"
    return bulk.report(args, results)
