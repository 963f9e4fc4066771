"""A tenant's WireGuard mesh: every node of a tenant is a peer of every other node of it.

The hub stays every node's peer for the control plane and as the route of last resort (its
``allowed-ips`` is the tenant's whole prefix; each mesh peer's is its own /32, and WireGuard
routes by the longest match). What a node may know is its *mesh view*: its tenant's other
nodes (public key, /32, endpoint) and the underlay addresses its guard admits WireGuard from.

- **Credential.** At join metald mints a node token (``mnt_<random>``; only its sha256 is
  stored, on the node's peer row). It is the machine's own, opens nothing but its mesh view
  (``auth.authenticate`` refuses anything not ``mtd_``), and dies with the peer row: on
  release, on a revoke, or when metald serves the machine a fresh boot.
- **Generation.** Each tenant has a ``mesh_generation``, bumped in the same transaction as any
  change of its peers (join, removal, an endpoint the hub saw move). A node asks for its view
  with the generation it has applied (``applied``): that is its acknowledgement, stored on its
  peer row; the answer comes when the tenant's generation is newer, or after ``wait_s``.
- **Release.** After a release commits, ``await_acks`` waits until every remaining node that
  runs the mesh (one that ever fetched a view) has applied the generation that dropped the
  released machine, or a bounded timeout, and records which it was, before the machine is
  power-cycled into its wipe.

Store functions here work in the caller's session; the asyncio parts are ``MeshWatch`` (wakes
local long-polls and waiters) and ``await_acks``.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from metald import machines
from metald.errors import Unauthorized
from metald.service import wait_event
from metald.store import Store
from metald.store.models import Tenant, WgHub, WgPeer

TOKEN_PREFIX = "mnt_"
#: Every node's WireGuard listens here (the guard admits it from the tenant's peers only).
NODE_LISTEN_PORT = 51820
#: How long a release waits for the remaining nodes' acknowledgements before it wipes anyway.
RELEASE_ACK_TIMEOUT_S = 10.0
#: A long-poll also looks at the store this often: another metald instance may have changed
#: the tenant (this instance's ``MeshWatch`` only hears its own writes).
STORE_POLL_S = 1.0
MAX_WAIT_S = 30


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def mint_node_token() -> tuple[str, str]:
    """A new node token: (secret, its sha256 to store)."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return secret, hash_token(secret)


def bump(session: Session, tenant_id: str) -> None:
    """Next mesh generation, in the caller's transaction (one UPDATE: racing joins and
    releases of one tenant each get their own generation, never a lost increment)."""
    session.execute(
        update(Tenant)
        .where(col(Tenant.id) == tenant_id)
        .values(mesh_generation=col(Tenant.mesh_generation) + 1)
    )


def generation(session: Session, tenant_id: str) -> int:
    row = session.exec(select(Tenant.mesh_generation).where(Tenant.id == tenant_id)).first()
    return int(row or 0)


def endpoint_of(peer: WgPeer) -> str | None:
    """Where other nodes dial this one: where the hub last saw it, else the address it joined
    from at the nodes' listen port. Never what a node says about itself."""
    if peer.last_endpoint:
        return peer.last_endpoint
    if peer.registered_from:
        host = peer.registered_from
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
        return f"{host}:{NODE_LISTEN_PORT}"
    return None


