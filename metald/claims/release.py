"""Release: a claim (or one machine of it) ends; its machines leave the tenant and owe a wipe.

Each machine's agent tokens are revoked, its peer is taken off the tenant's hub, and it moves
to wiping (the provisioning runner then boots the wipe image through its BMC). One marked
broken during the claim is detached where it is. A technician may vouch for a wipe done by
hand (``confirm_wipe``)."""

from __future__ import annotations

from sqlmodel import Session

from metald import machines
from metald.auth import revoke_machine_tokens
from metald.claims.records import claim_machines, retrying, switch_plan
from metald.claims.tenant_os import forget_user_data, release_addresses
from metald.errors import Conflict, NotFound
from metald.lifecycle import ALLOCATED, State, Trigger
from metald.provision.intents import DeployImage, wipe_intent
from metald.store.models import Claim, Machine, utcnow
from metald.tenants import clusters


def release_claim(
    session: Session,
    claim: Claim,
    actor: str,
    *,
    deploy: DeployImage,
    reason: str | None = None,
    instance: str | None = None,
    only: set[str] | None = None,
) -> list[str]:
    """End the claim: every machine of it leaves the tenant (its agent tokens revoked, its
    peer taken off the tenant's hub, its tenant detached) and owes a wipe. Allocated ones start
    wiping (the driver then takes them through their BMC); one marked broken meanwhile is
    detached where it is, and a technician repairs and wipes it (it cannot reach ready
    unwiped). ``only``: release just these machines of the claim (scale down); the claim ends
    when none is left. Returns the ids of the machines that now wipe. Releasing twice changes
    nothing."""
    claim_id = claim.id

    def release() -> list[str]:
        c = session.get(Claim, claim_id, populate_existing=True)
        assert c is not None
        if c.state == "released":
            return []
        wiping = []
        remaining = 0
        #: Not allocated but still the tenant's (marked broken during the claim).
        attached = []
        for m in claim_machines(session, claim_id):
            if State(m.state) not in ALLOCATED:
                if m.tenant_id is not None:
                    attached.append(m)
                continue  # already released and wiping (or wiped)
            if only is not None and m.id not in only:
                remaining += 1
                continue
            revoke_machine_tokens(session, m.id, commit=False)
            # Off the tenant's hub (the tenant runtime removes it from the running hub and
            # the node from the cluster); unused join tokens are revoked.
            clusters.remove_peer(session, m.id, actor=actor, instance=instance)
            machines.transition(
                session,
                m.id,
                Trigger.RELEASE,
                actor=actor,
                reason=reason or f"claim {claim_id} released",
                expected_version=m.version,
                data={"claim_id": claim_id},
                instance=instance,
                commit=False,
            )
            machines.transition(
                session,
                m.id,
                Trigger.WIPE,
                actor=actor,
                reason="wipe after release",
                # Detached from the tenant now (its orchestrator no longer sees it); the claim
                # id stays until the wipe ends, so the claim shows its machines wiping.
                updates={
                    "boot_intent": wipe_intent(deploy),
                    "last_error": None,
                    "tenant_id": None,
                    "wipe_required": True,
                },
                instance=instance,
                commit=False,
            )
            wiping.append(m.id)
        detached = []
        for m in attached:
            if remaining == 0 or only is None or m.id in only:
                # Broken machines leave with the claim; a technician repairs and wipes them.
                _detach(session, m, actor=actor, reason=reason, instance=instance)
                detached.append(m.id)
        # Their static addresses go back to the pools with them.
        release_addresses(session, claim_id, wiping + detached)
        forget_user_data(session, claim_id, wiping + detached, ended=remaining == 0)
        if remaining == 0:
            c.state = "released"
        c.version += 1
        c.updated_at = utcnow()
        session.add(c)
        machines.add_event(
            session,
            "claim.released" if remaining == 0 else "claim.machines.released",
            actor,
            tenant_id=c.tenant_id,
            reason=reason,
            data={
                "claim_id": claim_id,
                "machines": wiping,
                # Switch automation moves these ports back to the provisioning network.
                "network": switch_plan(
                    session,
                    c.tenant_id,
                    [m for m in claim_machines(session, claim_id) if m.id in wiping],
                ),
            },
            instance=instance,
        )
        session.commit()
        return wiping

    return retrying(session, release)


