"""``HealthWatch``: the service that watches machines in use (provisioned, joining, active)
and repairs them without anyone asking.

Each round (``[health] watch_interval_s``, or at once when woken):

- node silence: a machine whose agent reported before and has not for ``node_silence_s`` gets
  metald's silence signal (fatal by the table). A machine whose agent never reported is not
  judged silent: images without the agent (or a Kubernetes node) never report, and a node
  that never came up is the join watchdog's business. Read by the machine's owner;
- every ``bmc_interval_s``: each BMC's event log, read by the BMC's owning instance only (the
  fleet's rendezvous owner; no read is duplicated across instances), turned into signals for
  the entries after its cursor (``bmc_log_cursors``); the first read of a BMC sets the cursor
  and judges nothing older; and its sensors;
- every ``bmc_interval_s``: the tenant's Slurm's word on each node (DOWN / NOT_RESPONDING), by
  the instance that runs the tenant's control plane;
- then every open remediation of the tenants whose control plane this instance runs is carried
  forward (``metald.healthwatch.workflow``).

Signals are classified by the configured table and folded into the machine's faults under the
trust rule; a machine at degraded or worse in a claim gets a remediation in the same
transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import select as sa_select
from sqlalchemy import update
from sqlmodel import Session, col, select

from metald.commissioning.parsers.bmc_sel import MAX_KEYS, entry_key
from metald.health import bmc as bmc_signals
from metald.health.classify import Table
from metald.health.config import HealthConfig
from metald.health.node import silence
from metald.health.scheduler import NodeState, SchedulerError, state_signal
from metald.health.signals import OK, Kind, Signal, Witness
from metald.healthwatch import faults, reports
from metald.healthwatch.workflow import Remediations, SchedulerFor, open_for
from metald.lifecycle import IN_USE, State
from metald.provision.metadata import hostname
from metald.service import TaskScope, wait_event
from metald.store.db import Store
from metald.store.models import (
    Bmc,
    BmcEventSubscription,
    BmcLogCursor,
    HealthFault,
    Machine,
    NodeHeartbeat,
    Remediation,
    as_utc,
)

log = logging.getLogger("metald.health")
_IN_USE = [s.value for s in IN_USE]
#: BMC reads at once per instance (each is one BMC session through the fenced executor).
BMC_CONCURRENCY = 16
#: A BMC whose event log's stamp (``BmcReads.event_log_stamp``) has not changed is still read
#: in full every this many visits (at the default 20 s: every 5 minutes), so a BMC that does not
#: move its stamp for a new record delays it, never hides it.
FULL_READ_EVERY = 15


class BmcReads(Protocol):
    """The BMC service as the watch reads it (``metald.bmc.service.BmcService``)."""

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]: ...

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]: ...

    # Optional (``getattr``): ``event_log_stamp(machine_id) -> str | None``, what changes
    # whenever the event log does (IPMI Get SEL Info), None where the driver cannot say.


class Ownership(Protocol):
    """The fleet (``metald.fleet.membership.Membership``): who reads what."""

    @property
    def fenced(self) -> bool: ...

    def owns_bmc(self, bmc_id: str, address: str) -> bool: ...

    def owns_hub(self, tenant_id: str) -> bool: ...

    def hub_owner(self, tenant_id: str) -> str | None: ...

    def owns_key(self, key: str) -> bool: ...

    def owns_machine(self, machine_id: str, bmc: tuple[str, str] | None) -> bool: ...


@dataclass(frozen=True)
class InUse:
    machine_id: str
    tenant_id: str | None
    name: str | None
    bmc_id: str | None
    bmc_address: str | None
    bmc_protocol: str | None


def in_use(s: Session) -> list[InUse]:
    # Six columns: past sqlmodel's typed select overloads, so SQLAlchemy's own.
    rows = s.execute(
        sa_select(
            col(Machine.id),
            col(Machine.tenant_id),
            col(Machine.name),
            col(Bmc.id),
            col(Bmc.address),
            col(Bmc.protocol),
        )
        .join(Bmc, col(Bmc.machine_id) == col(Machine.id), isouter=True)
        .where(col(Machine.state).in_(_IN_USE))
        .order_by(col(Machine.id))
    ).all()
    return [InUse(*r) for r in rows]


def silent(s: Session, before: datetime) -> list[tuple[str, datetime]]:
    """In-use machines whose last report is older than ``before`` (never-reported: none)."""
    rows = s.exec(
        select(NodeHeartbeat.machine_id, NodeHeartbeat.last_at)
        .join(Machine, col(Machine.id) == col(NodeHeartbeat.machine_id))
        .where(
            col(Machine.state).in_(_IN_USE),
            col(NodeHeartbeat.last_at) < before,
            col(NodeHeartbeat.claim_id) == col(Machine.claim_id),
        )
    ).all()
    return [(r[0], as_utc(r[1])) for r in rows]


def record_signals(
    s: Session,
    machine_id: str,
    signals: list[Signal],
    *,
    cfg: HealthConfig,
    table: Table,
    now: datetime,
    actor: str,
    instance: str | None,
) -> int:
    """Classify, fold and store; open a remediation where due. Returns the new faults.
    Committed. A machine no longer in use is left alone."""
    m = s.get(Machine, machine_id)
    if m is None or m.state not in _IN_USE or not signals:
        s.rollback()
        return 0
    rec = faults.record(s, m, [table.classify(x) for x in signals], now=now,
                        transient_ttl_s=cfg.transient_ttl_s, actor=actor, instance=instance)  # fmt: skip
    open_for(s, m, rec.health, cfg, actor=actor, instance=instance)
    s.commit()
    return len(rec.new)


#: Pushed keys kept per subscription (the polled read absorbs them into the cursor).
MAX_PUSHED_KEYS = 1024


def subscription(s: Session, bmc_id: str, *, lock: bool = False) -> BmcEventSubscription | None:
    """The BMC's event subscription row (``metald.healthwatch.pushed``), locked on request."""
    q = select(BmcEventSubscription).where(BmcEventSubscription.bmc_id == bmc_id)
    return s.exec(q.with_for_update() if lock else q).first()


