"""The registered BMCs: register (connect first, then store), link to machines, remove, list.

Registration connects only to an allowed target (``metald.bmc.targets``) and, when that fails,
answers one fixed sentence naming the failed step, never what the peer said, and only once the
verification deadline (``[bmc] verify_s``) has passed, so neither the answer nor its timing
tells a closed port from a silent one or from a service that is not a BMC. ``verify=False``
stores a BMC that does not answer yet (a rack staged before it is cabled) as ``unreachable``;
its owning instance's power sync verifies it once it answers (``record_identity``).

Owns the ``bmcs`` rows' identity and links. Credentials are stored encrypted
(``metald.secrets``) and only ever decrypted into a driver's endpoint; every dict built here
goes through ``public`` and so carries no secret.

Which machine a BMC manages is decided by one rule, ``identity_match``: the BMC's system UUID
(in every byte order an IPMI GUID may come in), then its serial, then one of its MACs, against
the machine's. Registration (BMC first known) and enrollment (machine first known) both use it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, cast, func, or_
from sqlalchemy import delete as sa_delete
from sqlmodel import Session, col, select

from metald.bmc import targets
from metald.bmc.base import BmcAuthError, BmcEndpoint, BmcError, SystemIdentity
from metald.bmc.executor import BmcExecutor, get_bmc
from metald.bmc.ipmi import guid_readings
from metald.bmc.links import LINK_PROBE
from metald.bmc.scheduler import Health
from metald.errors import Conflict, Unprocessable
from metald.machines import add_event, get_machine, normalize_mac
from metald.store.db import Store
from metald.store.models import (
    Bmc,
    BmcEventSubscription,
    BmcLogCursor,
    FirmwareUpdate,
    Machine,
    Nic,
    utcnow,
)

PROTOCOLS = ("ipmi", "redfish", "auto")
#: health_detail of a BMC registered with verify=False until its owner has heard from it.
NOT_VERIFIED = "registered without verification: its owning instance verifies it once it answers"


# --- the matching rule (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class BmcIdentity:
    """What a BMC says about its host, in the forms a machine's own identity is compared with."""

    uuids: frozenset[str]
    serial: str | None
    macs: frozenset[str]

    @classmethod
    def of(cls, row: Bmc, extra_uuids: Iterable[str] = ()) -> BmcIdentity:
        return cls(
            uuids=frozenset(uuid_variants(row.system_uuid) | {u.lower() for u in extra_uuids}),
            serial=row.serial or None,
            macs=frozenset(row.macs or ()),
        )


def identity_match(
    bmc: BmcIdentity, system_uuid: str | None, serial: str | None, macs: Iterable[str]
) -> str | None:
    """How a machine matches a BMC ("system-uuid", "serial", "mac"), or None."""
    if system_uuid and system_uuid.lower() in bmc.uuids:
        return "system-uuid"
    if serial and bmc.serial == serial:
        return "serial"
    if bmc.macs & set(macs):
        return "mac"
    return None


def uuid_variants(stored: str | None) -> set[str]:
    """Every reading of a stored BMC UUID: IPMI GUIDs come in three byte orders (see
    ipmi.guid_readings), and only one was stored at registration."""
    if not stored:
        return set()
    try:
        guid = bytes(reversed(uuid.UUID(stored).bytes))
    except ValueError:
        return {stored.lower()}
    return {stored.lower(), *(u.lower() for u in guid_readings(guid))}


def uuid_sources(system_uuid: str | None) -> set[str]:
    """Every stored BMC UUID (lower case) one of whose readings (``uuid_variants``) is this
    machine UUID: the inverse of ``uuid_variants``, for finding candidates in SQL."""
    if not system_uuid:
        return set()
    low = system_uuid.lower()
    try:
        u = uuid.UUID(low)
    except ValueError:
        return {low}
    # variants(s) = {s, R(s), M(R(s))} (R: bytes reversed, M: the mixed-endian reading), so
    # s is u, R(u) or R(M^-1(u)) = R(bytes_le of u).
    return {
        low,
        str(uuid.UUID(bytes=bytes(reversed(u.bytes)))),
        str(uuid.UUID(bytes=bytes(reversed(u.bytes_le)))),
    }


_PRIORITY = {"system-uuid": 0, "serial": 1, "mac": 2}


