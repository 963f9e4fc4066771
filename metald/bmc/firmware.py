"""Firmware inventory and BIOS settings of a machine, read (and BIOS staged) through its BMC.

Firmware versions (Redfish ``UpdateService/FirmwareInventory``) are recorded on the machine
(``firmware_versions``: id -> version), next to its inventory, so claims can select by them.
BIOS settings: the enroll rules give a machine a desired profile (``bios.desired``); metald
stages what differs as pending settings (``Bios/Settings``), which the firmware applies at
the next reboot (commissioning and provisioning reboot anyway). A desired attribute the
firmware neither has nor has pending is drift: recorded on the machine (``bios.drift``) and
reported as a ``bmc.bios-drift`` event when it changes. Nothing is flashed.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session

from metald.bmc.base import BiosSettings, FirmwareItem
from metald.bmc.capabilities import Capability
from metald.bmc.control import Executor
from metald.machines import add_event, get_machine
from metald.store.models import utcnow

#: Attributes and values a hostile BMC can make metald store, at most.
MAX_ATTRIBUTES = 512
MAX_VALUE_CHARS = 256


def bios_drift(
    desired: dict[str, Any], current: dict[str, Any], pending: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Desired attributes the firmware does not have and has not staged: name -> want/have."""
    return {
        k: {"want": v, "have": current.get(k)}
        for k, v in sorted(desired.items())
        if current.get(k) != v and pending.get(k) != v
    }


def to_stage(
    desired: dict[str, Any], current: dict[str, Any], pending: dict[str, Any]
) -> dict[str, Any]:
    """What must be written to the pending settings so the next boot has the desired profile."""
    return {k: v for k, v in desired.items() if current.get(k) != v and pending.get(k) != v}


def _clean(attrs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in list(attrs.items())[:MAX_ATTRIBUTES]:
        if isinstance(v, bool | int | float) or v is None:
            out[str(k)[:128]] = v
        else:
            out[str(k)[:128]] = str(v)[:MAX_VALUE_CHARS]
    return out


def record_firmware(
    s: Session, machine_id: str, items: list[FirmwareItem], actor: str, instance: str
) -> dict[str, str]:
    m = get_machine(s, machine_id)
    versions = {i.id[:128]: (i.version or "")[:MAX_VALUE_CHARS] for i in items}
    if versions != (m.firmware_versions or {}):
        add_event(
            s,
            "bmc.firmware",
            actor,
            machine_id=machine_id,
            instance=instance,
            data={"before": m.firmware_versions or {}, "after": versions},
        )
        m.firmware_versions = versions  # an observation: no lifecycle version bump
        s.add(m)
    s.commit()
    return versions


def record_bios(
    s: Session,
    machine_id: str,
    settings: BiosSettings,
    actor: str,
    instance: str,
    desired: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Store what the BMC said; ``desired`` (when given) replaces the machine's profile."""
    m = get_machine(s, machine_id)
    before = dict(m.bios or {})
    want = dict(desired if desired is not None else before.get("desired") or {})
    current, pending = _clean(settings.current), _clean(settings.pending)
    drift = bios_drift(want, current, pending)
    record = {
        "current": current,
        "pending": pending,
        "desired": want,
        "drift": drift,
        "read_at": utcnow().isoformat(),
    }
    if drift and drift != before.get("drift"):
        add_event(
            s,
            "bmc.bios-drift",
            actor,
            machine_id=machine_id,
            instance=instance,
            reason="BIOS attributes differ from the machine's desired profile: "
            + ", ".join(f"{k}={d['have']!r} (want {d['want']!r})" for k, d in drift.items()),
            data={"drift": drift},
        )
    m.bios = record
    s.add(m)
    s.commit()
    return record


async def refresh_firmware(ex: Executor, machine_id: str, actor: str) -> list[FirmwareItem]:
    row = await ex.row_for_machine(machine_id)
    items: list[FirmwareItem] = await ex.execute(
        row,
        Capability.FIRMWARE,
        "firmware_inventory",
        lambda d: d.firmware_inventory(),
        timeout_s=ex.cfg.sensors_timeout_s,
    )
    await ex.store.run(record_firmware, machine_id, items, actor, ex.instance)
    return items


async def read_bios(ex: Executor, machine_id: str, actor: str) -> dict[str, Any]:
    row = await ex.row_for_machine(machine_id)
    settings = await ex.execute(row, Capability.BIOS, "bios", lambda d: d.bios())
    return await ex.store.run(record_bios, machine_id, settings, actor, ex.instance)


async def stage_bios(
    ex: Executor, machine_id: str, desired: dict[str, Any] | None, actor: str
) -> dict[str, Any]:
    """Make ``desired`` (None: the machine's stored profile) the machine's profile, stage what
    the firmware lacks as pending settings, and record what the BMC reports afterwards."""
    row = await ex.row_for_machine(machine_id)
    ex.require(row, Capability.BIOS)
    if desired is None:
        m = await ex.store.run(get_machine, machine_id)
        desired = dict((m.bios or {}).get("desired") or {})
    settings = await ex.execute(row, Capability.BIOS, "bios", lambda d: d.bios())
    staged = to_stage(desired, settings.current, settings.pending)
    if staged:
        await ex.execute(
            row, Capability.BIOS, "set_bios", lambda d: d.set_bios_pending(staged), write=True
        )
        settings = await ex.execute(row, Capability.BIOS, "bios", lambda d: d.bios())

        def event(s: Session) -> None:
            add_event(
                s,
                "bmc.bios-staged",
                actor,
                machine_id=machine_id,
                instance=ex.instance,
                reason="pending BIOS settings; the firmware applies them at the next reboot",
                data={"bmc_id": row.id, "attributes": staged},
            )
            s.commit()

        await ex.store.run(event)
    return await ex.store.run(record_bios, machine_id, settings, actor, ex.instance, desired)
