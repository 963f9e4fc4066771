"""Boots metald started, and the one agent token each may hand out.

An agent token rides on a machine's iPXE script, which any host on the provisioning network
can ask for. So a token is minted only for a boot metald itself started: the driver powers the
machine off through its BMC, sets a one-time PXE boot and *arms* the boot (a fresh nonce in
``Machine.boot_armed``) before powering it on; entering inspection or provisioning arms one too
(``lifecycle.ARM_ON_ENTRY``). The first script fetch of an armed boot takes the nonce (one
compare-and-swap UPDATE, so of two racing fetches one wins) and its token is bound to it
(``ApiToken.boot``); every later fetch gets a script without a token and a
``boot.script_refetched`` event. A wipe is never armed on entry: the tenant's OS may still be
running then, holding its lease and able to fetch the wipe script itself.
"""

from __future__ import annotations

from sqlalchemy import bindparam
from sqlmodel import Session, col, select

from metald import machines
from metald.auth import revoke_machine_tokens
from metald.store.models import Event, Machine, new_id

REFETCH_EVENT = "boot.script_refetched"
#: Marks an armed virtual-media boot (``metald.provision.media_boot``).
MEDIA_PREFIX = "vm:"

_MACHINES = Machine.__table__  # type: ignore[attr-defined]
_TAKE = (
    _MACHINES.update()
    .where(_MACHINES.c.id == bindparam("m"), _MACHINES.c.boot_armed == bindparam("nonce"))
    .values(boot_armed=None, boot_current=bindparam("nonce"))
)
_ARM = (
    _MACHINES.update()
    .where(_MACHINES.c.id == bindparam("m"))
    .values(boot_armed=bindparam("nonce"), boot_current=None)
)


def arm_boot(session: Session, machine_id: str, media: bool = False) -> str:
    """Arm a new boot of the machine (in the session's transaction): the previous boot's
    agent tokens are revoked, and the next script fetch may carry a new one. ``media``: a
    virtual-media boot, whose token only its nonce URL hands out (``media_boot``)."""
    revoke_machine_tokens(session, machine_id, commit=False)
    nonce = (MEDIA_PREFIX if media else "") + new_id()
    session.connection().execute(_ARM, {"m": machine_id, "nonce": nonce})
    return nonce


def take_armed_boot(session: Session, m: Machine) -> str | None:
    """The armed boot's nonce, taken (at most once across every instance), or None when no
    boot is armed: the caller then serves a script without a token."""
    nonce = m.boot_armed
    if not nonce or nonce.startswith(MEDIA_PREFIX):  # a virtual-media boot: its nonce URL only
        return None
    taken = session.connection().execute(_TAKE, {"m": m.id, "nonce": nonce}).rowcount
    return nonce if taken == 1 else None


def note_refetch(
    session: Session, m: Machine, *, mac: str, client: str | None, actor: str, instance: str | None
) -> None:
    """Record (once per boot) that a script was asked for again without an armed boot."""
    boot = m.boot_current
    last = session.exec(
        select(Event)
        .where(Event.machine_id == m.id, Event.kind == REFETCH_EVENT)
        .order_by(col(Event.id).desc())
        .limit(1)
    ).first()
    if last is not None and (last.data or {}).get("boot") == boot:
        return
    machines.add_event(
        session,
        REFETCH_EVENT,
        actor,
        machine_id=m.id,
        reason=(
            f"{client or 'an unknown address'} asked for the boot script of {mac} again in a "
            "boot whose token was already handed out (or that metald did not start); served "
            "without a token"
        ),
        data={"boot": boot, "client": client, "state": m.state},
        instance=instance,
    )