def match_machine(s: Session, row: Bmc, uuid_candidates: list[str]) -> tuple[str | None, str]:
    """The machine this BMC manages (SQL narrows the candidates, ``identity_match`` decides)."""
    ident = BmcIdentity.of(row, uuid_candidates)
    conds = []
    if ident.uuids:
        conds.append(func.lower(Machine.system_uuid).in_(ident.uuids))  # type: ignore[arg-type]
    if ident.serial:
        conds.append(Machine.serial == ident.serial)
    if ident.macs:
        conds.append(
            Machine.id.in_(select(Nic.machine_id).where(Nic.mac.in_(ident.macs)))  # type: ignore[attr-defined]
        )
    if not conds:
        return None, ""
    best: tuple[int, str, str] | None = None
    for m in s.exec(select(Machine).where(or_(*conds))).all():
        macs = s.exec(select(Nic.mac).where(Nic.machine_id == m.id)).all()
        how = identity_match(ident, m.system_uuid, m.serial, macs)
        if how is not None and (best is None or (_PRIORITY[how], m.id) < best[:2]):
            best = (_PRIORITY[how], m.id, how)
    return (best[1], best[2]) if best else (None, "")


def link_by_identity_in(
    s: Session, machine_id: str, actor: str, instance: str, *, probed: bool = False
) -> Bmc | None:
    """In the caller's transaction (it commits): link an unlinked BMC whose identity matches
    this machine's (inventory that arrives after the BMC was registered). Returns the BMC, or
    None. The inventory's use case calls it in the transaction that accepts the inventory, so
    an instance killed between the two cannot leave a ready machine without its BMC.
    ``probed``: the caller's own ``link_probe`` already found it unlinked, with a BMC free."""
    # Unless the caller probed, one Core probe first: the machine exists (else NotFound, below), has no BMC yet,
    # and some BMC is unlinked at all. In a power-on storm no BMC is unlinked, and the
    # probe is all a machine's inventory costs here (not four ORM reads).
    if not probed:
        probe = s.connection().execute(LINK_PROBE, {"m": machine_id}).first()
        if probe is not None and (probe.linked or not probe.unlinked):
            return None
    m = get_machine(s, machine_id)
    if s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first():
        return None
    macs = list(s.exec(select(Nic.mac).where(Nic.machine_id == machine_id)).all())
    # Only the rows that can match are read (not every unlinked BMC per inventory:
    # quadratic in an enrollment storm), in identity_match's order: the system UUID and
    # the serial through their indexes (0040), the MACs (a scan of the unlinked rows'
    # JSON) only when neither found one. One OR of the three scanned every unlinked row
    # per inventory: at 10,000 BMCs registered ahead, PostgreSQL's CPU per machine grew
    # with the fleet. identity_match still decides.
    tries = [func.lower(Bmc.system_uuid).in_(sorted(uuid_sources(m.system_uuid)))]
    if m.serial:
        tries.append(Bmc.serial == m.serial)
    if macs:
        tries.append(or_(*(cast(Bmc.macs, String).contains(mac) for mac in macs)))
    rows: list[Bmc] = []
    for could in tries:
        rows = list(s.exec(select(Bmc).where(Bmc.machine_id.is_(None), could)).all())  # type: ignore[union-attr]
        if rows:
            break
    for row in rows:
        if identity_match(BmcIdentity.of(row), m.system_uuid, m.serial, macs) is None:
            continue
        row.machine_id = machine_id
        s.add(row)
        add_event(
            s,
            "bmc.linked",
            actor,
            machine_id=machine_id,
            instance=instance,
            data={"bmc_id": row.id, "by": "identity"},
        )
        return row
    return None


# --- the registry ---------------------------------------------------------------------------


