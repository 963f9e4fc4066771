"""The tenant runtime: every tenant's hub (and Slurm control plane) running on this host.

A daemon service (``tenant_hubs``) enabled by ``[tenants] hubs = true``. For each tenant with a
stored hub it builds, from the store alone:

- a network namespace ``mth-<id>`` joined to the provisioning network by a veth whose host end
  is attached to ``underlay_bridge``; the hub's endpoint address sits on the namespace end;
- an nftables guard there that accepts only the hub's WireGuard port and replies on the
  underlay (Slurm's daemons listen on every address; LAB-NOTES);
- the WireGuard hub (wireguard-go) with every stored peer;
- with ``control_planes = true`` and a slurm tenant, slurmctld + munged on the overlay address,
  started from the controller state kept in the store (``metald.tenants.ctlstate``: a hub that
  moved from another instance keeps its nodes and jobs);
- a reaper process that takes the hub down if this metald dies while the host lives on.

A loop then reconciles and observes every ``observe_interval_s``: peers on a hub but not in the
store (released machines) are removed, stored ones missing are added, Slurm nodes whose machine
is no longer a peer are deleted from the cluster, and a joining machine becomes ``active`` once
its handshake is seen and slurmctld reports its node up. A restart rebuilds everything (stale
processes of a killed metald are stopped first); nodes reconnect by themselves (keepalive).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

from sqlmodel import Session, col, select

from metald.config import TenantsConfig
from metald.errors import Unprocessable
from metald.lifecycle import State
from metald.secrets import SecretBox
from metald.service import TaskScope, cancel, wait_event
from metald.store import Store
from metald.store.models import ElasticPoolRow, Machine, Tenant, WgHub, WgPeer, as_utc
from metald.tenants import clusters, controlplane, ctlstate, elastic, elasticspool, mesh, slurm
from metald.tenants.hubs import LocalHubs
from netconfig import guard, links, netns
from netconfig.uapi import PeerStatus
from netconfig.wireguard import SOCKET_DIR

log = logging.getLogger("metald.tenants")
UNDERLAY_IF = "uh0"

#: Takes one hub down when the metald that runs it dies (its host lives on): metald holds the
#: write end of this process's stdin, so the kernel closes it when metald dies however it
#: dies; a clean ``down`` writes "down" first. Without it a killed metald's hub (its
#: wireguard-go, slurmctld and the endpoint address on the underlay) would go on answering
#: beside the new owner's. Signals are ignored: a service manager's stop reaches metald, which
#: takes its hubs down itself. A shell, not Python: one per hub, a few MB each.
REAPER = r"""trap '' TERM INT HUP
read -r word || true
[ "$word" = down ] && exit 0
W="$1"; NS="$2"; VETH="$3"
p=$(cat "$W/wg.pid" 2>/dev/null) && grep -qa wireguard-go "/proc/$p/cmdline" 2>/dev/null \
  && kill -TERM "$p"
c=$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' "$W/slurm/control-plane.json" 2>/dev/null)
if [ -n "$c" ] && grep -qa slurmctld "/proc/$c/cmdline" 2>/dev/null; then
  kill -TERM -- "-$c"
  for i in $(seq 100); do [ -d "/proc/$c" ] || break; sleep 0.1; done
  kill -KILL -- "-$c" 2>/dev/null
fi
"""
REAPER += netns.TEARDOWN_SH + "exit 0\n"
REAPER_NAME = "metald-hub-reaper"


def ns_name(tenant_id: str) -> str:
    return "mth-" + tenant_id.replace("-", "")[:12]


def veth_name(tenant_id: str) -> str:
    return "mtv" + tenant_id.replace("-", "")[:12]


@dataclass
class HubSpec:
    """What the store says about one tenant's hub (plain values, no session)."""

    tenant_id: str
    tenant_name: str
    cluster_kind: str
    ifname: str
    endpoint_host: str
    listen_port: int
    address: str
    prefix: str
    private_key: str = field(repr=False)
    munge_key: bytes | None = field(default=None, repr=False)
    #: public key -> (overlay address, node name)
    peers: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: public key -> where the hub last saw the node
    endpoints: dict[str, str] = field(default_factory=dict)
    #: The tenant's elastic pools (CLOUD nodes in its slurm.conf).
    pools: list[elastic.ElasticPool] = field(default_factory=list)
    #: The nodes' NVLink domains and leaves: the control plane's topology.conf.
    topology: list[slurm.TopoNode] = field(default_factory=list)


