"""The tenant's OS on its claimed machines, as the store keeps it: user-data (write-only: only
the machine's own agent token reads it back), static addresses from metald's pools (allocated
with the claim, released with the machine) and the storage layout checked per machine.

The decisions are ``metald.provision.userdata``, ``.netplan`` and ``.storage``'s."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, delete, select

from metald.errors import Unprocessable
from metald.machines import ConcurrentUpdate
from metald.provision import netplan, storage, userdata
from metald.store.models import Claim, ClaimUserData, IpAllocation, Machine, Nic

#: meta-data keys metald sets itself; a tenant's meta_data may not replace them.
RESERVED_META = ("instance-id", "local-hostname")


@dataclass(frozen=True)
class TenantOs:
    """[provision] settings the tenant-OS parts need."""

    schema_path: str = userdata.DEBIAN_SCHEMA
    max_bytes: int = userdata.MAX_BYTES
    pools: Mapping[str, netplan.Pool] = field(default_factory=dict)

    @classmethod
    def from_config(cls, provision: Any) -> TenantOs:
        pools = {
            name: netplan.Pool(
                name,
                p.cidr,
                p.gateway,
                p.start,
                p.end,
                tuple(p.dns),
                tuple(p.search),
                p.mtu,
                p.vlan,
            )
            for name, p in provision.networks.items()
        }
        return cls(provision.cloud_config_schema, provision.user_data_max_bytes, pools)


@dataclass(frozen=True)
class OsRequest:
    """What a claim asks of the deployed OS besides its image (docs/tenant-os.md)."""

    user_data: str | None = None
    meta_data: Mapping[str, Any] = field(default_factory=dict)
    network: dict[str, Any] | None = None
    storage: dict[str, Any] | None = None
    settings: TenantOs = field(default_factory=TenantOs)


def check_user_data(settings: TenantOs, data: str | None, meta: Mapping[str, Any]) -> Any:
    """``userdata.Checked`` for the tenant's user-data (None for none), or 422 saying why."""
    bad = [k for k in meta if k in RESERVED_META]
    if bad:
        raise Unprocessable(
            f"meta_data may not set {', '.join(bad)}: metald sets them (the machine's id and "
            "name); leave them out"
        )
    if data is None:
        return None
    try:
        return userdata.check(data, max_bytes=settings.max_bytes, schema_path=settings.schema_path)
    except userdata.UserDataError as e:
        raise Unprocessable(str(e)) from None


def save_user_data(
    s: Session,
    claim_id: str,
    data: str | None,
    meta: Mapping[str, Any],
    checked: Any,
    machine_id: str | None = None,
) -> None:
    """Store (or replace) the claim's, or one machine's, user-data and meta-data."""
    s.exec(
        delete(ClaimUserData).where(
            col(ClaimUserData.claim_id) == claim_id, col(ClaimUserData.machine_id) == machine_id
        )
    )
    if data is None and not meta:
        return
    s.add(
        ClaimUserData(
            claim_id=claim_id,
            machine_id=machine_id,
            user_data=data,
            meta_data=dict(meta),
            sha256=checked.sha256 if checked else None,
            form=checked.form if checked else None,
        )
    )


def same_user_data(s: Session, claim_id: str, os: OsRequest) -> bool:
    """Whether a replayed claim request carries the user-data and meta-data the claim has."""
    row = s.exec(
        select(ClaimUserData).where(
            ClaimUserData.claim_id == claim_id, col(ClaimUserData.machine_id).is_(None)
        )
    ).first()
    if row is None:
        return os.user_data is None and not os.meta_data
    return row.user_data == os.user_data and row.meta_data == dict(os.meta_data)


def user_data_for(s: Session, claim_id: str, machine_id: str) -> ClaimUserData | None:
    """The machine's own user-data if it has one, else the claim's."""
    rows = s.exec(select(ClaimUserData).where(ClaimUserData.claim_id == claim_id)).all()
    own = [r for r in rows if r.machine_id == machine_id]
    common = [r for r in rows if r.machine_id is None]
    for r in own + common:
        return r
    return None


def user_data_summary(s: Session, claim_id: str) -> dict[str, Any] | None:
    """What a claim view shows of its user-data: form, size and digest, never the content."""
    rows = s.exec(select(ClaimUserData).where(ClaimUserData.claim_id == claim_id)).all()
    if not rows:
        return None
    common = next((r for r in rows if r.machine_id is None), None)
    return {
        "form": common.form if common else None,
        "sha256": common.sha256 if common else None,
        "size": len(common.user_data.encode()) if common and common.user_data else 0,
        "machines": sorted(r.machine_id for r in rows if r.machine_id),
    }


def _payload(m: Machine) -> dict[str, Any]:
    """The agent's inventory as stored (``metald.inventory.normalize``: under ``payload``)."""
    inv = m.inventory or {}
    return inv.get("payload") or inv