class BmcRegistry:
    def __init__(self, store: Store, control: BmcExecutor, instance: str) -> None:
        self.store = store
        self.control = control
        self.instance = instance

    async def register(
        self,
        address: str,
        port: int | None,
        protocol: str,
        username: str,
        password: str,
        machine_id: str | None = None,
        verify_tls: bool = True,
        ca_cert: str | None = None,
        actor: str = "system",
        *,
        verify: bool = True,
        own_listeners: Iterable[tuple[str, int]] = (),
    ) -> Bmc:
        """Connect with the credentials, then store the BMC and link it to its machine
        (``verify=False``: store it as unreachable without connecting)."""
        address = (address or "").strip()
        if not address:
            raise Unprocessable("address is required (a host name, an IP, or a Redfish URL)")
        if protocol not in PROTOCOLS:
            raise Unprocessable(f"protocol must be one of {', '.join(PROTOCOLS)}, not {protocol!r}")
        if port is not None and not 0 < port < 65536:
            raise Unprocessable(f"port {port} is out of range 1-65535")
        if not username:
            raise Unprocessable("username is required")
        if ca_cert is not None and "BEGIN CERTIFICATE" not in ca_cert:
            raise Unprocessable("ca_cert must be a PEM certificate")
        if machine_id is not None:

            def has_bmc(s: Session) -> Bmc | None:
                get_machine(s, machine_id)
                return s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first()

            if (other := await self.store.run(has_bmc)) is not None:
                raise Conflict(
                    f"machine {machine_id} already has BMC {other.id}; unlink it first",
                    bmc_id=other.id,
                )

        def taken(s: Session) -> Bmc | None:
            return s.exec(select(Bmc).where(Bmc.address == address, Bmc.port == port)).first()

        if (existing := await self.store.run(taken)) is not None:
            raise Conflict(
                f"a BMC at {address}:{port} is already registered (id {existing.id})",
                bmc_id=existing.id,
            )

        await targets.check(address, port, protocol, self.control.cfg.networks, own_listeners)
        tried = ["redfish", "ipmi"] if protocol == "auto" else [protocol]
        if protocol == "auto" and address.startswith(("http://", "https://")):
            tried = ["redfish"]
        if not verify:
            if len(tried) > 1:
                raise Unprocessable(
                    "a BMC registered without verifying it needs its protocol: send protocol "
                    '"ipmi" or "redfish" (auto is decided by asking the BMC)'
                )
            staged = Bmc(
                address=address,
                port=port,
                protocol=tried[0],
                username=username,
                password_enc=self.control.secrets.encrypt(password),
                verify_tls=verify_tls,
                ca_cert=ca_cert,
                health=Health.UNREACHABLE.value,
                health_detail=NOT_VERIFIED,
                macs=[],
            )
            return await self.store.run(self._insert, staged, machine_id, [], actor)
        ep = BmcEndpoint(address, port, username, password, verify_tls, ca_cert)
        ident: SystemIdentity | None = None
        used, step = "", "identify"
        scheduler = self.control.scheduler
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.control.cfg.verify_s
        try:
            async with asyncio.timeout_at(deadline):
                for proto in tried:
                    driver = self.control.make_driver(proto, ep)
                    key = f"register:{uuid.uuid4()}"
                    try:
                        ident = await scheduler.run(key, driver.identify, name="identify")
                        used = proto
                        break
                    except BmcAuthError:
                        await driver.close()
                        step = "login"
                        break
                    except BmcError:
                        await driver.close()
                    except BaseException:  # a bug, a cancel, the deadline: still close it
                        await driver.close()
                        raise
                    finally:
                        scheduler.forget(key)
        except TimeoutError:
            ident = None
        if ident is None:
            # Whatever failed and however fast: the same sentence, at the same time.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise Unprocessable(
                f"could not verify the BMC at {address}: the {step} step did not succeed "
                f"({' then '.join(tried)}). Check the address, port, protocol, user name and "
                "password, and that metald reaches the BMC's network; to register a BMC that "
                "does not answer yet, send verify: false (stored as unreachable, verified by "
                "its owning instance once it answers)",
                step=step,
                tried=tried,
            )
        row = Bmc(
            address=address,
            port=port,
            protocol=used,
            username=username,
            password_enc=self.control.secrets.encrypt(password),
            verify_tls=verify_tls,
            ca_cert=ca_cert,
            health=Health.OK.value,
            system_uuid=ident.system_uuid,
            serial=ident.serial,
            macs=[normalize_mac(m) for m in ident.macs],
            last_seen_at=utcnow(),
        )
        candidates = ident.extra.get("uuid_candidates", [])
        try:
            saved = await self.store.run(self._insert, row, machine_id, candidates, actor)
        except BaseException:
            await driver.close()
            raise
        self.control.seed_health(saved.id, driver)
        return saved

    def _insert(
        self, s: Session, row: Bmc, machine_id: str | None, uuid_candidates: list[str], actor: str
    ) -> Bmc:
        how = "by hand"
        if machine_id is None:
            machine_id, how = match_machine(s, row, uuid_candidates)
        if (
            machine_id is not None
            and s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first()
        ):
            if how == "by hand":
                raise Conflict(f"machine {machine_id} already has a BMC; unlink it first")
            machine_id = None  # matched, but that machine already has a BMC: leave it to a human
        row.machine_id = machine_id
        s.add(row)
        s.flush()
        add_event(
            s,
            "bmc.registered",
            actor,
            machine_id=machine_id,
            instance=self.instance,
            data={
                "bmc_id": row.id,
                "address": row.address,
                "protocol": row.protocol,
                "linked": how if machine_id else None,
            },
        )
        s.commit()
        return row

    async def link(self, bmc_id: str, machine_id: str | None, actor: str = "system") -> Bmc:
        """Link the BMC to a machine by hand (``None`` unlinks)."""

        def do(s: Session) -> Bmc:
            row = get_bmc(s, bmc_id)
            if machine_id is not None:
                get_machine(s, machine_id)
                other = s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first()
                if other is not None and other.id != bmc_id:
                    raise Conflict(
                        f"machine {machine_id} already has BMC {other.id}; unlink it first"
                    )
            old = row.machine_id
            row.machine_id = machine_id
            s.add(row)
            add_event(
                s,
                "bmc.linked" if machine_id else "bmc.unlinked",
                actor,
                machine_id=machine_id or old,
                instance=self.instance,
                data={"bmc_id": bmc_id, "previous_machine_id": old},
            )
            s.commit()
            return row

        return await self.store.run(do)

    async def link_by_identity(self, machine_id: str, actor: str = "system") -> Bmc | None:
        """Link an unlinked BMC whose identity matches this machine's, in a transaction of its
        own (``link_by_identity_in``). Returns the BMC, or None."""

        def do(s: Session) -> Bmc | None:
            row = link_by_identity_in(s, machine_id, actor, self.instance)
            if row is not None:
                s.commit()
            return row

        return await self.store.run(do)

    async def remove(self, bmc_id: str, actor: str = "system") -> None:
        def do(s: Session) -> None:
            row = get_bmc(s, bmc_id)
            busy = s.exec(
                select(FirmwareUpdate.id).where(
                    FirmwareUpdate.bmc_id == bmc_id,
                    col(FirmwareUpdate.phase).notin_(["done", "failed"]),
                )
            ).first()
            if busy is not None:
                raise Conflict(
                    f"BMC {bmc_id} is in the middle of a firmware update ({busy}); remove it "
                    "once the update has ended (GET /api/v1/machines/{id}/firmware/updates)"
                )
            add_event(
                s,
                "bmc.removed",
                actor,
                machine_id=row.machine_id,
                instance=self.instance,
                data={"bmc_id": bmc_id, "address": row.address},
            )
            # what the health watch kept for this BMC goes with it
            for kept in (BmcEventSubscription, BmcLogCursor):
                s.execute(sa_delete(kept).where(col(kept.bmc_id) == bmc_id))
            s.delete(row)
            s.commit()

        await self.store.run(do)
        await self.control.forget(bmc_id)

    async def list(self) -> list[Bmc]:
        def do(s: Session) -> list[Bmc]:
            return list(s.exec(select(Bmc).order_by(Bmc.created_at)).all())

        return await self.store.run(do)

    async def get(self, bmc_id: str) -> Bmc:
        return await self.store.run(get_bmc, bmc_id)


