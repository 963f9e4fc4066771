"""Release leaves nothing behind: before a released machine is wiped, its BMC is put back as
the operator left it. A tenant with root can change BIOS settings, add BMC accounts and flash
some firmware in band; the next tenant must not inherit any of it.

For each released machine with a Redfish BMC, through the fenced executor:

1. BIOS: the machine's desired profile (``bios.desired``, from the enroll rules) is staged
   again wherever the firmware's current or pending value differs; the wipe's reboot applies it;
2. BMC accounts: every account but metald's own and the operator's listed ones
   (``[firmware] keep_accounts``) is removed;
3. firmware: the inventory is read and compared with what was recorded before the tenancy and
   with the profile's baseline. An item that changed during the tenancy (or, with nothing
   recorded before it, any item off the baseline) is **re-flashed** to the baseline before the
   wipe when the baseline has an image for it (``reflash``: ``metald.firmware.service`` runs the
   updates and wipes only after they are done); with no baseline component, no image or no
   such item any more, the machine is **held in the repair queue** (``metald.repairs``, source
   ``release``) with the evidence, not wiped.

One ``release.restored`` event per machine (with the claim's id) says what was done; a step
the BMC refuses is in it as an error, and the machine is held too: metald does not hand a
machine it could not clean to the next tenant.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlmodel import Session

from metald import repairs
from metald.bmc import firmware as bmc_firmware
from metald.bmc.capabilities import Capability
from metald.bmc.control import Executor
from metald.errors import MetaldError, Unprocessable
from metald.firmware import records
from metald.firmware.baselines import compare, component_for
from metald.inventory.rules import EnrollmentRule
from metald.machines import add_event, get_machine
from metald.store.models import utcnow

log = logging.getLogger(__name__)


@dataclass
class Cleanup:
    machine_id: str
    bios_restored: dict[str, Any] = field(default_factory=dict)
    accounts_removed: list[str] = field(default_factory=list)
    firmware_changed: dict[str, dict[str, str | None]] = field(default_factory=dict)
    off_baseline: list[dict[str, str | None]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Steps this BMC does not offer (no Bios resource, no AccountService): said, not held.
    not_offered: list[str] = field(default_factory=list)
    skipped: str | None = None
    #: Inventory items to flash back to the baseline before the wipe (the baseline has an
    #: image for each).
    reflash: list[str] = field(default_factory=list)
    #: Changed items metald cannot restore (why, one sentence each): the machine is held.
    unrestorable: list[str] = field(default_factory=list)

    @property
    def hold(self) -> bool:
        return bool(self.unrestorable or self.errors)

    def view(self) -> dict[str, Any]:
        return {
            "bios_restored": self.bios_restored,
            "accounts_removed": self.accounts_removed,
            "firmware_changed": self.firmware_changed,
            "off_baseline": self.off_baseline,
            "errors": self.errors,
            "not_offered": self.not_offered,
            "skipped": self.skipped,
            "reflash": self.reflash,
            "unrestorable": self.unrestorable,
        }


async def clean(
    ex: Executor,
    machine_id: str,
    claim_id: str | None,
    *,
    keep_accounts: list[str],
    rules: list[EnrollmentRule],
    actor: str,
) -> Cleanup:
    """Restore one released machine's BMC (see the module); records the outcome, holds the
    machine when its firmware changed or a step failed. Never raises for the BMC's sake."""
    out = Cleanup(machine_id)
    try:
        row = await ex.row_for_machine(machine_id)
    except MetaldError:
        out.skipped = "no BMC"
        return out
    try:
        for c in (Capability.BIOS, Capability.ACCOUNTS, Capability.FIRMWARE):
            ex.require(row, c)
    except MetaldError:
        out.skipped = f"its BMC speaks {row.protocol}, which cannot restore BIOS or accounts"
        await ex.store.run(_record, out, claim_id, actor, ex.instance)
        return out
    m = await ex.store.run(get_machine, machine_id)
    before = dict(m.firmware_versions or {})
    desired = dict((m.bios or {}).get("desired") or {})
    # 1. BIOS: stage the profile where the tenant changed it (applied at the wipe's reboot).
    if desired:
        try:
            settings = await ex.execute(row, Capability.BIOS, "bios", lambda d: d.bios())
            out.bios_restored = bmc_firmware.to_stage(desired, settings.current, settings.pending)
            await bmc_firmware.stage_bios(ex, machine_id, desired, actor)
        except Unprocessable as e:  # the BMC does not offer it
            out.not_offered.append(f"BIOS: {e.detail}")
        except MetaldError as e:
            out.errors.append(f"BIOS: {e.detail}")
    # 2. BMC accounts: only metald's own and the operator's listed ones remain.
    keep = {row.username, *keep_accounts}
    try:
        accounts = await ex.execute(row, Capability.ACCOUNTS, "accounts", lambda d: d.accounts())
        for a in accounts:
            if a.username in keep:
                continue
            await ex.execute(row, Capability.ACCOUNTS, "delete_account", _deleter(a.id), write=True)
            out.accounts_removed.append(a.username)
    except Unprocessable as e:  # the BMC does not offer it
        out.not_offered.append(f"BMC accounts: {e.detail}")
    except MetaldError as e:
        out.errors.append(f"BMC accounts: {e.detail}")
    # 3. Firmware: what changed during the tenancy, and what is off the baseline.
    try:
        items = await bmc_firmware.refresh_firmware(ex, machine_id, actor)
        after = {i.id: i.version or "" for i in items}
        for k in sorted(set(before) | set(after)):
            if before and before.get(k) != after.get(k):
                out.firmware_changed[k] = {"before": before.get(k), "after": after.get(k)}

        def baseline_findings(s: Session) -> None:
            mm = get_machine(s, machine_id)
            profile = records.machine_profile(rules, mm)
            b = records.latest(s, profile).get(profile) if profile else None
            comps = records.components_of(b) if b is not None else []
            found = compare(comps, after) if b is not None else []
            out.off_baseline = [f.as_dict() for f in found if f.status in ("differs", "missing")]
            # What the tenant may have done: the items that changed; with nothing recorded
            # before the tenancy, every item off the baseline.
            suspects = (
                set(out.firmware_changed)
                if before
                else {f["item"] for f in out.off_baseline if f["item"]}
            )
            where = f"profile {profile}'s baseline" if b is not None else "no baseline"
            for k in sorted(suspects):
                comp = component_for(comps, k)
                have = after.get(k)
                if comp is None:
                    out.unrestorable.append(
                        f"{k}: {where} has no component for it, so metald cannot restore it"
                    )
                elif have is None:
                    out.unrestorable.append(f"{k}: the BMC no longer reports it")
                elif have.strip() == comp.version.strip():
                    continue  # at the baseline's version: nothing to restore
                elif comp.updatable():
                    out.reflash.append(k)
                else:
                    out.unrestorable.append(
                        f"{k}: {where} has no image for {comp.id} {comp.version} "
                        "(set its url and sha256 to let metald re-flash it)"
                    )

        await ex.store.run(baseline_findings)
    except Unprocessable as e:  # the BMC does not offer it
        out.not_offered.append(f"firmware: {e.detail}")
    except MetaldError as e:
        out.errors.append(f"firmware: {e.detail}")
    await ex.store.run(_record, out, claim_id, actor, ex.instance)
    return out


