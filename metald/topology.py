"""Where machines sit in the fabric: NVLink domains (from their GPUs), InfiniBand leaves (from
the fabric's ``ibnetdiscover`` matched with their port GUIDs), racks and power domains.

Owns the ``ib_links`` table and the ``Machine.ib_leaf`` column; ``nvlink_domain`` and
``nvlink_ready`` are written with the inventory (``metald.enrollment``). Reads here build the
fleet views (a domain and its members) and one machine's topology. docs/inventory.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from sqlmodel import Session, col, delete, select

from metald.inventory.ibnet import Link, leaf_name
from metald.lifecycle import State
from metald.store.models import IbLink, Machine, utcnow

_GUID = re.compile(r"^(0x)?([0-9a-fA-F]{16})$")


def normalise_guid(raw: object) -> str | None:
    """``0x`` and 16 lower-case hex digits, or None for anything else (colon forms too)."""
    m = _GUID.match(raw.replace(":", "").strip()) if isinstance(raw, str) else None
    return "0x" + m.group(2).lower() if m else None


def _ports(inventory: dict[str, Any] | None) -> list[Any]:
    inv = inventory or {}
    normalized = inv.get("normalized")
    ports = normalized.get("infiniband") if isinstance(normalized, dict) else None
    if not ports:
        ports = inv.get("infiniband")  # a document written by hand (tests, imports)
    return ports if isinstance(ports, list) else []


def port_guids(inventory: dict[str, Any] | None) -> list[str]:
    """InfiniBand port GUIDs an inventory lists, each once, in order; malformed ones are
    skipped (an agent's word is not trusted as syntax)."""
    out: list[str] = []
    for p in _ports(inventory):
        guid = normalise_guid(p.get("port_guid", "")) if isinstance(p, dict) else None
        if guid and guid not in out:
            out.append(guid)
    return out


def leaf_for(links: dict[str, IbLink], guids: Iterable[str]) -> str | None:
    """The leaf of a machine's ports: one switch's name, or the switches of a rail-optimised
    machine (one port per rail leaf) joined with '+', so machines cabled alike share it."""
    leaves = sorted(
        {
            leaf_name(Link(lk.port_guid, lk.switch_guid, lk.switch_name, lk.switch_port or 0))
            for g in guids
            if (lk := links.get(g)) is not None
        }
    )
    return "+".join(leaves) if leaves else None


def leaf_of(session: Session, guids: list[str]) -> str | None:
    if not guids:
        return None
    rows = session.exec(select(IbLink).where(col(IbLink.port_guid).in_(guids))).all()
    return leaf_for({r.port_guid: r for r in rows}, guids)


def replace_links(session: Session, links: list[Link]) -> dict[str, Any]:
    """Replace the fabric's links with ``links`` and set every machine's ``ib_leaf`` from them
    (not committed). Returns what matched: leaves with their machines, ports no machine
    lists."""
    session.exec(delete(IbLink))  # type: ignore[call-overload]
    now = utcnow()
    by_guid: dict[str, IbLink] = {}
    for lk in links:
        by_guid[lk.port_guid] = IbLink(
            port_guid=lk.port_guid,
            switch_guid=lk.switch_guid,
            switch_name=lk.switch_name,
            switch_port=lk.switch_port,
            updated_at=now,
        )
    session.add_all(by_guid.values())
    leaves: dict[str, list[str]] = {}
    matched: set[str] = set()
    changed = 0
    for m in session.exec(select(Machine).where(Machine.state != State.RETIRED.value)).all():
        guids = port_guids(m.inventory)
        matched.update(g for g in guids if g in by_guid)
        leaf = leaf_for(by_guid, guids)
        if leaf:
            leaves.setdefault(leaf, []).append(m.name or m.id)
        if leaf != m.ib_leaf:
            m.ib_leaf = leaf
            m.version += 1
            session.add(m)
            changed += 1
    return {
        "links": len(by_guid),
        "switches": len({lk.switch_guid for lk in by_guid.values()}),
        "machines_changed": changed,
        "leaves": [{"leaf": k, "machines": sorted(v)} for k, v in sorted(leaves.items())],
        "unmatched_ports": sorted(set(by_guid) - matched),
    }


def ib_leaves(session: Session) -> list[dict[str, Any]]:
    rows = session.exec(
        select(Machine.id, Machine.name, Machine.ib_leaf, Machine.state, Machine.tenant_id).where(
            col(Machine.ib_leaf).is_not(None), Machine.state != State.RETIRED.value
        )
    ).all()
    out: dict[str, list[dict[str, Any]]] = {}
    for mid, name, leaf, state, tenant in rows:
        out.setdefault(leaf, []).append(_member(mid, name, state, tenant))
    return [_group("leaf", k, v) for k, v in sorted(out.items())]


def _member(mid: str, name: str | None, state: str, tenant: str | None) -> dict[str, Any]:
    return {"machine_id": mid, "name": name, "state": state, "tenant_id": tenant}


def _group(key: str, value: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    members.sort(key=lambda x: (x.get("slot_number") or 0, x["name"] or "", x["machine_id"]))
    free = sum(1 for x in members if x["state"] == State.READY.value and not x["tenant_id"])
    return {key: value, "size": len(members), "free": free, "members": members}


def nvlink_domains(session: Session) -> list[dict[str, Any]]:
    """Every NVLink domain with its members (tray slot, rack, leaf, power domain, fabric
    health) and how many are free (ready, no tenant, registered in the domain)."""
    rows = session.exec(
        select(Machine).where(
            col(Machine.nvlink_domain).is_not(None), Machine.state != State.RETIRED.value
        )
    ).all()
    out: dict[str, list[dict[str, Any]]] = {}
    for m in rows:
        nv = nvlink_facts(m)
        member = {
            **_member(m.id, m.name, m.state, m.tenant_id),
            "nvlink_ready": m.nvlink_ready,
            "problems": nv.get("problems", []),
            "slot_number": nv.get("slot_number"),
            "chassis_serial": nv.get("chassis_serial"),
            "rack": m.rack,
            "ib_leaf": m.ib_leaf,
            "power_domain": m.power_domain,
        }
        out.setdefault(m.nvlink_domain or "", []).append(member)
    domains = []
    for d, members in sorted(out.items()):
        g = _group("domain", d, members)
        g["free"] = sum(
            1
            for x in members
            if x["state"] == State.READY.value and not x["tenant_id"] and x["nvlink_ready"]
        )
        uuid, _, clique = d.rpartition(".")
        g.update(
            cluster_uuid=uuid,
            clique_id=int(clique) if clique.isdigit() else None,
            racks=sorted({x["rack"] for x in members if x["rack"]}),
            chassis=sorted({x["chassis_serial"] for x in members if x["chassis_serial"]}),
            degraded=sorted(x["name"] or x["machine_id"] for x in members if x["problems"]),
        )
        domains.append(g)
    return domains


def nvlink_facts(m: Machine) -> dict[str, Any]:
    """The NVLink summary of the stored inventory (without the per-GPU list)."""
    normalized = (m.inventory or {}).get("normalized") or {}
    nv = normalized.get("nvlink") if isinstance(normalized, dict) else None
    return {k: v for k, v in nv.items() if k != "gpus"} if isinstance(nv, dict) else {}


def machine_topology(session: Session, m: Machine) -> dict[str, Any]:
    """One machine's place: NVLink domain and fabric state per GPU, InfiniBand ports with
    their switch, rack and power domain."""
    guids = port_guids(m.inventory)
    links = {
        r.port_guid: r
        for r in session.exec(select(IbLink).where(col(IbLink.port_guid).in_(guids))).all()
    }
    ports = []
    for p in _ports(m.inventory):
        if not isinstance(p, dict):
            continue
        g = normalise_guid(p.get("port_guid", ""))
        lk = links.get(g or "")
        ports.append(
            {
                "device": p.get("device"),
                "port": p.get("port"),
                "port_guid": g,
                "link_layer": p.get("link_layer"),
                "state": p.get("state"),
                "rate": p.get("rate"),
                "switch_guid": lk.switch_guid if lk else None,
                "switch_name": lk.switch_name if lk else None,
                "switch_port": lk.switch_port if lk else None,
            }
        )
    normalized = (m.inventory or {}).get("normalized") or {}
    nv = normalized.get("nvlink") if isinstance(normalized, dict) else None
    return {
        "machine_id": m.id,
        "name": m.name,
        "rack": m.rack,
        "power_domain": m.power_domain,
        "nvlink_domain": m.nvlink_domain,
        "nvlink_ready": m.nvlink_ready,
        "nvlink": nv if isinstance(nv, dict) else None,
        # the link matrix: which GPUs NVLink joins and with how many links, each GPU's links
        "nvlink_links": (normalized.get("nvlink_links") if isinstance(normalized, dict) else None),
        "ib_leaf": m.ib_leaf,
        "infiniband": ports,
    }
