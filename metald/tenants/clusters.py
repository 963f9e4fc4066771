"""Tenant clusters over the store: hubs, join tokens, joins and releases.

Database work only; each function works in the caller's session and says whether it commits.
Bringing hubs and peers up on the host is netconfig's job (see ``metald.tenants.hubs``): a join
commits first, then the caller applies the peer to the running hub.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from metald import machines
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import JOIN_STARTS, JOINABLE, State, Trigger
from metald.provision.metadata import hostname
from metald.secrets import SecretBox
from metald.store.models import Claim, Machine, Tenant, WgHub, WgPeer
from metald.tenants import ipam, keys, kubernetes, mesh, slurm, tokens

DEFAULT_LISTEN_PORT = 51820
PERSISTENT_KEEPALIVE = 25


@dataclass
class JoinResult:
    peer: WgPeer
    hub: WgHub
    prefix: str
    material: dict[str, Any]
    #: The node's mesh credential (returned once, stored hashed on the peer row).
    node_token: str = ""

    def response(self) -> dict[str, Any]:
        """What the node receives: everything it needs, no secret of anyone else's but the
        scheduler's shared join material."""
        plen = self.prefix.split("/")[1]
        return {
            "overlay_address": f"{self.peer.address}/{plen}",
            "hub": {
                "endpoint": self.hub.endpoint,
                "public_key": self.hub.public_key,
                "address": self.hub.address,
            },
            "allowed_ips": [self.prefix],
            "persistent_keepalive": PERSISTENT_KEEPALIVE,
            "cluster": self.material,
            "mesh": {
                "path": "/api/v1/mesh",
                "node_token": self.node_token,
                "listen_port": mesh.NODE_LISTEN_PORT,
            },
        }


def hub_ifname(tenant_id: str) -> str:
    """Unique host-wide (wireguard-go's control sockets are global), at most 15 characters."""
    return "mh" + tenant_id.replace("-", "")[:12]


def load_secrets(box: SecretBox, tenant: Tenant) -> dict[str, str]:
    return json.loads(box.decrypt(tenant.secrets_enc)) if tenant.secrets_enc else {}


def _scheduler_secrets(tenant: Tenant) -> dict[str, str]:
    if tenant.cluster_kind == "slurm":
        return {"munge_key": base64.b64encode(slurm.generate_munge_key()).decode()}
    if tenant.cluster_kind == "kubernetes":
        cert, key = kubernetes.generate_ca(f"{tenant.name}-kubernetes-ca")
        return {"ca_cert": cert, "ca_key": key}
    raise Unprocessable(f"unknown cluster kind {tenant.cluster_kind!r}")