def load_specs(session: Session, box: SecretBox) -> list[HubSpec]:
    out = []
    for hub in session.exec(select(WgHub)):
        tenant = session.get(Tenant, hub.tenant_id)
        if tenant is None or tenant.overlay_prefix is None:
            continue
        secrets = clusters.load_secrets(box, tenant)
        out.append(
            HubSpec(
                tenant_id=tenant.id,
                tenant_name=tenant.name,
                cluster_kind=tenant.cluster_kind,
                ifname=hub.ifname,
                endpoint_host=hub.endpoint.rsplit(":", 1)[0].strip("[]"),
                listen_port=hub.listen_port,
                address=hub.address,
                prefix=tenant.overlay_prefix,
                private_key=clusters.hub_private_key(box, hub),
                munge_key=base64.b64decode(secrets["munge_key"])
                if "munge_key" in secrets
                else None,
                peers=_peers(session, tenant.id),
                topology=topology_nodes(session, tenant.id),
                endpoints={
                    p.public_key: p.last_endpoint
                    for p in clusters.peers(session, tenant.id)
                    if p.last_endpoint
                },
                pools=[
                    elastic.pool_of(r)
                    for r in session.exec(
                        select(ElasticPoolRow)
                        .where(ElasticPoolRow.tenant_id == tenant.id)
                        .order_by(col(ElasticPoolRow.name))
                    )
                ],
            )
        )
    return out


def _peers(session: Session, tenant_id: str) -> dict[str, tuple[str, str]]:
    rows = session.exec(
        select(WgPeer, Machine)
        .join(Machine, col(Machine.id) == col(WgPeer.machine_id))
        .where(WgPeer.tenant_id == tenant_id)
    ).all()
    return {p.public_key: (p.address, clusters.node_name(session, m)) for p, m in rows}


def topology_nodes(session: Session, tenant_id: str) -> list[slurm.TopoNode]:
    """The tenant's joined nodes with their NVLink domain (when ready), leaf and address."""
    rows = session.exec(
        select(WgPeer.address, Machine)
        .join(Machine, col(Machine.id) == col(WgPeer.machine_id))
        .where(WgPeer.tenant_id == tenant_id)
    ).all()
    return sorted(
        (
            slurm.TopoNode(
                name=clusters.node_name(session, m),
                nvlink_domain=m.nvlink_domain if m.nvlink_ready else None,
                ib_leaf=m.ib_leaf,
                address=addr,
            )
            for addr, m in rows
        ),
        key=lambda n: n.name,
    )


def free_hub_address(session: Session, pool: ipaddress.IPv4Network) -> str:
    """The first address of ``pool`` no hub's endpoint uses."""
    used = {h.endpoint.rsplit(":", 1)[0] for h in session.exec(select(WgHub))}
    for addr in pool.hosts():
        if str(addr) not in used:
            return str(addr)
    raise Unprocessable(f"every hub address in tenants.hub_addresses ({pool}) is in use")


def observe_tenant(
    session: Session,
    tenant_id: str,
    status: dict[str, PeerStatus],
    up_nodes: set[str] | None,
    instance: str,
) -> list[str]:
    """Record handshakes and endpoints; joining machines whose node is up become active.
    Returns their ids."""
    rows = session.exec(
        select(WgPeer, Machine)
        .join(Machine, col(Machine.id) == col(WgPeer.machine_id))
        .where(WgPeer.tenant_id == tenant_id)
    ).all()
    activated = []
    for peer, m in rows:
        st = status.get(peer.public_key)
        seen = st.last_handshake if st else None
        joining = State(m.state) is State.JOINING
        moved = st is not None and bool(st.endpoint) and st.endpoint != peer.last_endpoint
        if st is not None and moved:
            peer.last_endpoint = st.endpoint  # committed by observe below
            session.add(peer)
            mesh.bump(session, tenant_id)  # the other nodes dial it there from now on
        if not joining and not moved and (seen is None or seen == _aware(peer.last_handshake_at)):
            continue
        name = clusters.node_name(session, m)
        got = clusters.observe(
            session,
            m.id,
            handshake_at=seen,
            scheduler_reports_node=up_nodes is not None and name in up_nodes,
            instance=instance,
        )
        if joining and got.state == State.ACTIVE:
            activated.append(m.id)
    return activated