def _deleter(account_id: str) -> Callable[[Any], Awaitable[None]]:
    async def delete(d: Any) -> None:
        await d.delete_account(account_id)

    return delete


def _record(s: Session, out: Cleanup, claim_id: str | None, actor: str, instance: str) -> None:
    parts = []
    if out.skipped:
        parts.append(f"nothing restored: {out.skipped}")
    if out.bios_restored:
        parts.append(
            "BIOS settings restored: "
            + ", ".join(f"{k}={v!r}" for k, v in out.bios_restored.items())
        )
    if out.accounts_removed:
        parts.append("BMC accounts removed: " + ", ".join(out.accounts_removed))
    if out.firmware_changed:
        parts.append(
            "firmware changed during the tenancy: "
            + ", ".join(
                f"{k} {v['before']} -> {v['after']}" for k, v in out.firmware_changed.items()
            )
        )
    if out.off_baseline:
        parts.append(
            "off baseline: "
            + ", ".join(
                f"{f['item'] or f['component']} {f['have']} (want {f['want']})"
                for f in out.off_baseline
            )
        )
    if out.reflash and not out.hold:
        parts.append("re-flashing to the baseline before the wipe: " + ", ".join(out.reflash))
    parts += out.unrestorable
    parts += out.errors
    parts += [f"not offered by the BMC: {x}" for x in out.not_offered]
    add_event(
        s,
        "release.restored",
        actor,
        machine_id=out.machine_id,
        instance=instance,
        reason="; ".join(parts) or "nothing to restore",
        data={"claim_id": claim_id, **out.view()},
    )
    if out.hold and not out.skipped:
        hold_in_repair(s, out.machine_id, claim_id, evidence(out), actor, instance)
    s.commit()


def evidence(out: Cleanup) -> list[dict[str, Any]]:
    """The faults a held machine's repair carries: one per thing metald could not restore."""
    now = utcnow().isoformat()
    faults: list[dict[str, Any]] = []
    for why in out.unrestorable:
        item = why.split(":", 1)[0]
        change = out.firmware_changed.get(item)
        seen = f" ({change['before']} -> {change['after']} during the tenancy)" if change else ""
        faults.append({"kind": "firmware", "subject": item, "code": "changed-in-tenancy",
                       "severity": "fatal", "witness": "bmc", "evidence": why + seen,
                       "why": (why + seen)[:200], "first_seen": now})  # fmt: skip
    for err in out.errors:
        faults.append({"kind": "release", "subject": "bmc", "code": "clean-up-failed",
                       "severity": "fatal", "witness": "bmc", "evidence": err,
                       "why": err[:200], "first_seen": now})  # fmt: skip
    return faults


def hold_in_repair(
    s: Session,
    machine_id: str,
    claim_id: str | None,
    faults: list[dict[str, Any]],
    actor: str,
    instance: str,
) -> None:
    """Hold a released machine in the repair queue (marked broken, not wiped) with the
    evidence; not committed. A technician re-flashes it (``POST .../firmware/update`` works on
    broken machines), repairs it, and the repair's verification wipes it."""
    r = repairs.open_repair(
        s,
        machine_id,
        faults=faults or [{"kind": "release", "evidence": "held after release"}],
        source=repairs.Source.RELEASE,
        actor=actor,
        instance=instance,
        commit=False,
    )
    add_event(
        s,
        "release.held",
        actor,
        machine_id=machine_id,
        instance=instance,
        reason=f"held after release, not wiped for the next tenant: in repair {r.id} "
        f"({r.summary}). Re-flash it to its baseline (POST /api/v1/machines/{machine_id}"
        "/firmware/update), then repair it",
        data={"claim_id": claim_id, "repair_id": r.id, "faults": faults},
    )