def setup_hub(
    session: Session,
    box: SecretBox,
    tenant_id: str,
    *,
    endpoint_host: str,
    listen_port: int = DEFAULT_LISTEN_PORT,
    supernet: str = ipam.DEFAULT_SUPERNET,
    prefixlen: int = ipam.DEFAULT_PREFIXLEN,
    commit: bool = True,
) -> WgHub:
    """Give a tenant its hub (keys, overlay prefix, endpoint) and scheduler secrets."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"no tenant with id {tenant_id!r}")
    if session.exec(select(WgHub).where(WgHub.tenant_id == tenant_id)).first():
        raise Conflict(f"tenant {tenant.name!r} already has a hub")
    taken = [p for p in session.exec(select(Tenant.overlay_prefix)) if p]
    tenant.overlay_prefix = ipam.allocate_prefix(taken, supernet=supernet, prefixlen=prefixlen)
    stored = load_secrets(box, tenant)
    stored.update({k: v for k, v in _scheduler_secrets(tenant).items() if k not in stored})
    tenant.secrets_enc = box.encrypt(json.dumps(stored))
    private = keys.generate_private_key()
    hub = WgHub(
        tenant_id=tenant_id,
        ifname=hub_ifname(tenant_id),
        public_key=keys.public_key(private),
        private_key_enc=box.encrypt(private),
        endpoint=f"{endpoint_host}:{listen_port}",
        listen_port=listen_port,
        address=ipam.hub_address(tenant.overlay_prefix),
    )
    session.add(tenant)
    session.add(hub)
    if commit:
        try:
            session.commit()
        except IntegrityError:  # another tenant took the same prefix at the same moment
            session.rollback()
            raise Conflict("another hub was created at the same moment; try again") from None
    return hub


DEFAULT_VLAN_RANGE = (100, 3999)


def new_tenant(
    session: Session,
    *,
    name: str,
    cluster_kind: str,
    control_plane: str | None = None,
    vlan_range: tuple[int, int] = DEFAULT_VLAN_RANGE,
) -> Tenant:
    """Add a tenant with the lowest free VLAN id and InfiniBand PKey (flushed, not committed).
    A racing creation that took the same VLAN or PKey fails the commit on the unique index;
    the caller may retry."""
    taken = session.exec(select(Tenant.vlan)).all()
    try:
        vlan = ipam.allocate_vlan(taken, *vlan_range)
        pkey = ipam.allocate_pkey(session.exec(select(Tenant.pkey)).all())
    except ipam.IpamExhausted as e:
        raise Conflict(str(e)) from None
    tenant = Tenant(
        name=name, cluster_kind=cluster_kind, control_plane=control_plane, vlan=vlan, pkey=pkey
    )
    session.add(tenant)
    session.flush()
    return tenant


def add_tenant(
    session: Session,
    *,
    name: str,
    cluster_kind: str,
    control_plane: str | None,
    vlan_range: tuple[int, int],
    actor: str,
    instance: str | None = None,
) -> Tenant:
    """Add a tenant (``new_tenant``) with a ``tenant.created`` event, and commit. A taken name
    is 409; a name or VLAN committed by a concurrent request a moment ago is looked at again,
    up to five times."""
    for attempt in range(5):
        if session.exec(select(Tenant).where(Tenant.name == name)).first():
            raise Conflict(f"a tenant named {name!r} already exists")
        t = new_tenant(
            session,
            name=name,
            cluster_kind=cluster_kind,
            control_plane=control_plane,
            vlan_range=vlan_range,
        )
        machines.add_event(
            session,
            "tenant.created",
            actor,
            tenant_id=t.id,
            data={"name": t.name, "vlan": t.vlan},
            instance=instance,
        )
        try:
            session.commit()
        except IntegrityError:  # the same name or VLAN committed a moment ago: look again
            session.rollback()
            if attempt == 4:
                raise Conflict("tenants were created concurrently; try again") from None
            continue
        return t
    raise AssertionError("unreachable")


def hub_private_key(box: SecretBox, hub: WgHub) -> str:
    return box.decrypt(hub.private_key_enc)


def get_hub(session: Session, tenant_id: str) -> WgHub:
    hub = session.exec(select(WgHub).where(WgHub.tenant_id == tenant_id)).first()
    if hub is None:
        raise NotFound("this tenant has no WireGuard hub yet")
    return hub


def issue_join_token(
    session: Session,
    machine_id: str,
    *,
    actor: str,
    ttl: timedelta = tokens.DEFAULT_TTL,
    instance: str | None = None,
    supersede_peer: bool = False,
) -> tuple[str, datetime]:
    """A one-time token for the machine's first boot; returns (secret, expiry). Revokes the
    machine's unused older tokens. Commits.

    A machine already on its hub (a peer is stored) gets no token: a join never replaces an
    active peer, so a token would only be refused. ``supersede_peer`` is for metald itself,
    minting for a boot it serves (a RAM-booted node that rebooted has lost its key): the old
    peer is removed here, with an event, and the running hub drops it at its next sync."""
    m = machines.get_machine(session, machine_id)
    if m.tenant_id is None or State(m.state) not in JOINABLE:
        raise Conflict(
            f"machine {m.id} is {m.state} and belongs to no tenant's cluster; "
            "only a claimed machine can be given a join token"
        )
    get_hub_or_conflict(session, m.tenant_id)
    if active_peer(session, m.id) is not None:
        if not supersede_peer:
            raise Conflict(
                f"machine {m.id} is already on its tenant's hub; a join never replaces an "
                "active peer: release the machine (or let it reboot into metald) first"
            )
        remove_peer(session, m.id, actor=actor, instance=instance, reason="rebooted")
    tokens.revoke_for_machine(session, m.id)  # the newest token replaces unused older ones
    row, secret = tokens.issue(
        session, machine_id=m.id, tenant_id=m.tenant_id, ttl=ttl, created_by=actor
    )
    machines.add_event(
        session,
        "tenant.join_token.issued",
        actor,
        machine_id=m.id,
        tenant_id=m.tenant_id,
        data={"token_id": row.id, "expires_at": row.expires_at.isoformat()},
        instance=instance,
    )
    session.commit()
    return secret, row.expires_at


def get_hub_or_conflict(session: Session, tenant_id: str) -> WgHub:
    """``get_hub`` for a machine's tenant: a missing hub is a conflict, not an absence."""
    try:
        return get_hub(session, tenant_id)
    except NotFound:
        raise Conflict("the machine's tenant has no WireGuard hub; create it first") from None