def endpoint_host(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[0].strip("[]")


@dataclass
class MeshView:
    """What one node is told: its tenant's other nodes and its guard's WireGuard sources."""

    generation: int
    tenant_id: str
    machine_id: str
    address: str
    prefix: str
    hub: dict[str, Any]
    peers: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def response(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "address": self.address,
            "listen_port": NODE_LISTEN_PORT,
            "hub": self.hub,
            "peers": self.peers,
            "guard": {"wireguard_port": NODE_LISTEN_PORT, "sources": self.sources},
        }


def node_by_token(session: Session, secret: str) -> WgPeer:
    if not secret.startswith(TOKEN_PREFIX):
        raise Unauthorized("send this node's mesh token (mnt_...) as 'Authorization: Bearer'")
    peer = session.exec(select(WgPeer).where(WgPeer.node_token_hash == hash_token(secret))).first()
    if peer is None:
        raise Unauthorized(
            "this node token is unknown or revoked (the machine was released, or joined "
            "again with a new key); a node gets a new one when it joins"
        )
    return peer


def view(session: Session, me: WgPeer) -> MeshView:
    """The node's mesh view: only peers of its own tenant, never itself."""
    tenant = session.get(Tenant, me.tenant_id, populate_existing=True)
    hub = session.exec(select(WgHub).where(WgHub.tenant_id == me.tenant_id)).one()
    assert tenant is not None and tenant.overlay_prefix is not None
    others = session.exec(
        select(WgPeer)
        .where(WgPeer.tenant_id == me.tenant_id, WgPeer.id != me.id)
        .order_by(col(WgPeer.address))
    ).all()
    peers: list[dict[str, Any]] = []
    sources: set[str] = set()
    _add_source(sources, endpoint_host(hub.endpoint))
    for p in others:
        ep = endpoint_of(p)
        peers.append(
            {
                "public_key": p.public_key,
                "address": p.address,
                "allowed_ips": [f"{p.address}/32"],
                "endpoint": ep,
            }
        )
        if ep:
            _add_source(sources, endpoint_host(ep))
    return MeshView(
        generation=tenant.mesh_generation,
        tenant_id=tenant.id,
        machine_id=me.machine_id,
        address=me.address,
        prefix=tenant.overlay_prefix,
        hub={
            "public_key": hub.public_key,
            "endpoint": hub.endpoint,
            "address": hub.address,
            "allowed_ips": [tenant.overlay_prefix],
        },
        peers=peers,
        sources=sorted(sources, key=ipaddress.ip_address),
    )


def _add_source(sources: set[str], host: str) -> None:
    """The guard's set holds IPv4 addresses (a DNS name or IPv6 endpoint is dialled, but its
    replies get in as established traffic only)."""
    try:
        if ipaddress.ip_address(host).version == 4:
            sources.add(host)
    except ValueError:
        pass


def sync(session: Session, secret: str, applied: int) -> tuple[MeshView, bool]:
    """Authenticate the node, record ``applied`` as its acknowledgement, and return its view
    and whether its acknowledgement moved (so waiters are woken). Commits. A node cannot
    acknowledge a generation it was never given (``applied`` is capped at the tenant's).

    A node's first call marks it as holding a view (``mesh_acked`` 0) and commits that before
    the view is read: a release committed after the read waits for this node, and one
    committed before it is already missing from the view."""
    me = node_by_token(session, secret)
    moved = False
    held = me.mesh_acked
    if held is None:
        session.execute(update(WgPeer).where(col(WgPeer.id) == me.id).values(mesh_acked=0))
        session.commit()
        held, moved = 0, True
    v = view(session, me)
    acked = min(max(applied, 0), v.generation)
    if acked > held:
        session.execute(
            update(WgPeer)
            .where(col(WgPeer.id) == me.id, col(WgPeer.mesh_acked) < acked)
            .values(mesh_acked=acked)
        )
        session.commit()
        moved = True
    else:
        session.rollback()
    return v, moved


def view_for_token(session: Session, secret: str) -> MeshView:
    return view(session, node_by_token(session, secret))


def pending(session: Session, tenant_id: str, gen: int) -> list[str]:
    """Machines of the tenant running the mesh that have not applied ``gen`` yet."""
    return list(
        session.exec(
            select(WgPeer.machine_id).where(
                WgPeer.tenant_id == tenant_id,
                col(WgPeer.mesh_acked).is_not(None),
                col(WgPeer.mesh_acked) < gen,
            )
        ).all()
    )


class MeshWatch:
    """Wakes this instance's long-polls (a tenant's mesh changed) and release waiters (a node
    acknowledged). One per API process; cross-instance changes are seen by polling."""

    name = "tenant_mesh"

    def __init__(self) -> None:
        self._changed: dict[str, asyncio.Event] = {}
        self._acked: dict[str, asyncio.Event] = {}
        #: tenant -> (generation, when read): a tenant's idle long-polls share one read.
        self._generations: dict[str, tuple[int, float]] = {}

    @staticmethod
    def _fire(events: dict[str, asyncio.Event], tenant_id: str) -> None:
        ev = events.pop(tenant_id, None)
        if ev is not None:
            ev.set()

    def changed(self, tenant_id: str) -> None:
        self._generations.pop(tenant_id, None)
        self._fire(self._changed, tenant_id)

    async def generation(self, store: Store, tenant_id: str) -> int:
        """The tenant's generation, read from the store at most about once per
        ``STORE_POLL_S`` for all of its waiting nodes (a local change reads it afresh)."""
        cached = self._generations.get(tenant_id)
        now = time.monotonic()
        if cached is not None and now - cached[1] < STORE_POLL_S / 2:
            return cached[0]
        gen = await store.run(generation, tenant_id)
        self._generations[tenant_id] = (gen, now)
        return gen

    def acked(self, tenant_id: str) -> None:
        self._fire(self._acked, tenant_id)

    async def wait_changed(self, tenant_id: str, timeout: float) -> None:
        await _wait(self._changed.setdefault(tenant_id, asyncio.Event()), timeout)

    async def wait_acked(self, tenant_id: str, timeout: float) -> None:
        await _wait(self._acked.setdefault(tenant_id, asyncio.Event()), timeout)


async def _wait(ev: asyncio.Event, timeout: float) -> None:
    await wait_event(ev, timeout)


@dataclass
class AckResult:
    tenant_id: str
    generation: int
    pending: list[str]
    waited_s: float

    @property
    def timed_out(self) -> bool:
        return bool(self.pending)


async def await_acks(
    store: Store,
    watch: MeshWatch,
    tenant_id: str,
    *,
    released: list[str],
    actor: str,
    instance: str | None = None,
    timeout: float | None = None,
) -> AckResult:
    """Wait until every remaining mesh node of the tenant applied the tenant's current
    generation (which already drops ``released``), or ``timeout``; record a
    ``tenant.mesh.released`` event saying which (and who had not acknowledged)."""
    timeout = RELEASE_ACK_TIMEOUT_S if timeout is None else timeout
    started = time.monotonic()
    gen = await store.run(generation, tenant_id)
    while True:
        left = await store.run(pending, tenant_id, gen)
        remaining = timeout - (time.monotonic() - started)
        if not left or remaining <= 0:
            break
        await watch.wait_acked(tenant_id, min(remaining, STORE_POLL_S))
    result = AckResult(tenant_id, gen, left, time.monotonic() - started)

    def record(s: Session) -> None:
        machines.add_event(
            s,
            "tenant.mesh.released",
            actor,
            tenant_id=tenant_id,
            data={
                "machines": released,
                "generation": gen,
                "acknowledged": not result.timed_out,
                "pending": left,
                "waited_ms": round(result.waited_s * 1000, 1),
            },
            instance=instance,
        )
        s.commit()

    await store.run(record)
    return result


async def after_release(
    store: Store,
    watch: MeshWatch,
    tenant_id: str,
    released: list[str],
    *,
    actor: str,
    instance: str | None = None,
    timeout: float | None = None,
) -> AckResult:
    """The release flow's hook, after its commit and before the wipe's power cycle: wake the
    tenant's long-polling nodes, then ``await_acks``."""
    watch.changed(tenant_id)
    return await await_acks(
        store, watch, tenant_id, released=released, actor=actor, instance=instance, timeout=timeout
    )