def _aware(ts: datetime | None) -> datetime | None:
    return None if ts is None else as_utc(ts)


class RunningHub:
    """One tenant's namespace, veth, guard, WireGuard hub and control plane."""

    def __init__(
        self,
        spec: HubSpec,
        cfg: TenantsConfig,
        state_dir: Path,
        hubs: LocalHubs,
        keeper: Callable[[Path], ctlstate.Keeper] | None = None,
    ):
        self.spec = spec
        self.cfg = cfg
        self.ns = ns_name(spec.tenant_id)
        self.workdir = state_dir / "tenants" / spec.tenant_id
        self.hubs = hubs
        self.control: controlplane.SlurmControlPlane | None = None
        #: The controller state's snapshots in the store (None: kept on this host only).
        self.keeper = keeper(self.workdir / "slurm" / "state") if keeper else None
        self.reaper: subprocess.Popen[bytes] | None = None

    def up(self) -> None:
        s = self.spec
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _wait_reaper(self.workdir)  # a killed metald's reaper finishes before this starts
        _kill_stale_wireguard(self.workdir, s.ifname)  # the control plane does its own
        netns.delete(self.ns)
        links.delete(veth_name(s.tenant_id))
        netns.create(self.ns)
        try:
            self.reaper = _start_reaper(self.workdir, self.ns, veth_name(s.tenant_id))
            plen = _bridge_prefixlen(self.cfg.underlay_bridge, s.endpoint_host)
            links.veth_to_bridge(
                veth_name(s.tenant_id),
                self.ns,
                UNDERLAY_IF,
                self.cfg.underlay_bridge,
                hub_mac(s.tenant_id),
            )
            netns.address(self.ns, UNDERLAY_IF, f"{s.endpoint_host}/{plen}")
            guard.apply(self.ns, guard.render([UNDERLAY_IF], wireguard_port=s.listen_port))
            # Nodes talk to each other directly (the mesh); the hub forwards only for nodes
            # that have no mesh view yet (an image without the mesh agent).
            netns.enable_forwarding(self.ns)
            self.hubs.start(
                tenant_id=s.tenant_id,
                ns=self.ns,
                ifname=s.ifname,
                address=s.address,
                prefix=s.prefix,
                listen_port=s.listen_port,
                private_key=s.private_key,
                peers=[(k, a) for k, (a, _n) in s.peers.items()],
                endpoints=s.endpoints,
            )
            (self.workdir / "wg.pid").write_text(str(self.hubs.pid(s.tenant_id)))
            if self.cfg.control_planes and s.cluster_kind == "slurm" and s.munge_key:
                if self.keeper is not None:
                    # A slurmctld a killed metald left here would write its state over the
                    # restored one when stopped: stop it first.
                    controlplane.kill_stale(self.workdir / "slurm")
                    # Before slurmctld starts: the state the last owner saved (a moved hub),
                    # and from now on only this instance may save it.
                    got = self.keeper.take()
                    if got.restored:
                        log.info(
                            "tenant %s: controller state restored from the store (%d bytes)",
                            s.tenant_name,
                            got.size,
                        )
                self.control = controlplane.SlurmControlPlane(
                    tenant_id=s.tenant_id,
                    tenant_name=s.tenant_name,
                    ns=self.ns,
                    workdir=self.workdir / "slurm",
                    hub_address=s.address,
                    munge_key=s.munge_key,
                    pools=list(s.pools),
                    topology=slurm.render_topology_tree(s.topology),
                )
                self.control.start()
        except BaseException:
            self.down()
            raise

    def down(self, *, save: bool = True) -> None:
        """Take the hub down; ``save``: snapshot the controller state once slurmctld has
        stopped (it writes its state on SIGTERM). Not when fenced: the store is unreachable."""
        if self.control is not None:
            self.control.stop()
            self.control = None
            if save and self.keeper is not None:
                try:
                    self.keeper.save_if_changed(final=True)
                except Exception as e:  # noqa: BLE001 - superseded, or the store failed
                    log.warning("tenant %s: last controller state not saved: %s",
                                self.spec.tenant_name, e)  # fmt: skip
        with contextlib.suppress(KeyError):
            self.hubs.stop_one(self.spec.tenant_id)
        (self.workdir / "wg.pid").unlink(missing_ok=True)
        netns.delete(self.ns)  # takes the veth pair with it
        links.delete(veth_name(self.spec.tenant_id))
        _stop_reaper(self.reaper, self.workdir)
        self.reaper = None

    def reconcile(
        self, spec: HubSpec, current: Callable[[], dict[str, tuple[str, str]]]
    ) -> tuple[dict[str, PeerStatus], set[str] | None]:
        """Match the running hub and cluster to the store; return peer status and up nodes.
        ``current()`` reads the tenant's peers again: a join may have committed since ``spec``
        was read, and nothing is removed on the word of a stale read."""
        self.spec = spec
        tid = spec.tenant_id
        running = self.hubs.status(tid)
        stale = set(running) - set(spec.peers)
        if stale:
            now = current()
            for pub in stale - set(now):
                log.info("tenant %s: removing peer %s… (released)", spec.tenant_name, pub[:8])
                self.hubs.remove_peer(tid, pub)
                running.pop(pub)
        for pub in set(spec.peers) - set(running):
            self.hubs.add_peer(tid, pub, spec.peers[pub][0])
        up = None
        if self.control is not None:
            if not self.control.alive():
                log.warning("tenant %s: slurmctld exited; restarting it", spec.tenant_name)
                self.control.start()
            try:
                if self.control.set_topology(slurm.render_topology_tree(spec.topology)):
                    log.info("tenant %s: topology.conf updated", spec.tenant_name)
            except (controlplane.ControlPlaneError, subprocess.TimeoutExpired) as e:
                log.warning("tenant %s: topology not applied: %s", spec.tenant_name, e)
            nodes = self.control.nodes()
            if nodes is not None:
                wanted = {name for _a, name in spec.peers.values()}
                gone = set(nodes) - wanted
                # An elastic pool's CLOUD nodes are slurm.conf's, not dynamic: never deleted.
                gone = {n for n in gone if not any(p.owns(n) for p in spec.pools)}
                if gone:
                    gone -= {name for _a, name in current().values()}
                for name in gone:
                    if self.control.delete_node(name):
                        log.info("tenant %s: node %s left the cluster", spec.tenant_name, name)
                up = controlplane.up_nodes({n: st for n, st in nodes.items() if n in wanted})
            if self.keeper is not None:
                try:
                    self.keeper.save_if_changed()
                except ctlstate.Superseded:
                    raise  # another instance runs the hub now: the runtime takes it down here
                except Exception as e:  # noqa: BLE001 - the store failed: next interval
                    log.warning("tenant %s: controller state not saved: %s", spec.tenant_name, e)
        return running, up