def _absorb_pushed(s: Session, bmc_id: str, read: list[str]) -> list[str]:
    """The keys of the entries the BMC pushed (``metald.healthwatch.pushed``), for the polled
    read to take as seen; those the read now holds leave the subscription row (the cursor
    keeps them from here)."""
    sub = subscription(s, bmc_id, lock=True)
    if sub is None or not sub.keys:
        return []
    pushed = list(sub.keys)
    held = set(read)
    left = [k for k in pushed if k not in held]
    if left != pushed:
        sub.keys = left
        s.add(sub)
    return pushed


def record_bmc_log(
    s: Session,
    machine_id: str,
    bmc_id: str,
    kind: Kind,
    entries: list[dict[str, Any]],
    sensors: list[dict[str, Any]],
    *,
    cfg: HealthConfig,
    table: Table,
    now: datetime,
    actor: str,
    instance: str | None,
) -> int:
    """The entries after the BMC's cursor (the first read only sets it) and the sensors, as
    signals; the cursor moves in the same transaction. Returns the new faults. A visit that
    finds nothing new (the same last record, sensors fine, no BMC fault to clear) writes
    nothing."""
    cur = s.get(BmcLogCursor, bmc_id)
    first = cur is None
    last = str(entries[-1].get("id")) if entries else None
    unchanged = cur is not None and cur.last_id == last and cur.entries == len(entries)
    sensor_sigs = bmc_signals.sensor_signals(
        [{**x, "unit": x.get("units") or x.get("unit")} for x in sensors], at=now
    )
    findings = [x for x in sensor_sigs if not x.is_clear]
    clears = [x for x in sensor_sigs if x.is_clear]
    if clears and not findings:
        # a clear matters only where the BMC has a fault of that kind open
        open_bmc = s.exec(
            select(HealthFault.id).where(
                HealthFault.machine_id == machine_id,
                HealthFault.witness == "bmc",
                HealthFault.kind == Kind.SENSOR.value,
                col(HealthFault.cleared_at).is_(None),
            )
        ).first()
        clears = clears if open_bmc else []
    if unchanged and not findings and not clears:
        s.rollback()
        return 0
    if cur is None:
        cur = BmcLogCursor(bmc_id=bmc_id, keys=[])
    sigs: list[Signal] = []
    if not unchanged:
        read = [entry_key(e) for e in entries[-MAX_KEYS:]]
        pushed = _absorb_pushed(s, bmc_id, read)
        sigs, keys = bmc_signals.log_signals(entries, seen=[*cur.keys, *pushed], at=now, kind=kind)
        cur.keys = keys[-MAX_KEYS:]
        cur.entries = len(entries)
        cur.last_id = last if last is not None else cur.last_id
        cur.read_at, cur.reader = now, instance
        s.add(cur)
    found = ([] if first else sigs) + findings + clears
    if not found:
        s.commit()
        return 0
    return record_signals(s, machine_id, found, cfg=cfg, table=table, now=now, actor=actor,
                          instance=instance)  # fmt: skip