def elastic_node(session: Session, m: Machine) -> str | None:
    """The elastic pool node name a machine was claimed for (its claim's idempotency key is
    ``elastic:<pool id>:<node>``, ``metald.usecases.elastic``), or None."""
    if m.claim_id is None:
        return None
    c = session.get(Claim, m.claim_id)
    parts = (c.idempotency_key or "").split(":") if c is not None else []
    return parts[2] if len(parts) == 3 and parts[0] == "elastic" else None


def node_name(session: Session, m: Machine) -> str:
    """The Slurm/Kubernetes node name a machine joins as: its elastic pool name, or its
    hostname."""
    return elastic_node(session, m) or hostname(m.id, m.name)


def _material(
    box: SecretBox,
    tenant: Tenant,
    hub: WgHub,
    m: Machine,
    address: str,
    session: Session | None = None,
) -> dict[str, Any]:
    stored = load_secrets(box, tenant)
    name = hostname(m.id, m.name)
    node = elastic_node(session, m) if session is not None else None
    if tenant.cluster_kind == "slurm" and node is not None:
        # An elastic pool's machine: the CLOUD node slurmctld resumed, under its name.
        return slurm.cloud_join_material(
            hub_address=hub.address,
            munge_key=base64.b64decode(stored["munge_key"]),
            node_name=node,
        )
    if tenant.cluster_kind == "slurm":
        features = [m.gpu_model] if m.gpu_model else []
        features += [f"{k}_{v}" for k, v in sorted(m.labels.items())]
        # Where it sits: on Slurm 22.05 dynamic nodes cannot be placed in topology.conf's
        # switches, so jobs pack with --constraint="[nvl_a|nvl_b]" (docs/claims.md).
        features += slurm.topology_features(m.nvlink_domain if m.nvlink_ready else None,
                                            m.ib_leaf, m.rack)  # fmt: skip
        return slurm.join_material(
            hub_address=hub.address,
            munge_key=base64.b64decode(stored["munge_key"]),
            node_name=name,
            gpu_count=m.gpu_count,
            gpu_type=None,
            features=features,
        )
    return kubernetes.join_material(
        control_plane=tenant.control_plane or hub.address,
        ca_cert_pem=stored["ca_cert"],
        node_name=name,
        node_ip=address,
        labels=dict(m.labels),
    )


def join(
    session: Session,
    box: SecretBox,
    secret: str,
    public_key: str,
    *,
    now: datetime | None = None,
    instance: str | None = None,
    registered_from: str | None = None,
) -> JoinResult:
    """Burn the token, record the peer (with the underlay address the join came from, its
    first mesh endpoint) and a fresh node token, bump the tenant's mesh generation, and build
    the node's join material. Commits once."""
    try:
        public_key = keys.validate_public_key(public_key)
    except (keys.BadKey, ValueError) as e:
        raise Unprocessable(f"public_key: {e}") from None
    token = tokens.burn(session, secret, now=now)
    m = machines.get_machine(session, token.machine_id)
    if m.tenant_id != token.tenant_id:
        session.rollback()
        raise Conflict("the machine no longer belongs to the tenant this token was issued for")
    tenant = session.get(Tenant, token.tenant_id)
    assert tenant is not None and tenant.overlay_prefix is not None
    hub = get_hub_or_conflict(session, tenant.id)
    if active_peer(session, m.id) is not None:
        # Whoever holds this token cannot take over the node's place on the hub (and the
        # scheduler's secrets with it): metald removes a peer on release or when it serves the
        # machine a new boot, never on a join.
        session.rollback()
        raise Conflict(
            "this machine is already on its tenant's hub; a join never replaces an active "
            "peer (release the machine, or reboot it through metald for a fresh token)"
        )
    other = session.exec(select(WgPeer).where(WgPeer.public_key == public_key)).first()
    if other is not None:
        session.rollback()
        raise Conflict("this public key is already used by another node; generate a fresh one")
    node_token, token_hash = mesh.mint_node_token()
    peer = _add_peer(session, tenant, m.id, public_key, token_hash, registered_from)
    mesh.bump(session, tenant.id)
    material = _material(box, tenant, hub, m, peer.address, session)
    if State(m.state) in JOIN_STARTS:
        machines.transition(
            session, m.id, Trigger.JOIN, actor=f"node:{m.id}", instance=instance, commit=False
        )
    machines.add_event(
        session,
        "tenant.peer.added",
        f"node:{m.id}",
        machine_id=m.id,
        tenant_id=tenant.id,
        data={"address": peer.address, "public_key": public_key, "token_id": token.id},
        instance=instance,
    )
    session.commit()
    return JoinResult(peer, hub, tenant.overlay_prefix, material, node_token)