class HubOwnership(Protocol):
    """Which instance runs a tenant's hub (metald.fleet.membership.Membership)."""

    @property
    def fenced(self) -> bool: ...

    def owns_hub(self, tenant_id: str) -> bool: ...


class TenantRuntime:
    """The daemon service; also the ``HubRuntime`` the join route applies peers to."""

    name = "tenant_hubs"

    def __init__(
        self,
        store: Store,
        box: SecretBox,
        cfg: TenantsConfig,
        state_dir: str,
        instance: str,
        *,
        ownership: HubOwnership | None = None,
        tasks: TaskScope | None = None,
    ) -> None:
        self.store = store
        self.box = box
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.instance = instance
        self.hubs = LocalHubs()
        self.running: dict[str, RunningHub] = {}
        self._task: asyncio.Task[None | None] | None = None
        self._lock = asyncio.Lock()
        #: Fleet membership: which tenants' hubs run here. None: every hub (one instance).
        self.ownership = ownership
        self._wake = asyncio.Event()
        #: The sync loop and the fencing take-down; stopped with the service.
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self._fencing: asyncio.Task[None | None] | None = None
        #: (tenant id, op, node names) -> names to set down with their reason: the elastic
        #: pools' use case (set by the daemon; None: spool requests wait).
        self.elastic_handler: Callable[[str, str, list[str]], Awaitable[dict[str, str]]] | None = (
            None
        )
        #: (tenant id, {node: still powering up}) -> the nodes set down for want of a machine
        #: that can have one now (``ElasticPools.retry``; None: they wait for an operator).
        self.elastic_retry: Callable[[str, dict[str, bool]], Awaitable[list[str]]] | None = None

    def owns(self, tenant_id: str) -> bool:
        return self.ownership is None or self.ownership.owns_hub(tenant_id)

    def wake(self) -> None:
        """Sync now (the fleet's live set changed: a hub may have to move here or away). A
        fenced instance takes its hubs down at once, without the store it cannot reach."""
        self._wake.set()
        fenced = self.ownership is not None and self.ownership.fenced
        if fenced and self.running and self._fencing is None and self._task is not None:
            self._fencing = self.tasks.spawn(self._fence_down(), name="tenant-hubs-fence")

    async def _fence_down(self) -> None:
        try:
            await cancel(self._task)  # a sync may be waiting on the unreachable store
            async with self._lock:
                log.warning("fenced (no heartbeat): taking every tenant hub here down")
                await asyncio.to_thread(self._down_all, save=False)
            self._task = self.tasks.spawn(self._loop(), name="tenant-hubs")
        finally:
            self._fencing = None

    async def start(self) -> None:
        await self.sync()
        await self.tasks.open()
        self._task = self.tasks.spawn(self._loop(), name="tenant-hubs")

    async def stop(self) -> None:
        await cancel(self._fencing)
        await cancel(self._task)
        self._task = None
        await self.tasks.close()
        async with self._lock:  # a sync bringing a hub up finishes first, then all go down
            await asyncio.to_thread(self._down_all)

    def _down_all(self, *, save: bool = True) -> None:
        for hub in self.running.values():
            try:
                hub.down(save=save)
            except Exception:
                log.exception("tenant %s: tearing the hub down failed", hub.spec.tenant_name)
        self.running.clear()

    async def sync(self) -> list[str]:
        """Bring up new hubs, reconcile running ones, observe; returns machines activated."""
        async with self._lock:
            specs = [
                s for s in await self.store.run(load_specs, self.box) if self.owns(s.tenant_id)
            ]
            # Hubs this instance no longer owns (another instance joined and took them, or this
            # one is fenced) go down first: one endpoint address never answers on two hosts.
            owned = {s.tenant_id for s in specs}
            for tid in [t for t in self.running if t not in owned]:
                hub = self.running.pop(tid)
                log.info("tenant %s: hub handed over to another instance", hub.spec.tenant_name)
                await asyncio.to_thread(hub.down)
            seen: dict[str, tuple[dict[str, PeerStatus], set[str] | None]] = {}
            for spec in specs:
                try:
                    seen[spec.tenant_id] = await asyncio.to_thread(self._sync_one, spec)
                except ctlstate.Superseded as e:
                    # The store says another instance brought this hub up since: this one's
                    # view of the fleet is stale. Its copy goes down, saving nothing.
                    log.error("tenant %s: %s; taking the hub here down", spec.tenant_name, e)
                    hub = self.running.pop(spec.tenant_id)
                    await asyncio.to_thread(hub.down, save=False)
                except Exception as e:
                    log.error("tenant %s: hub not running: %s", spec.tenant_name, e)
            activated: list[str] = []
            for tid, (status, up) in seen.items():
                activated += await self.store.run(observe_tenant, tid, status, up, self.instance)
            for mid in activated:
                log.info("machine %s joined its tenant's cluster: active", mid)
            return activated

    def _keeper(self, spec: HubSpec) -> Callable[[Path], ctlstate.Keeper]:
        return lambda folder: ctlstate.Keeper(
            self.store, self.box, spec.tenant_id, self.instance, folder
        )

    def _sync_one(self, spec: HubSpec) -> tuple[dict[str, PeerStatus], set[str] | None]:
        hub = self.running.get(spec.tenant_id)
        if hub is None:
            hub = RunningHub(spec, self.cfg, self.state_dir, self.hubs, self._keeper(spec))
            hub.up()
            self.running[spec.tenant_id] = hub
            log.info(
                "tenant %s: hub %s up on %s:%d (namespace %s)%s",
                spec.tenant_name,
                spec.ifname,
                spec.endpoint_host,
                spec.listen_port,
                hub.ns,
                ", Slurm control plane started" if hub.control else "",
            )

        def current() -> dict[str, tuple[str, str]]:
            with self.store.session() as s:
                return _peers(s, spec.tenant_id)

        if hub.control is not None and hub.control.pools != spec.pools:
            # A pool created, changed or deleted: slurm.conf rewritten, slurmctld restarted
            # (its state is on disk: queued jobs survive).
            hub.control.set_pools(spec.pools)
        return hub.reconcile(spec, current)

    async def elastic_changed(self, tenant_id: str) -> None:
        """A pool of the tenant changed: sync now (slurm.conf follows)."""
        self.wake()

    async def _drain_elastic(self) -> None:
        """Act on what slurmctld's Resume/SuspendProgram left in each control plane's spool;
        a request is removed once acted on (acting is idempotent, so a metald killed before
        that repeats it without a second claim)."""
        handler = self.elastic_handler
        if handler is None:
            return
        for tid, hub in list(self.running.items()):
            cp = hub.control
            if cp is None:
                continue
            if any(p.min_nodes for p in cp.pools):
                await asyncio.to_thread(cp.keep_min)
            for path in cp.elastic_requests():
                try:
                    req = elasticspool.read(path)
                except (OSError, elasticspool.RequestError) as e:
                    log.error("tenant %s: elastic request %s dropped: %s",
                              hub.spec.tenant_name, path.name, e)  # fmt: skip
                    elasticspool.done(path)
                    continue
                names = req.names
                if req.op == "resume":
                    # The node-state reconcile may have seen these nodes powering up before
                    # slurmctld's program wrote this request, and set some down for want of a
                    # machine already: those wait for the retry, not a second attempt (and a
                    # second event).
                    states = await asyncio.to_thread(cp.node_states) or {}
                    held_back = elastic.stuck(cp.pools, states)
                    names = [n for n in names if n not in held_back]
                try:
                    down = await handler(tid, req.op, names) if names else {}
                except Exception:
                    log.exception("tenant %s: elastic %s %s failed; retried next interval",
                                  hub.spec.tenant_name, req.op, req.names)  # fmt: skip
                    continue
                await self._set_down(cp, down)
                elasticspool.done(path)
            try:
                await self._reconcile_elastic(tid, cp)
            except Exception:
                log.exception("tenant %s: elastic reconcile failed; retried next interval",
                              hub.spec.tenant_name)  # fmt: skip

    async def _set_down(self, cp: controlplane.SlurmControlPlane, down: dict[str, str]) -> None:
        by_reason: dict[str, list[str]] = {}
        for n, why in down.items():
            by_reason.setdefault(why, []).append(n)
        for why, names in by_reason.items():
            await asyncio.to_thread(cp.set_down, names, why)

    async def _reconcile_elastic(self, tid: str, cp: controlplane.SlurmControlPlane) -> None:
        """What slurmctld's node states say beside the spool: a node it powers up with no
        claim (the request was lost: a killed instance's spool is on its own host) is
        resumed; nodes set down for want of a machine come back once one is free."""
        handler = self.elastic_handler
        if not cp.pools or handler is None:
            return
        states = await asyncio.to_thread(cp.node_states)
        if not states:
            return
        lost = elastic.powering_up(cp.pools, states)
        if lost:
            await self._set_down(cp, await handler(tid, "resume", lost))
        stuck = elastic.stuck(cp.pools, states)
        if stuck and self.elastic_retry is not None:
            back = await self.elastic_retry(tid, stuck)
            if back:
                log.info("tenant %s: elastic nodes %s have machines now: back in service",
                         tid, ",".join(back))  # fmt: skip
                await asyncio.to_thread(cp.return_to_service, back)

    async def _loop(self) -> None:
        while True:
            await wait_event(self._wake, self.cfg.observe_interval_s)
            self._wake.clear()
            try:
                await self.sync()
                # Outside the sync's lock: a suspend's release syncs the hubs itself.
                await self._drain_elastic()
            except Exception:
                log.exception("tenant hub sync failed; trying again next interval")

    # -- HubRuntime (the join route applies a new peer at once) ---------------------------
    # A hub another instance runs (a fleet) is not running here: its owner applies the stored
    # peer at its next sync (observe_interval_s), so there is nothing to do and nothing wrong.
    def add_peer(self, tenant_id: str, public_key: str, address: str) -> None:
        if tenant_id not in self.running and not self.owns(tenant_id):
            log.debug("tenant %s: hub runs on another instance; it adds the peer", tenant_id)
            return
        self.hubs.add_peer(tenant_id, public_key, address)

    def remove_peer(self, tenant_id: str, public_key: str) -> None:
        if tenant_id not in self.running and not self.owns(tenant_id):
            log.debug("tenant %s: hub runs on another instance; it drops the peer", tenant_id)
            return
        self.hubs.remove_peer(tenant_id, public_key)

    def handshakes(self, tenant_id: str) -> dict[str, datetime | None]:
        return self.hubs.handshakes(tenant_id)

    def control_plane(self, tenant_id: str) -> controlplane.SlurmControlPlane | None:
        hub = self.running.get(tenant_id)
        return hub.control if hub else None