def new_secret() -> str:
    """A pushed-event secret for one BMC's subscription."""
    return secrets.token_urlsafe(32)


def secret_hash(secret: str) -> str:
    """What the store keeps of a pushed-event secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _subscription_held(s: Session, bmc_id: str) -> tuple[str | None, str | None] | None:
    sub = subscription(s, bmc_id)
    return None if sub is None else (sub.uri, sub.owner)


def _subscriptions_of(s: Session, owner: str) -> list[tuple[str, str | None, str, str]]:
    """(BMC id, machine id, address, URI) of the live subscriptions ``owner`` made."""
    rows = s.exec(
        select(BmcEventSubscription.bmc_id, Bmc.machine_id, Bmc.address, BmcEventSubscription.uri)
        .join(Bmc, col(Bmc.id) == col(BmcEventSubscription.bmc_id))
        .where(BmcEventSubscription.owner == owner, col(BmcEventSubscription.uri).is_not(None))
    ).all()
    return [(r[0], r[1], r[2], str(r[3])) for r in rows]


def _forget_uri(s: Session, bmc_id: str, uri: str) -> None:
    sub = subscription(s, bmc_id, lock=True)
    if sub is not None and sub.uri == uri:
        sub.uri = None
        s.add(sub)
    s.commit()


def _put_subscription(
    s: Session, bmc_id: str, digest: str, uri: str | None, owner: str, now: datetime
) -> None:
    sub = subscription(s, bmc_id, lock=True)
    if sub is None:
        sub = BmcEventSubscription(bmc_id=bmc_id, secret_hash=digest, created_at=now, keys=[])
    elif sub.secret_hash != digest:
        sub.created_at, sub.events, sub.event_at = now, 0, None
    sub.secret_hash, sub.uri, sub.owner = digest, uri, owner
    s.add(sub)
    s.commit()


def _nothing_new(s: Session, machine_id: str, bmc_id: str, last: str | None, n: int) -> bool:
    """The log's last record and length are the cursor's, and the BMC has no sensor fault
    open that a fine sensor would clear."""
    cur = s.get(BmcLogCursor, bmc_id)
    if cur is None or cur.last_id != last or cur.entries != n:
        return False
    return (
        s.exec(
            select(HealthFault.id).where(
                HealthFault.machine_id == machine_id,
                HealthFault.witness == "bmc",
                HealthFault.kind == Kind.SENSOR.value,
                col(HealthFault.cleared_at).is_(None),
            )
        ).first()
        is None
    )


@dataclass(frozen=True)
class Known:
    """What the store holds for this round's BMC visits, read in one go: each BMC's cursor
    (last record id, entry count) and the machines with a BMC sensor fault open."""

    cursors: dict[str, tuple[str | None, int]]
    sensor_faulted: frozenset[str]

    def nothing_new(self, machine_id: str, bmc_id: str, last: str | None, n: int) -> bool:
        """``_nothing_new`` without a query."""
        return self.cursors.get(bmc_id) == (last, n) and machine_id not in self.sensor_faulted


def known(s: Session) -> Known:
    cursors = {
        r[0]: (r[1], r[2])
        for r in s.exec(select(BmcLogCursor.bmc_id, BmcLogCursor.last_id, BmcLogCursor.entries))
    }
    faulted = s.exec(
        select(HealthFault.machine_id).where(
            HealthFault.witness == "bmc",
            HealthFault.kind == Kind.SENSOR.value,
            col(HealthFault.cleared_at).is_(None),
        )
    )
    return Known(cursors, frozenset(faulted))


def _open_remediation_machines(s: Session) -> set[str]:
    return {
        r
        for r in s.exec(
            select(Remediation.machine_id).where(col(Remediation.open_machine).is_not(None))
        )
    }


_RESPONDING_DRAINED = frozenset({NodeState.DRAINED, NodeState.DRAINING})


def close_returned(s: Session, now: datetime) -> int:
    """Faults still open on machines back in the pool (ready: wiped, commissioned or returned
    by a technician) are closed: they were the last tenancy's. Committed."""
    pooled = select(Machine.id).where(Machine.state == State.READY.value)
    res = s.connection().execute(
        update(HealthFault)
        .where(col(HealthFault.cleared_at).is_(None), col(HealthFault.machine_id).in_(pooled))
        .values(cleared_at=now, open_key=None, cleared_by="back in the pool")
    )
    s.commit()
    return int(res.rowcount or 0)