def active_peer(session: Session, machine_id: str) -> WgPeer | None:
    return session.exec(select(WgPeer).where(WgPeer.machine_id == machine_id)).first()


def _add_peer(
    session: Session,
    tenant: Tenant,
    machine_id: str,
    public_key: str,
    token_hash: str | None = None,
    registered_from: str | None = None,
) -> WgPeer:
    assert tenant.overlay_prefix is not None
    for _ in range(8):
        held = session.exec(select(WgPeer.address).where(WgPeer.tenant_id == tenant.id)).all()
        peer = WgPeer(
            tenant_id=tenant.id,
            machine_id=machine_id,
            public_key=public_key,
            address=ipam.allocate_address(tenant.overlay_prefix, held),
            node_token_hash=token_hash,
            registered_from=registered_from,
        )
        try:
            with session.begin_nested():  # a racing join took the address: pick the next one
                session.add(peer)
            return peer
        except IntegrityError:
            continue
    raise Conflict("could not allocate an overlay address; try again")


def remove_peer(
    session: Session,
    machine_id: str,
    *,
    actor: str = "metald",
    instance: str | None = None,
    reason: str = "released",
) -> WgPeer | None:
    """On release (or a new boot metald serves): drop the machine's peer (its node token with
    it), bump the tenant's mesh generation so every other node drops it too, and revoke its
    unused join tokens. Not committed; returns the removed peer so the caller can take it off
    the running hub after commit."""
    tokens.revoke_for_machine(session, machine_id)
    peer = session.exec(select(WgPeer).where(WgPeer.machine_id == machine_id)).first()
    if peer is None:
        return None
    session.delete(peer)
    mesh.bump(session, peer.tenant_id)
    machines.add_event(
        session,
        "tenant.peer.removed",
        actor,
        machine_id=machine_id,
        tenant_id=peer.tenant_id,
        data={"address": peer.address, "public_key": peer.public_key, "reason": reason},
        instance=instance,
    )
    return peer


def observe(
    session: Session,
    machine_id: str,
    *,
    handshake_at: datetime | None,
    scheduler_reports_node: bool,
    instance: str | None = None,
) -> Machine:
    """Record what the hub and scheduler see; a joining machine becomes active when both the
    WireGuard handshake and the scheduler's report of the node are there. Commits."""
    m = machines.get_machine(session, machine_id)
    peer = session.exec(select(WgPeer).where(WgPeer.machine_id == machine_id)).first()
    if peer is not None and handshake_at is not None:
        peer.last_handshake_at = handshake_at
        session.add(peer)
    if (
        State(m.state) is State.JOINING
        and peer is not None
        and handshake_at is not None
        and scheduler_reports_node
    ):
        return machines.transition(session, m.id, Trigger.JOINED, actor="metald", instance=instance)
    session.commit()
    return m


def peers(session: Session, tenant_id: str) -> list[WgPeer]:
    return list(
        session.exec(
            select(WgPeer).where(WgPeer.tenant_id == tenant_id).order_by(col(WgPeer.address))
        )
    )