def record_identity(s: Session, bmc_id: str, ident: SystemIdentity, instance: str) -> Bmc:
    """A BMC registered without verification answered its owner: keep what it says about its
    host and link it to its machine by the same rule as registration."""
    row = get_bmc(s, bmc_id)
    row.system_uuid, row.serial = ident.system_uuid, ident.serial
    row.macs = [normalize_mac(m) for m in ident.macs]
    row.last_seen_at = row.last_seen_at or utcnow()
    if row.health_detail == NOT_VERIFIED:
        row.health_detail = None
    how = None
    if row.machine_id is None:
        machine_id, how = match_machine(s, row, ident.extra.get("uuid_candidates", []))
        if machine_id and not s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first():
            row.machine_id = machine_id
        else:
            how = None
    s.add(row)
    add_event(
        s,
        "bmc.verified",
        "system",
        machine_id=row.machine_id,
        instance=instance,
        data={"bmc_id": row.id, "address": row.address, "linked": how},
    )
    s.commit()
    return row


def public(row: Bmc) -> dict[str, Any]:
    """The BMC as the API shows it: never the password, never the ciphertext."""
    return {
        "id": row.id,
        "machine_id": row.machine_id,
        "address": row.address,
        "port": row.port,
        "protocol": row.protocol,
        "username": row.username,
        "verify_tls": row.verify_tls,
        "ca_pinned": bool(row.ca_cert),
        "health": row.health,
        "health_detail": row.health_detail,
        "power_state": row.power_state,
        "system_uuid": row.system_uuid,
        "serial": row.serial,
        "macs": list(row.macs or []),
        "last_seen_at": row.last_seen_at.isoformat() if row.last_seen_at else None,
        "created_at": row.created_at.isoformat() if row.created_at else None,
    }