_MACHINES = Machine.__table__  # type: ignore[attr-defined]


def _detach(
    session: Session, m: Machine, *, actor: str, reason: str | None, instance: str | None
) -> None:
    """Take a machine that is not allocated any more (marked broken during the claim) from
    its tenant: tokens revoked, peer removed, tenant cleared, a wipe owed."""
    revoke_machine_tokens(session, m.id, commit=False)
    clusters.remove_peer(session, m.id, actor=actor, instance=instance)
    res = session.connection().execute(
        _MACHINES.update()
        .where(_MACHINES.c.id == m.id, _MACHINES.c.version == m.version)
        .values(
            tenant_id=None,
            wipe_required=True,
            boot_armed=None,
            version=m.version + 1,
            updated_at=utcnow(),
        )
    )
    if res.rowcount != 1:
        raise machines.ConcurrentUpdate(f"machine {m.id} changed while its claim was released")
    machines.add_event(
        session,
        "machine.detached",
        actor,
        machine_id=m.id,
        tenant_id=m.tenant_id,
        reason=reason or f"claim {m.claim_id} released while the machine was {m.state}",
        data={"claim_id": m.claim_id, "state": m.state, "wipe_required": True},
        instance=instance,
    )


def release_machine(
    session: Session,
    claim: Claim,
    machine_id: str,
    actor: str,
    *,
    deploy: DeployImage,
    instance: str | None = None,
) -> list[str]:
    """Scale a claim down by one machine (``release_claim`` with ``only``); refuses a machine
    the claim does not hold, or one that already left it. Returns the ids now wiping."""
    m = session.get(Machine, machine_id)
    if m is None or m.claim_id != claim.id:
        raise NotFound(f"claim {claim.id} holds no machine {machine_id!r}")
    if State(m.state) not in ALLOCATED and m.tenant_id is None:
        raise Conflict(
            f"machine {machine_id} is {m.state}: it is not allocated to the claim any more"
        )
    return release_claim(session, claim, actor, deploy=deploy, instance=instance, only={m.id})


def start_wipe(
    session: Session,
    machine: Machine,
    actor: str,
    *,
    deploy: DeployImage,
    reason: str | None = None,
    version: int | None = None,
    instance: str | None = None,
) -> Machine:
    """A technician starts a wipe (maintenance or wipe-failed): the wipe image is what the
    machine boots next."""
    return machines.transition(
        session,
        machine.id,
        Trigger.WIPE,
        actor=actor,
        reason=reason or "wipe started by a technician",
        expected_version=version,
        updates={"boot_intent": wipe_intent(deploy), "last_error": None},
        instance=instance,
    )


def confirm_wipe(
    session: Session,
    machine: Machine,
    actor: str,
    *,
    reason: str,
    version: int | None = None,
    instance: str | None = None,
) -> Machine:
    """A technician vouches that the machine's disks were erased: back to ready, detached from
    any tenant and claim, recorded with who and why (``machine.wipe-confirmed``)."""
    m = machine
    if not m.wipe_required:
        raise Conflict(
            f"machine {m.id} owes no wipe, so there is nothing to confirm; "
            "use the maintenance-off action to return it to ready"
        )
    previous = {"tenant_id": m.tenant_id, "claim_id": m.claim_id, "state": m.state}
    m = machines.transition(
        session,
        m.id,
        Trigger.CONFIRM_WIPE,
        actor=actor,
        reason=reason,
        expected_version=version,
        updates={
            "tenant_id": None,
            "claim_id": None,
            "boot_intent": None,
            "last_error": None,
            "wipe_required": False,
            "boot_armed": None,
        },
        data=previous,
        instance=instance,
        commit=False,
    )
    machines.add_event(
        session,
        "machine.wipe-confirmed",
        actor,
        machine_id=m.id,
        reason=reason,
        data=previous,
        instance=instance,
    )
    session.commit()
    return m
