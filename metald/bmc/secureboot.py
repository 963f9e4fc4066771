"""UEFI Secure Boot of a machine, through its BMC (Redfish ``SecureBoot``,
``SecureBootDatabases``): read and recorded on the machine, or turned on with metald's
signing certificate enrolled in ``db``.

The state is an observation (``machines.secure_boot``: enabled, current_boot, mode, the
certificates' SHA-256 fingerprints per database, read_at); a change of what the firmware
enforces is a ``bmc.secure-boot`` event. Enabling is written to the BMC and takes effect at the
firmware's next boot, so ``current_boot`` stays false until the machine has rebooted and the BMC
is read again. Claims may require both (``Selector.secure_boot``). IPMI has no Secure Boot:
a machine behind an IPMI BMC is answered 409. docs/attestation.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlmodel import Session

from metald.bmc.base import SecureBootState
from metald.bmc.capabilities import Capability, CapabilityMissing
from metald.bmc.control import Executor
from metald.errors import Conflict, Unprocessable
from metald.machines import add_event, get_machine
from metald.store.models import Bmc, Machine, utcnow

DATABASES = ("PK", "KEK", "db", "dbx")
#: What a hostile BMC can make metald store, at most.
MAX_CERTS = 64


def enforced(record: dict[str, Any] | None) -> bool:
    """Whether a recorded state says Secure Boot is on and the current boot was verified."""
    r = record or {}
    return r.get("enabled") is True and r.get("current_boot") is True


def machine_enforced(m: Machine) -> bool:
    return enforced(m.secure_boot)


def to_record(state: SecureBootState) -> dict[str, Any]:
    certs = {
        db: [str(fp)[:64] for fp in state.certificates[db][:MAX_CERTS]]
        for db in DATABASES
        if db in state.certificates
    }
    return {
        "enabled": state.enabled,
        "current_boot": state.current_boot,
        "mode": state.mode,
        "certificates": certs,
        "read_at": utcnow().isoformat(),
    }


def record_secure_boot(
    s: Session, machine_id: str, state: SecureBootState, actor: str, instance: str
) -> dict[str, Any]:
    m = get_machine(s, machine_id)
    before = dict(m.secure_boot or {})
    record = to_record(state)
    keys = ("enabled", "current_boot", "mode", "certificates")
    if any(before.get(k) != record[k] for k in keys):
        add_event(
            s,
            "bmc.secure-boot",
            actor,
            machine_id=machine_id,
            instance=instance,
            reason=f"Secure Boot: enabled {record['enabled']}, current boot "
            f"{record['current_boot']}, mode {record['mode']}",
            data={
                "before": {k: before.get(k) for k in keys},
                "after": {k: record[k] for k in keys},
            },
        )
    m.secure_boot = record  # an observation: no lifecycle version bump
    s.add(m)
    s.commit()
    return record


def _require(ex: Executor, row: Bmc) -> None:
    try:
        ex.require(row, Capability.SECURE_BOOT)
    except CapabilityMissing:
        raise Conflict(
            f"machine {row.machine_id}'s BMC {row.id} speaks {row.protocol}, which has no "
            "Secure Boot (IPMI carries none); register its Redfish endpoint instead, or set "
            "Secure Boot in the machine's firmware setup by hand",
            bmc_id=row.id,
            protocol=row.protocol,
        ) from None


async def read(ex: Executor, machine_id: str, actor: str) -> dict[str, Any]:
    row = await ex.row_for_machine(machine_id)
    _require(ex, row)
    state = await ex.execute(row, Capability.SECURE_BOOT, "secure_boot", lambda d: d.secure_boot())
    return await ex.store.run(record_secure_boot, machine_id, state, actor, ex.instance)


def signing_certificate(path: str) -> str:
    """The PEM certificate to enroll in db (``bmc.secure_boot_cert``), or Unprocessable."""
    if not path:
        raise Unprocessable(
            "no certificate to enroll: set bmc.secure_boot_cert to metald's signing certificate "
            "(python -m bootassets sign --new-key DIR makes DIR/db.crt), or send enroll: false"
        )
    try:
        pem = Path(path).read_text()
    except OSError as e:
        raise Unprocessable(f"bmc.secure_boot_cert {path}: {e.strerror}; fix the path") from None
    if "-----BEGIN CERTIFICATE-----" not in pem:
        raise Unprocessable(f"bmc.secure_boot_cert {path} holds no PEM certificate")
    return pem


async def configure(
    ex: Executor, machine_id: str, enable: bool, enroll: bool, cert_path: str, actor: str
) -> dict[str, Any]:
    """Enroll metald's certificate in db (``enroll``), write ``SecureBootEnable``, read the
    state back and record it; one ``bmc.secure-boot-set`` event says what was asked."""
    row = await ex.row_for_machine(machine_id)
    _require(ex, row)
    pem = signing_certificate(cert_path) if enroll else None
    added = False
    if pem is not None:
        added = await ex.execute(
            row,
            Capability.SECURE_BOOT,
            "secure_boot_enroll",
            lambda d: d.enroll_certificate("db", pem),
            write=True,
        )
    await ex.execute(
        row,
        Capability.SECURE_BOOT,
        "secure_boot_set",
        lambda d: d.set_secure_boot(enable),
        write=True,
    )

    def event(s: Session) -> None:
        add_event(
            s,
            "bmc.secure-boot-set",
            actor,
            machine_id=machine_id,
            instance=ex.instance,
            reason=f"Secure Boot {'enabled' if enable else 'disabled'}"
            + ("; metald's certificate enrolled in db" if added else "")
            + "; the firmware applies it at the next boot",
            data={"bmc_id": row.id, "enable": enable, "enroll": enroll, "enrolled": added},
        )
        s.commit()

    await ex.store.run(event)
    out = await read(ex, machine_id, actor)
    return {**out, "enrolled": added}
