"""The data-plane fabric of a tenant: what a subnet manager or switch automation needs.

metald configures no switch and runs no subnet manager. It allocates, per tenant, a VLAN id
(Ethernet/RoCE) and an InfiniBand partition key (PKey, 0x0001-0x7ffe, unique while held), and
emits them with each claim's events together with the machines' switch ports, MACs and
InfiniBand port GUIDs (from their inventory, when it lists any). ``partitions_conf`` renders
the tenant's partition as an OpenSM ``partitions.conf`` fragment. Pure, but for ``describe``.
"""

from __future__ import annotations

import re
from typing import Any

from sqlmodel import Session, col, select

from metald import topology
from metald.errors import Conflict, NotFound
from metald.store.models import Machine, Tenant
from metald.tenants import ipam

_NAME_OK = re.compile(r"[^A-Za-z0-9_.-]")

#: Kept here for the tenants' callers: the port GUIDs live with the topology now.
normalise_guid = topology.normalise_guid
port_guids = topology.port_guids


def partition_name(tenant_name: str, pkey: int) -> str:
    """OpenSM partition names are bare words: the tenant's name with anything else as '_'."""
    return (_NAME_OK.sub("_", tenant_name) or "tenant")[:48] + f"_{pkey:04x}"


def partitions_conf(
    tenant_name: str, pkey: int, vlan: int | None, members: dict[str, list[str]]
) -> str:
    """An OpenSM partitions.conf fragment: the tenant's partition with its machines' ports as
    full members, IPoIB enabled; ``members`` maps machine id -> port GUIDs."""
    if not ipam.PKEY_RANGE[0] <= pkey <= ipam.PKEY_RANGE[1]:
        raise ValueError(f"PKey {pkey:#06x} is outside 0x0001-0x7ffe")
    guids = [g for gs in members.values() for g in gs]
    lines = [
        f"# metald tenant {tenant_name}: PKey {pkey:#06x}"
        + (f", VLAN {vlan}" if vlan is not None else "")
        + f", {len(members)} machine(s), {len(guids)} port(s)"
    ]
    for mid, gs in members.items():
        if not gs:
            lines.append(f"# machine {mid}: no InfiniBand port GUID in its inventory")
    body = ", ".join(f"{g}=full" for g in guids)
    lines.append(
        f"{partition_name(tenant_name, pkey)}={pkey:#06x}, ipoib, defmember=full"
        + (f" : {body} ;" if body else " : ;")
    )
    return "\n".join(lines) + "\n"


def ensure_pkey(session: Session, tenant: Tenant) -> int:
    """The tenant's PKey, allocated now if it predates PKeys (not committed)."""
    if tenant.pkey is None:
        try:
            tenant.pkey = ipam.allocate_pkey(session.exec(select(Tenant.pkey)).all())
        except ipam.IpamExhausted as e:
            raise Conflict(str(e)) from None
        session.add(tenant)
    return tenant.pkey


def describe(session: Session, tenant_id: str) -> dict[str, Any]:
    """The tenant's fabric: VLAN, PKey, each machine it holds with its port GUIDs, and the
    OpenSM fragment. Allocates a missing PKey and commits it."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"no tenant with id {tenant_id!r}")
    if tenant.pkey is None:
        ensure_pkey(session, tenant)
        session.commit()
    assert tenant.pkey is not None
    ms = session.exec(
        select(Machine).where(Machine.tenant_id == tenant_id).order_by(col(Machine.id))
    ).all()
    members = {m.id: port_guids(m.inventory) for m in ms}
    return {
        "tenant_id": tenant.id,
        "vlan": tenant.vlan,
        "pkey": tenant.pkey,
        "pkey_hex": f"{tenant.pkey:#06x}",
        "machines": [{"machine_id": mid, "port_guids": gs} for mid, gs in members.items()],
        "partitions_conf": partitions_conf(tenant.name, tenant.pkey, tenant.vlan, members),
    }
