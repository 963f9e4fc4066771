"""Release leaves nothing behind: before a released machine is wiped, its BMC is put back as
the operator left it. A tenant with root can change BIOS settings, add BMC accounts and flash
some firmware in band; the next tenant must not inherit any of it.

For each released machine with a Redfish BMC, through the fenced executor:

1. BIOS: the machine's desired profile (``bios.desired``, from the enroll rules) is staged
   again wherever the firmware's current or pending value differs; the wipe's reboot applies it;
2. BMC accounts: every account but metald's own and the operator's listed ones
   (``[firmware] keep_accounts``) is removed;
3. firmware: the inventory is read and compared with what was recorded before the tenancy and
   with the profile's baseline. A machine whose firmware changed, or is off its baseline, is
   held (marked broken, not wiped) with the evidence, for a technician to re-flash
   (docs/firmware.md) and repair.

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

from metald import machines
from metald.bmc import firmware as bmc_firmware
from metald.bmc.capabilities import Capability
from metald.bmc.control import Executor
from metald.errors import MetaldError, Unprocessable
from metald.firmware import records
from metald.firmware.baselines import compare
from metald.inventory.rules import EnrollmentRule
from metald.lifecycle import Trigger
from metald.machines import add_event, get_machine

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

    @property
    def hold(self) -> bool:
        return bool(self.firmware_changed or self.off_baseline or self.errors)

    def view(self) -> dict[str, Any]:
        return {
            "bios_restored": self.bios_restored,
            "accounts_removed": self.accounts_removed,
            "firmware_changed": self.firmware_changed,
            "off_baseline": self.off_baseline,
            "errors": self.errors,
            "not_offered": self.not_offered,
            "skipped": self.skipped,
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

        def baseline_findings(s: Session) -> list[dict[str, str | None]]:
            mm = get_machine(s, machine_id)
            profile = records.machine_profile(rules, mm)
            b = records.latest(s, profile).get(profile) if profile else None
            if b is None:
                return []
            found = compare(records.components_of(b), after)
            return [f.as_dict() for f in found if f.status in ("differs", "missing")]

        out.off_baseline = await ex.store.run(baseline_findings)
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
        machines.transition(
            s,
            out.machine_id,
            Trigger.MARK_BROKEN,
            actor=actor,
            reason="held after release, not wiped for the next tenant: "
            + "; ".join(parts)
            + ". Re-flash it to its baseline (POST /api/v1/machines/{id}/firmware/update), "
            "then repair and wipe it",
            data={"claim_id": claim_id, "evidence": out.view()},
            updates={"last_error": "held after release: " + "; ".join(parts)[:900]},
            instance=instance,
        )
    s.commit()