def _any_returned(s: Session) -> bool:
    return (
        s.exec(
            select(HealthFault.id)
            .join(Machine, col(Machine.id) == col(HealthFault.machine_id))
            .where(col(HealthFault.cleared_at).is_(None), Machine.state == State.READY.value)
            .limit(1)
        ).first()
        is not None
    )


def _scheduler_faulted(s: Session) -> set[str]:
    return set(
        s.exec(
            select(HealthFault.machine_id).where(
                HealthFault.witness == "scheduler", col(HealthFault.cleared_at).is_(None)
            )
        )
    )


class HealthWatch:
    name = "health"

    def __init__(
        self,
        store: Store,
        cfg: HealthConfig,
        instance: str,
        *,
        remediations: Remediations,
        table: Table,
        bmc: BmcReads | None = None,
        ownership: Ownership | None = None,
        scheduler_for: SchedulerFor | None = None,
        tasks: TaskScope | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.instance = instance
        self.remediations = remediations
        self.table = table
        self.bmc = bmc
        self.ownership = ownership
        self.scheduler_for = scheduler_for
        self.tasks = tasks or TaskScope("health")
        self.clock = clock
        self._wake = asyncio.Event()
        self._next_reads = 0.0
        #: Seconds of CPU (process time) the last round took, and its BMC reads.
        self.last_round_cpu_s = 0.0
        self.bmc_reads = 0
        #: Per BMC: the event log's stamp before the last full read that was recorded, and the
        #: visits since that found the same stamp (this instance's; a new owner reads in full).
        self._stamps: dict[str, tuple[str, int]] = {}
        #: Per Redfish BMC subscribed to push its events: visits since its subscription was
        #: last checked (this instance's; a new owner checks at its first visit).
        self._subs: dict[str, int] = {}
        #: Node reports that said nothing new, taken in memory (``metald.healthwatch.reports``);
        #: their heartbeats are written at each round.
        self.memo = reports.ReportMemo()
        self._started = False

    @property
    def actor(self) -> str:
        return f"metald:{self.instance}"

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        await self.tasks.open()
        if self.cfg.enabled:
            self.tasks.spawn(self._loop(), name="health-watch")
            self._started = True

    async def stop(self) -> None:
        self._started = False
        await self.tasks.close()
        try:
            await self.flush_reports()
        except Exception:
            log.warning("health: node heartbeats taken in memory not written", exc_info=True)

    @property
    def report_memo(self) -> reports.ReportMemo | None:
        """Where the API takes a node report that says nothing new: only while the rounds run
        (they write its heartbeat) and the instance is not fenced."""
        if not self._started or (self.ownership is not None and self.ownership.fenced):
            return None
        return self.memo

    async def flush_reports(self) -> None:
        """Forget the remembered nodes no longer valid, and write the heartbeats taken in
        memory (one read and one statement)."""
        if not self.memo.by_token:
            return
        valid = await self.store.read(reports.validate, list(self.memo.by_token))
        self.memo.keep_valid(valid)
        due = self.memo.take_due()
        if due:
            await self.store.run(reports.flush, due)

    def health(self) -> str:
        return "running" if self.cfg.enabled else "disabled"

    def _owns_machine(self, u: InUse) -> bool:
        if self.ownership is None:
            return True
        bmc = (u.bmc_id, u.bmc_address) if u.bmc_id and u.bmc_address else None
        return self.ownership.owns_machine(u.machine_id, bmc)

    def _owns_hub(self, tenant_id: str) -> bool:
        """Whether this instance drives the tenant's remediations: the one running its hub
        (and control plane), or, where no instance runs hubs, the rendezvous owner of the
        tenant's key."""
        if self.ownership is None:
            return True
        if self.ownership.hub_owner(tenant_id) is None:
            return self.ownership.owns_key(f"health:{tenant_id}")
        return self.ownership.owns_hub(tenant_id)

    async def _loop(self) -> None:
        while True:
            # cleared before the round: a wake during it (a pushed event) runs one more at once
            self._wake.clear()
            try:
                await self.round()
            except Exception:
                log.exception("health round failed; trying again next interval")
            await wait_event(self._wake, self.cfg.watch_interval_s)

    async def round(self, *, reads: bool | None = None) -> None:
        """One round (see the module docstring). ``reads``: force (or skip) the BMC and
        scheduler reads; by default they run every ``bmc_interval_s``."""
        if self.ownership is not None and self.ownership.fenced:
            return
        cpu0 = time.process_time()
        now = self.clock()
        if reads is None:
            reads = time.monotonic() >= self._next_reads
        await self.flush_reports()  # before silence is judged
        machines = await self.store.read(in_use)
        if await self.store.read(_any_returned):
            await self.store.run(close_returned, now)
        await self.check_silence(machines, now)
        if reads:
            self._next_reads = time.monotonic() + self.cfg.bmc_interval_s
            await self.read_bmcs(machines)
            await self.read_schedulers(machines)
        await self.remediations.run_all(self._owns_hub)
        self.last_round_cpu_s = time.process_time() - cpu0

    async def check_silence(self, machines: list[InUse], now: datetime) -> None:
        owned = {u.machine_id for u in machines if self._owns_machine(u)}
        limit = self.cfg.node_silence_s
        since = datetime.fromtimestamp(now.timestamp() - limit, UTC)
        for mid, last in await self.store.read(silent, since):
            if mid in owned:
                sig = silence(last, last, now)
                await self.store.run(record_signals, mid, [sig], cfg=self.cfg, table=self.table,
                                     now=now, actor=self.actor, instance=self.instance)  # fmt: skip

    async def read_bmcs(self, machines: list[InUse]) -> None:
        if self.bmc is None:
            return
        mine = [
            u
            for u in machines
            if u.bmc_id
            and u.bmc_address
            and (self.ownership is None or self.ownership.owns_bmc(u.bmc_id, u.bmc_address))
        ]
        await self._unsubscribe_unused({u.bmc_id for u in machines if u.bmc_id})
        if not mine:
            return
        # One query for the round (not one per BMC): each BMC is visited once in it, and
        # only its visit moves its cursor.
        seen = await self.store.read(known)
        gate = asyncio.Semaphore(BMC_CONCURRENCY)
        await asyncio.gather(*(self._read_bmc(u, gate, seen) for u in mine))

    async def _keep_subscribed(self, u: InUse) -> None:
        """A Redfish BMC's event subscription, held by its owner (``metald.healthwatch.pushed``):
        made at the first visit, checked every ``FULL_READ_EVERY`` visits and made again when
        the BMC lost it (a BMC restart) or another instance made it (the owner changed: its
        subscription is deleted). A BMC without an EventService is asked again at the next
        check. Polling goes on whatever happens here."""
        subscribe = getattr(self.bmc, "event_subscribe", None)
        base = self.cfg.bmc_events_url.rstrip("/")
        if subscribe is None or not base or u.bmc_protocol != "redfish" or u.bmc_id is None:
            return
        assert self.bmc is not None
        bmc: Any = self.bmc
        visits = self._subs.get(u.bmc_id)
        if visits is not None and visits + 1 < FULL_READ_EVERY:
            self._subs[u.bmc_id] = visits + 1
            return
        self._subs[u.bmc_id] = 0
        try:
            held = await self.store.read(_subscription_held, u.bmc_id)
            if held is not None and held[0] is not None:
                uri, owner = held
                if owner == self.instance and await bmc.event_subscription_alive(u.machine_id, uri):
                    return
                with contextlib.suppress(Exception):  # lost already, or the BMC says later
                    await bmc.event_unsubscribe(u.machine_id, uri)
            secret = new_secret()
            digest = secret_hash(secret)
            # the secret is on record before the BMC can send with it
            await self.store.run(_put_subscription, u.bmc_id, digest, None, self.instance,
                                 self.clock())  # fmt: skip
            uri = await subscribe(u.machine_id, f"{base}/api/v1/bmc-events/{u.bmc_id}", secret)
            if uri is None:  # no EventService: the row stays without a URI (asked again)
                return
            await self.store.run(_put_subscription, u.bmc_id, digest, uri, self.instance,
                                 self.clock())  # fmt: skip
            log.info("health: BMC %s pushes its events (%s)", u.bmc_id, uri)
        except Exception as e:  # polling covers; tried again at the next check
            log.info("health: BMC %s: event subscription not made: %s", u.bmc_id, e)

    async def _unsubscribe_unused(self, in_use_bmcs: set[str]) -> None:
        """The subscriptions this instance made on BMCs whose machine is no longer in use (or
        that it no longer owns, where it still may send: never) are deleted on the BMC; the row
        keeps no URI (a machine in use again is subscribed afresh)."""
        if getattr(self.bmc, "event_unsubscribe", None) is None or not self.cfg.bmc_events_url:
            return
        bmc: Any = self.bmc
        held = await self.store.read(_subscriptions_of, self.instance)
        for bmc_id, machine_id, address, uri in held:
            if bmc_id in in_use_bmcs or machine_id is None:
                continue
            if self.ownership is not None and not self.ownership.owns_bmc(bmc_id, address):
                continue  # the owner's business now
            self._subs.pop(bmc_id, None)
            try:
                await bmc.event_unsubscribe(machine_id, uri)
            except Exception as e:  # the BMC keeps pushing; the route records nothing
                log.info("health: BMC %s: event subscription not deleted: %s", bmc_id, e)
                continue
            await self.store.run(_forget_uri, bmc_id, uri)

    async def _read_bmc(self, u: InUse, gate: asyncio.Semaphore, seen: Known | None = None) -> None:
        assert self.bmc is not None and u.bmc_id is not None
        kind = Kind.REDFISH_LOG if u.bmc_protocol == "redfish" else Kind.SEL
        stamp_of = getattr(self.bmc, "event_log_stamp", None)
        sensors: list[dict[str, Any]] | None = None
        async with gate:
            await self._keep_subscribed(u)
            stamp = None
            if stamp_of is not None:
                try:
                    stamp = await stamp_of(u.machine_id)
                except Exception as e:  # then the full read says
                    log.info("health: machine %s: event log stamp not read: %s", u.machine_id, e)
            known_stamp, skipped = self._stamps.get(u.bmc_id, (None, 0))
            if stamp is not None and stamp == known_stamp and skipped + 1 < FULL_READ_EVERY:
                # The log is as it was at the last full read (the cursor's): only the sensors.
                try:
                    sensors = await self.bmc.sensors(u.machine_id)
                except Exception as e:
                    log.info("health: machine %s: sensors not read: %s", u.machine_id, e)
                    sensors = []
                fine = all(str(x.get("health") or "").lower() not in ("warning", "critical")
                           for x in sensors)  # fmt: skip
                faulted = seen is None or u.machine_id in seen.sensor_faulted
                if fine and not faulted:
                    self.bmc_reads += 1
                    self._stamps[u.bmc_id] = (stamp, skipped + 1)
                    return
            try:
                entries = await self.bmc.event_log(u.machine_id)
            except Exception as e:  # a BMC that does not answer is not a machine fault
                log.info("health: machine %s: event log not read: %s", u.machine_id, e)
                return
            if sensors is None:
                try:
                    sensors = await self.bmc.sensors(u.machine_id)
                except Exception as e:
                    log.info("health: machine %s: sensors not read: %s", u.machine_id, e)
                    sensors = []
        self.bmc_reads += 1
        last = str(entries[-1].get("id")) if entries else None
        fine = all(str(x.get("health") or "").lower() not in ("warning", "critical")
                   for x in sensors)  # fmt: skip
        if fine and (
            seen.nothing_new(u.machine_id, u.bmc_id, last, len(entries))
            if seen is not None
            else await self.store.read(_nothing_new, u.machine_id, u.bmc_id, last, len(entries))
        ):
            self._remember(u.bmc_id, stamp)
            return  # the common visit: no query, no write transaction
        n = await self.store.run(record_bmc_log, u.machine_id, u.bmc_id, kind, entries, sensors,
                                 cfg=self.cfg, table=self.table, now=self.clock(),
                                 actor=self.actor, instance=self.instance)  # fmt: skip
        self._remember(u.bmc_id, stamp)
        if n:
            self.wake()

    def _remember(self, bmc_id: str, stamp: str | None) -> None:
        """The stamp read before a full read whose entries are now the cursor's (read before,
        so a record added in between makes the next stamp differ, never the same)."""
        if stamp is None:
            self._stamps.pop(bmc_id, None)
        else:
            self._stamps[bmc_id] = (stamp, 0)

    async def read_schedulers(self, machines: list[InUse]) -> None:
        """The scheduler's word on each node of the tenants whose control plane runs here:
        one ``node_states`` call per tenant where the scheduler has it (Slurm), else one
        ``node_state`` per node. Nodes under remediation are left out (drained by it)."""
        if self.scheduler_for is None:
            return
        busy = await self.store.read(_open_remediation_machines)
        # A clear is written only where the scheduler has a fault open (no write per node).
        open_faults = await self.store.read(_scheduler_faulted)
        by_tenant: dict[str, list[InUse]] = {}
        for u in machines:
            watched = u.machine_id not in busy or u.machine_id in open_faults
            if u.tenant_id is not None and watched:
                by_tenant.setdefault(u.tenant_id, []).append(u)
        for tenant_id, us in sorted(by_tenant.items()):
            if not self._owns_hub(tenant_id):
                continue
            sched = self.scheduler_for(tenant_id)
            if sched is None:
                continue
            try:
                bulk = getattr(sched, "node_states", None)
                states = await asyncio.to_thread(bulk) if bulk is not None else None
            except SchedulerError as e:
                log.info("health: tenant %s: %s", tenant_id, e)
                continue
            now = self.clock()
            for u in us:
                node = hostname(u.machine_id, u.name)
                if states is not None:
                    st = states.get(node)
                else:
                    try:
                        st = await asyncio.to_thread(sched.node_state, node)
                    except SchedulerError as e:
                        log.info("health: node %s: %s", node, e)
                        continue
                sig = None if st is None else state_signal(node, st, now)
                if st is not None and st.state in _RESPONDING_DRAINED:
                    # drained (by the remediation) and answering: no longer down
                    sig = Signal(Kind.SCHEDULER_STATE, Witness.SCHEDULER, "node", OK, now,
                                 f"scheduler: node {node} {st.raw or st.state}")  # fmt: skip
                if sig is not None and (not sig.is_clear or u.machine_id in open_faults):
                    await self.store.run(record_signals, u.machine_id, [sig], cfg=self.cfg,
                                         table=self.table, now=now, actor=self.actor,
                                         instance=self.instance)  # fmt: skip