# -- host plumbing ------------------------------------------------------------------------


def _bridge_prefixlen(bridge: str, address: str) -> int:
    """The prefix length of the underlay bridge's IPv4 network that holds the hub's address."""
    try:
        return links.bridge_prefixlen(bridge, address)
    except links.LinkError as e:
        raise RuntimeError(f"tenants.underlay_bridge: {e}") from None


def hub_mac(tenant_id: str) -> str:
    """A locally administered MAC derived from the tenant: when the hub moves to another
    instance, its endpoint address keeps its link-layer address, so nodes' ARP caches stay
    right and the nodes reconnect without waiting for the cache to expire."""
    raw = hashlib.sha256(f"metald-hub:{tenant_id}".encode()).digest()[:5]
    return "02:" + ":".join(f"{b:02x}" for b in raw)


def clear_leftovers(state_dir: str | Path) -> list[str]:
    """Take down what a killed metald left of its tenant hubs under ``state_dir`` (its
    wireguard-go, slurmctld and munged, the hub namespaces and veths): for an instance that will
    not start again here, or a lab or test that ends after a crash. Returns the namespaces
    removed. (A starting runtime clears each hub's leftovers itself as it brings it up.)"""
    removed = []
    for workdir in sorted(Path(state_dir, "tenants").glob("*")):
        if not workdir.is_dir():
            continue
        tenant_id = workdir.name
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((workdir / "wg.pid").read_text()), signal.SIGTERM)
        (workdir / "wg.pid").unlink(missing_ok=True)
        (workdir / "reaper.pid").unlink(missing_ok=True)  # it ran when its metald died
        controlplane.kill_stale(workdir / "slurm")
        ns = ns_name(tenant_id)
        if Path(netns.path(ns)).exists():
            netns.delete(ns)
            removed.append(ns)
        links.delete(veth_name(tenant_id))
    return removed


