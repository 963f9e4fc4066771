"""BMC control as metald sees it: registered BMCs, linked to machines, driven through the scheduler.

Owns the ``bmcs`` rows. Registration connects before it stores anything; credentials are stored
encrypted (``metald.secrets``) and only ever decrypted into a driver's endpoint. Every dict this
service returns is built by ``_public`` and so carries no secret. A periodic loop reads every
BMC's power state; a change nobody asked for becomes a ``bmc.power-drift`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Protocol

from sqlalchemy import func, update
from sqlmodel import Session, select

from metald.bmc.base import (
    BmcAuthError,
    BmcDriver,
    BmcEndpoint,
    BmcError,
    BmcUnsupported,
    BootDevice,
    BootTarget,
    PowerAction,
    PowerState,
    SystemIdentity,
)
from metald.bmc.ipmi import IpmiDriver, guid_readings
from metald.bmc.redfish import RedfishDriver
from metald.bmc.scheduler import BmcScheduler, Health
from metald.config import BmcConfig
from metald.errors import Conflict, MetaldError, NotFound, Unprocessable
from metald.machines import add_event, get_machine, normalize_mac
from metald.secrets import SecretBox
from metald.service import cancel
from metald.store.db import Store
from metald.store.models import Bmc, Machine, Nic, utcnow

log = logging.getLogger(__name__)

PROTOCOLS = ("ipmi", "redfish", "auto")


class BmcCommandFailed(MetaldError):
    """The BMC did not do what was asked (unreachable, refused, errored). Maps to 502."""

    status = 502
    title = "BMC command failed"


class BmcOwnership(Protocol):
    """Which instance owns a BMC (metald.fleet.membership.Membership)."""

    def owns_bmc(self, bmc_id: str, address: str) -> bool: ...

    def bmc_owner(self, bmc_id: str, address: str) -> str | None: ...


class BmcService:
    name = "bmc"

    def __init__(self, store: Store, secrets: SecretBox, cfg: BmcConfig, instance: str) -> None:
        self.store = store
        self.secrets = secrets
        self.cfg = cfg
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.scheduler = BmcScheduler(
            max_concurrency=cfg.max_concurrency,
            min_interval_s=cfg.min_interval_ms / 1000,
            timeout_s=cfg.timeout_s,
            retries=cfg.retries,
            backoff_base_s=cfg.backoff_base_ms / 1000,
            backoff_cap_s=cfg.backoff_max_s,
        )
        self._drivers: dict[str, BmcDriver] = {}
        self._persisted: dict[str, tuple[str, str | None]] = {}
        #: bmc id -> (expected power state, until when a different reading is not drift).
        self._expected: dict[str, tuple[str, float]] = {}
        self._sync_task: asyncio.Task[None] | None = None
        #: Fleet membership (metald.fleet.membership.Membership); None: this instance owns every
        #: BMC (one instance, or a test without a fleet).
        self.ownership: BmcOwnership | None = None

    def owns(self, row: Bmc) -> bool:
        return self.ownership is None or self.ownership.owns_bmc(row.id, row.address)

    def owner_of(self, row: Bmc) -> str | None:
        return (
            self.instance
            if self.ownership is None
            else self.ownership.bmc_owner(row.id, row.address)
        )

    def _public(self, row: Bmc) -> dict[str, Any]:
        return {**_public(row), "owner_instance": self.owner_of(row)}

    # --- lifecycle ---

    async def start(self) -> None:
        if self.cfg.power_sync_interval_s > 0:
            self._sync_task = asyncio.create_task(self._sync_loop(), name="bmc-power-sync")

    async def stop(self) -> None:
        await cancel(self._sync_task)
        self._sync_task = None
        drivers, self._drivers = list(self._drivers.values()), {}
        for d in drivers:
            with contextlib.suppress(Exception):
                await d.close()

    # --- drivers ---

    def _make_driver(self, protocol: str, ep: BmcEndpoint) -> BmcDriver:
        # The per-request deadline sits just inside the scheduler's, so the driver names the cause.
        inner = max(0.1, self.cfg.timeout_s * 0.9)
        if protocol == "ipmi":
            return IpmiDriver(ep, request_timeout_s=inner, resend_s=self.cfg.ipmi_resend_ms / 1000)
        scheme, host = _split_scheme(ep.address)
        ep2 = BmcEndpoint(host, ep.port, ep.username, ep.password, ep.verify_tls, ep.ca_cert)
        return RedfishDriver(ep2, scheme=scheme, request_timeout_s=inner)

    def _driver_for(self, row: Bmc) -> BmcDriver:
        d = self._drivers.get(row.id)
        if d is None:
            ep = BmcEndpoint(
                row.address,
                row.port,
                row.username,
                self.secrets.decrypt(row.password_enc),
                row.verify_tls,
                row.ca_cert,
            )
            d = self._drivers[row.id] = self._make_driver(row.protocol, ep)
        return d

    async def _run(
        self,
        row: Bmc,
        op_name: str,
        fn: Any,
        *,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        driver = self._driver_for(row)
        try:
            return await self.scheduler.run(
                row.id, lambda: fn(driver), name=op_name, idempotent=idempotent, timeout_s=timeout_s
            )
        finally:
            await self._persist_health(row.id)

    async def _persist_health(self, bmc_id: str) -> None:
        health, detail = self.scheduler.health(bmc_id)
        if health is Health.UNKNOWN or self._persisted.get(bmc_id) == (health.value, detail):
            return
        self._persisted[bmc_id] = (health.value, detail)
        values: dict[str, Any] = {"health": health.value, "health_detail": detail}
        if health is Health.OK:
            values["last_seen_at"] = utcnow()

        def write(s: Session) -> None:
            s.execute(update(Bmc).where(Bmc.id == bmc_id).values(**values))  # type: ignore[arg-type]
            s.commit()

        await self.store.run(write)

    # --- registration ---

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
    ) -> dict[str, Any]:
        """Connect with the credentials, then store the BMC and link it to its machine."""
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

        ep = BmcEndpoint(address, port, username, password, verify_tls, ca_cert)
        tried = ["redfish", "ipmi"] if protocol == "auto" else [protocol]
        if protocol == "auto" and address.startswith(("http://", "https://")):
            tried = ["redfish"]
        failures: list[str] = []
        ident: SystemIdentity | None = None
        used = ""
        for proto in tried:
            driver = self._make_driver(proto, ep)
            key = f"register:{uuid.uuid4()}"
            try:
                ident = await self.scheduler.run(key, driver.identify, name="identify")
                used = proto
                break
            except BmcAuthError as e:
                await driver.close()
                raise Unprocessable(
                    f"the BMC at {address} refused these credentials ({proto}): {_cause(e)}; "
                    "check the user name and password",
                    protocol=proto,
                ) from None
            except BmcError as e:
                failures.append(f"{proto}: {_cause(e)}")
                await driver.close()
            except BaseException:  # a bug or a cancel: still close the driver's client session
                await driver.close()
                raise
            finally:
                self.scheduler.forget(key)
        if ident is None:
            raise Unprocessable(
                f"could not talk to a BMC at {address}: " + "; ".join(failures), tried=tried
            )
        row = Bmc(
            address=address,
            port=port,
            protocol=used,
            username=username,
            password_enc=self.secrets.encrypt(password),
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
        self._drivers[saved.id] = driver
        self._persisted[saved.id] = (Health.OK.value, None)
        return _public(saved)

    def _insert(
        self, s: Session, row: Bmc, machine_id: str | None, uuid_candidates: list[str], actor: str
    ) -> Bmc:
        how = "by hand"
        if machine_id is None:
            machine_id, how = _match_machine(s, row, uuid_candidates)
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

    async def link(
        self, bmc_id: str, machine_id: str | None, actor: str = "system"
    ) -> dict[str, Any]:
        """Link the BMC to a machine by hand (``None`` unlinks)."""

        def do(s: Session) -> Bmc:
            row = _get_bmc(s, bmc_id)
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

        return _public(await self.store.run(do))

    async def link_by_identity(
        self, machine_id: str, actor: str = "system"
    ) -> dict[str, Any] | None:
        """Link an unlinked BMC whose system UUID, serial or MAC matches this machine (called
        when inventory arrives after the BMC was registered). Returns the BMC, or None."""

        def do(s: Session) -> Bmc | None:
            m = get_machine(s, machine_id)
            if s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first():
                return None
            macs = set(s.exec(select(Nic.mac).where(Nic.machine_id == machine_id)).all())
            for row in s.exec(select(Bmc).where(Bmc.machine_id.is_(None))).all():  # type: ignore[union-attr]
                if (
                    (m.system_uuid and m.system_uuid.lower() in _uuid_variants(row.system_uuid))
                    or (m.serial and row.serial == m.serial)
                    or macs & set(row.macs)
                ):
                    row.machine_id = machine_id
                    s.add(row)
                    add_event(
                        s,
                        "bmc.linked",
                        actor,
                        machine_id=machine_id,
                        instance=self.instance,
                        data={"bmc_id": row.id, "by": "identity"},
                    )
                    s.commit()
                    return row
            return None

        row = await self.store.run(do)
        return _public(row) if row else None

    async def remove(self, bmc_id: str, actor: str = "system") -> None:
        def do(s: Session) -> None:
            row = _get_bmc(s, bmc_id)
            add_event(
                s,
                "bmc.removed",
                actor,
                machine_id=row.machine_id,
                instance=self.instance,
                data={"bmc_id": bmc_id, "address": row.address},
            )
            s.delete(row)
            s.commit()

        await self.store.run(do)
        if (d := self._drivers.pop(bmc_id, None)) is not None:
            await d.close()
        self.scheduler.forget(bmc_id)

    async def list(self) -> list[dict[str, Any]]:
        def do(s: Session) -> list[Bmc]:
            return list(s.exec(select(Bmc).order_by(Bmc.created_at)).all())

        return [self._public(r) for r in await self.store.run(do)]

    async def get(self, bmc_id: str) -> dict[str, Any]:
        return self._public(await self.store.run(_get_bmc, bmc_id))

    # --- commands ---

    async def _row_for_machine(self, machine_id: str) -> Bmc:
        def do(s: Session) -> Bmc:
            get_machine(s, machine_id)
            row = s.exec(select(Bmc).where(Bmc.machine_id == machine_id)).first()
            if row is None:
                raise NotFound(
                    f"machine {machine_id} has no BMC; register one with "
                    "POST /api/v1/bmcs or link one by hand"
                )
            return row

        return await self.store.run(do)

    async def power(self, machine_id: str, action: str, actor: str = "system") -> dict[str, Any]:
        """Run a power action (on, off, cycle, soft-off) or ``status``; returns the state."""
        row = await self._row_for_machine(machine_id)
        return await self._power(row, machine_id, action, actor)

    async def power_bmc(self, bmc_id: str, action: str, actor: str = "system") -> dict[str, Any]:
        """The same through the BMC itself: powers on hosts that have not enrolled yet (their
        machine appears when they PXE-boot, and the BMC is then linked by identity)."""
        row = await self.store.run(_get_bmc, bmc_id)
        return await self._power(row, row.machine_id, action, actor)

    async def _power(
        self, row: Bmc, machine_id: str | None, action: str, actor: str
    ) -> dict[str, Any]:
        if action == "status":
            state = await self._command(row, "get_power", lambda d: d.get_power())
            await self._record_power(row, state.value, drift_check=False)
            return {"machine_id": machine_id, "bmc_id": row.id, "power_state": state.value}
        try:
            act = PowerAction(action)
        except ValueError:
            raise Unprocessable(
                f"unknown power action {action!r}; use one of status, "
                + ", ".join(a.value for a in PowerAction)
            ) from None
        expect = PowerState.OFF if act in (PowerAction.OFF, PowerAction.SOFT_OFF) else PowerState.ON
        # Expected before it is sent, so a sync reading in between is not reported as drift.
        self._expected[row.id] = (expect.value, time.monotonic() + self.cfg.drift_grace_s)
        await self._command(
            row,
            f"power_{act.value}",
            lambda d: d.set_power(act),
            idempotent=act not in (PowerAction.CYCLE, PowerAction.RESET),
        )

        def record(s: Session) -> None:
            add_event(
                s,
                "bmc.power",
                actor,
                machine_id=machine_id,
                instance=self.instance,
                data={"bmc_id": row.id, "action": act.value},
            )
            _set_power(s, row.id, machine_id, expect.value)
            s.commit()

        await self.store.run(record)
        return {
            "machine_id": machine_id,
            "bmc_id": row.id,
            "action": act.value,
            "power_state": expect.value,
        }

    async def set_boot_device(
        self,
        machine_id: str,
        device: str,
        persistent: bool = False,
        uefi: bool | None = True,
        actor: str = "system",
    ) -> dict[str, Any]:
        try:
            target = BootTarget(device)
        except ValueError:
            raise Unprocessable(f"boot device must be pxe or disk, not {device!r}") from None
        row = await self._row_for_machine(machine_id)
        boot = BootDevice(target, bool(persistent), None if uefi is None else bool(uefi))
        await self._command(row, "set_boot_device", lambda d: d.set_boot_device(boot))

        def record(s: Session) -> None:
            add_event(
                s,
                "bmc.boot-device",
                actor,
                machine_id=machine_id,
                instance=self.instance,
                data={
                    "bmc_id": row.id,
                    "device": target.value,
                    "persistent": boot.persistent,
                    "uefi": boot.uefi,
                },
            )
            s.commit()

        await self.store.run(record)
        return {
            "machine_id": machine_id,
            "device": target.value,
            "persistent": boot.persistent,
            "uefi": boot.uefi,
        }

    async def sensors(self, machine_id: str) -> list[dict[str, Any]]:
        row = await self._row_for_machine(machine_id)
        sensors = await self._command(
            row, "sensors", lambda d: d.sensors(), timeout_s=self.cfg.sensors_timeout_s
        )
        return [
            {"name": x.name, "kind": x.kind, "value": x.value, "units": x.unit, "health": x.health}
            for x in sensors
        ]

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]:
        row = await self._row_for_machine(machine_id)
        entries = await self._command(
            row, "event_log", lambda d: d.event_log(), timeout_s=self.cfg.sensors_timeout_s
        )
        return [
            {
                "id": e.id,
                "at": e.at.isoformat() if e.at else None,
                "severity": e.severity,
                "message": e.message,
            }
            for e in entries
        ]

    async def _command(
        self,
        row: Bmc,
        name: str,
        fn: Any,
        *,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> Any:
        try:
            return await self._run(row, name, fn, idempotent=idempotent, timeout_s=timeout_s)
        except BmcUnsupported as e:
            raise Unprocessable(f"{_cause(e)}", bmc_id=row.id) from None
        except BmcError as e:
            health, _ = self.scheduler.health(row.id)
            hint = {
                Health.AUTH_FAILED: "; update the BMC's credentials",
                Health.UNREACHABLE: "; check the BMC's network and address",
            }.get(health, "")
            raise BmcCommandFailed(
                f"{name} on BMC {row.id} failed: {_cause(e)}{hint}",
                bmc_id=row.id,
                health=health.value,
            ) from None

    # --- power sync ---

    async def _sync_loop(self) -> None:
        while True:
            try:
                await self.sync_power_once()
            except Exception:
                log.exception("BMC power sync round failed")
            await asyncio.sleep(self.cfg.power_sync_interval_s)

    async def sync_power_once(self) -> int:
        """Read the power state of every BMC this instance owns (skipping auth-failed ones:
        retrying locks accounts); returns how many drifted. With several instances each BMC is
        read by its owner only."""

        def rows(s: Session) -> list[Bmc]:
            return list(s.exec(select(Bmc).where(Bmc.health != Health.AUTH_FAILED.value)).all())

        async def one(row: Bmc) -> bool:
            try:
                state = await self._run(row, "sync_power", lambda d: d.get_power())
            except BmcError as e:
                log.debug("power sync of BMC %s failed: %s", row.id, _cause(e))
                return False
            return await self._record_power(row, state.value, drift_check=True)

        owned = [r for r in await self.store.run(rows) if self.owns(r)]
        results = await asyncio.gather(*(one(r) for r in owned))
        return sum(results)

    async def _record_power(self, row: Bmc, observed: str, *, drift_check: bool) -> bool:
        expected = self._expected.get(row.id)
        in_grace = expected is not None and time.monotonic() < expected[1]
        if expected is not None and not in_grace:
            self._expected.pop(row.id, None)

        def do(s: Session) -> bool:
            current = s.get(Bmc, row.id)
            if current is None:
                return False
            before = current.power_state
            if before == observed:
                return False
            drift = drift_check and before is not None and not in_grace
            if drift:
                add_event(
                    s,
                    "bmc.power-drift",
                    self.actor,
                    machine_id=current.machine_id,
                    from_state=before,
                    to_state=observed,
                    instance=self.instance,
                    reason="power state changed without a metald command",
                    data={"bmc_id": row.id},
                )
            _set_power(s, row.id, current.machine_id, observed)
            s.commit()
            return drift

        return await self.store.run(do)


def _set_power(s: Session, bmc_id: str, machine_id: str | None, state: str) -> None:
    # power_state is an observation, not a lifecycle change: no version bump, so it never makes a
    # concurrent lifecycle writer fail its compare-and-swap.
    s.execute(update(Bmc).where(Bmc.id == bmc_id).values(power_state=state))  # type: ignore[arg-type]
    if machine_id:
        s.execute(
            update(Machine)
            .where(Machine.id == machine_id)  # type: ignore[arg-type]
            .values(power_state=state)
        )


def _get_bmc(s: Session, bmc_id: str) -> Bmc:
    row = s.get(Bmc, bmc_id)
    if row is None:
        raise NotFound(f"no BMC with id {bmc_id!r}")
    return row


def _uuid_variants(stored: str | None) -> set[str]:
    """Every reading of a stored BMC UUID: IPMI GUIDs come in three byte orders (see
    ipmi.guid_readings), and only one was stored at registration."""
    if not stored:
        return set()
    try:
        guid = bytes(reversed(uuid.UUID(stored).bytes))
    except ValueError:
        return {stored.lower()}
    return {stored.lower(), *(u.lower() for u in guid_readings(guid))}


def _match_machine(s: Session, row: Bmc, uuid_candidates: list[str]) -> tuple[str | None, str]:
    """The machine this BMC manages, by system UUID, then serial, then MAC."""
    uuids = {u.lower() for u in [row.system_uuid, *uuid_candidates] if u}
    if uuids:
        m = s.exec(select(Machine).where(func.lower(Machine.system_uuid).in_(uuids))).first()  # type: ignore[arg-type]
        if m:
            return m.id, "system-uuid"
    if row.serial:
        m = s.exec(select(Machine).where(Machine.serial == row.serial)).first()
        if m:
            return m.id, "serial"
    if row.macs:
        nic = s.exec(select(Nic).where(Nic.mac.in_(row.macs))).first()  # type: ignore[attr-defined]
        if nic:
            return nic.machine_id, "mac"
    return None, ""


def _public(row: Bmc) -> dict[str, Any]:
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


def _split_scheme(address: str) -> tuple[str, str]:
    for scheme in ("https", "http"):
        if address.startswith(scheme + "://"):
            return scheme, address[len(scheme) + 3 :].rstrip("/")
    return "https", address


def _cause(e: BaseException) -> str:
    return str(e) or type(e).__name__