def _nics(s: Session, m: Machine) -> list[netplan.NicInfo]:
    pxe = s.exec(select(Nic).where(Nic.machine_id == m.id, col(Nic.pxe))).first()
    nics = netplan.nics_from_inventory(_payload(m), pxe.mac if pxe else None)
    if pxe and not any(n.mac == pxe.mac for n in nics):
        nics.append(netplan.NicInfo(pxe.name or "pxe0", pxe.mac, None, True))
    return nics


def _pool_lock(name: str) -> int:
    """The advisory lock key of one address pool (a 63-bit number from its name)."""
    return int.from_bytes(hashlib.sha256(b"metald-ipam:" + name.encode()).digest()[:8]) >> 1


def network_config(
    s: Session, settings: TenantOs, c: Claim, m: Machine, *, allocate: bool = False
) -> dict[str, Any]:
    """The machine's network-config; with ``allocate``, takes the addresses it lacks from the
    pools (first free, in address order; the primary key refuses a double hand-out)."""
    have = {
        (a.network, a.interface): a.address
        for a in s.exec(select(IpAllocation).where(IpAllocation.machine_id == m.id))
    }

    def take(pool_name: str, iface: str) -> str:
        if (pool_name, iface) in have:
            return have[(pool_name, iface)]
        if not allocate:
            raise Unprocessable(
                f"machine {m.id} has no address on {pool_name} for {iface}; release and claim "
                "it again"
            )
        pool = settings.pools[pool_name]
        if s.get_bind().dialect.name == "postgresql":
            # One allocation per pool at a time, to this transaction's end: concurrent claims
            # would otherwise all pick the same first free address and retry in lockstep.
            # (SQLite's write lock already serialises them.)
            s.exec(text("SELECT pg_advisory_xact_lock(:k)").bindparams(k=_pool_lock(pool_name)))  # type: ignore[call-overload]
        taken = set(s.exec(select(IpAllocation.address).where(IpAllocation.network == pool_name)))
        for addr in pool.candidates():
            if addr not in taken:
                s.add(
                    IpAllocation(
                        network=pool_name,
                        address=addr,
                        claim_id=c.id,
                        machine_id=m.id,
                        interface=iface,
                    )
                )
                try:
                    s.flush()
                except IntegrityError:
                    # Another claim took it a moment ago: the whole claim runs again.
                    raise ConcurrentUpdate(f"address {addr} on {pool_name} was taken") from None
                have[(pool_name, iface)] = addr
                return addr
        raise Unprocessable(
            f"network {pool_name} has no free address left ({pool.cidr}); release claims on it "
            "or widen the pool"
        )

    try:
        return netplan.render(c.network, _nics(s, m), settings.pools, take)
    except netplan.NetworkRequestError as e:
        raise Unprocessable(f"network for machine {m.id}: {e}") from None


def storage_plan(c: Claim, m: Machine) -> dict[str, Any] | None:
    """The disks the claim's layout uses on this machine, or 422 saying why it does not fit."""
    if not c.storage:
        return None
    try:
        return storage.plan(c.storage, storage.disks_from_inventory(_payload(m))).to_dict()
    except storage.LayoutError as e:
        raise Unprocessable(f"storage layout does not fit machine {m.id}: {e}") from None


def prepare(s: Session, settings: TenantOs, c: Claim, ms: list[Machine]) -> None:
    """At claim time, in the claim's transaction: every machine's layout fits and its
    addresses are taken (all or none: a 422 rolls the claim back)."""
    for m in ms:
        storage_plan(c, m)
        if c.network:
            network_config(s, settings, c, m, allocate=True)


def addresses(s: Session, claim_id: str) -> dict[str, list[dict[str, str]]]:
    """The claim's static addresses, by machine."""
    out: dict[str, list[dict[str, str]]] = {}
    for a in s.exec(
        select(IpAllocation)
        .where(IpAllocation.claim_id == claim_id)
        .order_by(col(IpAllocation.machine_id), col(IpAllocation.interface))
    ):
        out.setdefault(a.machine_id, []).append(
            {"network": a.network, "interface": a.interface, "address": a.address}
        )
    return out


def forget_user_data(s: Session, claim_id: str, machine_ids: list[str], ended: bool) -> None:
    """Released machines' own user-data, and the claim's once it ends, are erased (their
    digest and form stay): a tenant's secrets do not outlive what they were for."""
    for row in s.exec(select(ClaimUserData).where(ClaimUserData.claim_id == claim_id)):
        if ended or row.machine_id in machine_ids:
            row.user_data = None
            row.meta_data = {}
            s.add(row)


def release_addresses(s: Session, claim_id: str, machine_ids: list[str]) -> None:
    """The addresses of machines leaving the claim go back to their pools."""
    if machine_ids:
        s.exec(
            delete(IpAllocation).where(
                col(IpAllocation.claim_id) == claim_id,
                col(IpAllocation.machine_id).in_(machine_ids),
            )
        )