def _start_reaper(workdir: Path, ns: str, veth: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        ["bash", "-c", REAPER, REAPER_NAME, str(workdir), ns, veth],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # no terminal's ^C: metald's own stop takes the hub down
    )
    (workdir / "reaper.pid").write_text(str(p.pid))
    return p


def _stop_reaper(p: subprocess.Popen[bytes] | None, workdir: Path) -> None:
    """The hub is down: tell its reaper so (it exits without doing anything)."""
    if p is not None and p.stdin is not None:
        with contextlib.suppress(OSError):
            p.stdin.write(b"down\n")
            p.stdin.close()
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    (workdir / "reaper.pid").unlink(missing_ok=True)


def _wait_reaper(workdir: Path, timeout: float = 15.0) -> None:
    """The reaper of a metald that died here is taking its hub down: let it finish (else it
    would delete the namespace this one is creating)."""
    pidfile = workdir / "reaper.pid"
    try:
        pid = int(pidfile.read_text())
    except (OSError, ValueError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if REAPER_NAME.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                break
        except OSError:
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def _kill_stale_wireguard(workdir: Path, ifname: str) -> None:
    """wireguard-go left by a killed metald keeps its control socket: stop it and remove it."""
    pidfile = workdir / "wg.pid"
    try:
        pid = int(pidfile.read_text())
        if b"wireguard-go" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass
    pidfile.unlink(missing_ok=True)
    sock = SOCKET_DIR / f"{ifname}.sock"
    for _ in range(100):
        if not sock.exists():
            break
        if not _socket_alive(sock):
            sock.unlink(missing_ok=True)
            break
        time.sleep(0.05)


def _socket_alive(sock: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()
