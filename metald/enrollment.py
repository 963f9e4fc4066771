"""Zero-touch enrollment: from a MAC on the wire to a ``ready`` machine with its inventory.

- ``enrollment_boot_hooks`` (the boot plane's hooks): an unknown MAC that fetches its iPXE script
  becomes a ``discovered`` machine; a machine booting the discovery image moves to
  ``inspecting`` and gets a fresh machine-scoped agent token on its kernel command line.
- ``accept_inventory``: the agent's post, validated, checked against its token's machine and
  against replays, normalised, run through the enrollment rules, and stored with the
  ``inspected`` transition in one transaction. A refused post writes only an event.
- ``next_instruction``: what the agent should do now (post inventory, power off, wait).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, select

from metald import machines, topology
from metald.auth import issue_agent_token, revoke_machine_tokens
from metald.boot.machine_hooks import StoreBootHooks
from metald.config import EnrollConfig
from metald.errors import Conflict, MetaldError
from metald.inventory import validate_inventory
from metald.inventory.rules import apply_rules, bios_profile, profile_for
from metald.lifecycle import (
    COMMISSION_RUNNING,
    INVENTORY_ACCEPTED,
    OUT_OF_SERVICE,
    State,
    Trigger,
    phase_of,
)
from metald.provision import boots, commissioning
from metald.store.models import Event, Machine, as_utc, new_id, utcnow

if TYPE_CHECKING:
    from metald.fleet.membership import Membership


def mint_agent_token(
    s: Session,
    m: Machine,
    *,
    actor: str,
    ttl_s: int,
    instance: str | None = None,
    mac: str = "",
    client: str | None = None,
) -> str | None:
    """A fresh agent token for ``m``, bound to its phase and to the boot metald armed
    (``metald.provision.boots``), or None when no boot is armed (the script is served without
    one and a ``boot.script_refetched`` event is recorded once per boot). A discovered machine
    about to boot the discovery image moves to ``inspecting`` in the same transaction, which
    arms its first boot."""
    boot: str | None
    if m.state in (State.DISCOVERED.value, State.INSPECT_FAILED.value):
        # Entering inspection arms a boot (``lifecycle.ARM_ON_ENTRY``) that this fetch takes at
        # once: armed and taken in the transition's own compare-and-swap, as the two UPDATEs
        # (arm, then ``take_armed_boot``) in this one transaction would leave it.
        boot = new_id()
        machines.transition(
            s,
            m.id,
            Trigger.INSPECT,
            actor=actor,
            reason="booting the discovery image",
            instance=instance,
            commit=False,
            machine=m,
            updates={"boot_armed": None, "boot_current": boot},
        )
    else:
        boot = boots.take_armed_boot(s, m)
    if boot is None:
        boots.note_refetch(s, m, mac=mac, client=client, actor=actor, instance=instance)
        s.commit()
        return None
    revoke_machine_tokens(s, m.id, commit=False)
    secret = issue_agent_token(
        s,
        m.id,
        name=f"agent-{m.id[:8]}",
        created_by=actor,
        ttl=timedelta(seconds=ttl_s),
        phase=phase_of(m.state),
        boot=boot,
    )
    s.commit()
    return secret


def enrollment_boot_hooks(
    store: Any,
    instance: str,
    cfg: EnrollConfig,
    *,
    leased_clients_only: bool = False,
    fleet: Membership | None = None,
) -> StoreBootHooks:
    """The boot plane's hooks with enrollment: MACs first seen over HTTP are enrolled (when the
    asking address holds their lease), agent boots carry a fresh agent token
    (``mint_agent_token``) and the agent console arguments."""
    actor = f"metald:{instance}"
    return StoreBootHooks(
        store,
        instance,
        mint_agent_token=lambda s, m, mac, client: mint_agent_token(
            s,
            m,
            actor=actor,
            ttl_s=cfg.agent_token_ttl_s,
            instance=instance,
            mac=mac,
            client=client,
        ),
        leased_clients_only=leased_clients_only,
        enroll_unknown=True,
        agent_console=True,
        fleet=fleet,
    )


def record_refusal(
    s: Session, machine_id: str, actor: str, err: MetaldError, instance: str | None
) -> None:
    s.rollback()
    last = s.exec(
        select(Event)
        .where(Event.machine_id == machine_id, Event.kind == "inventory.refused")
        .order_by(Event.id.desc())  # type: ignore[union-attr]
        .limit(1)
    ).first()
    if last is not None and last.reason == err.detail:
        age = (utcnow() - as_utc(last.at)).total_seconds()
        if age < REFUSAL_EVENT_INTERVAL_S:
            return
    machines.add_event(
        s,
        "inventory.refused",
        actor,
        machine_id=machine_id,
        reason=err.detail,
        data={"status": err.status, "error": type(err).__name__},
        instance=instance,
    )
    s.commit()


#: A refusal repeated within this many seconds (the agent retries forever) is not recorded again.
REFUSAL_EVENT_INTERVAL_S = 60


def accept_inventory(
    s: Session,
    machine_id: str,
    data: Any,
    *,
    actor: str,
    cfg: EnrollConfig,
    instance: str | None = None,
    commit: bool = True,
    machine: Machine | None = None,
) -> Machine:
    """Validate and store an agent's inventory post. On refusal: an event, nothing else.
    ``commit=False``: the caller commits (it reads more in the same transaction). ``machine``:
    the row as the caller just read it in this transaction (``get_machine``), not read again;
    the transition's compare-and-swap on its version still refuses it if it changed since."""
    try:
        m = machine if machine is not None else machines.get_machine(s, machine_id)
        # The stored document (deferred on the machine reads) is read only if there is one:
        # ``inventory_at`` is written with it, so a first inventory (every machine of a storm)
        # costs no read of a column that is empty.
        stored = m.inventory if m.inventory_at is not None else None
        accepted = validate_inventory(data, token_machine_id=machine_id, stored=stored)
        if State(m.state) not in INVENTORY_ACCEPTED:
            raise Conflict(
                f"machine {machine_id} is {m.state}, not inspecting; run the 'inspect' action to re-inspect it"
            )
    except MetaldError as e:
        record_refusal(s, machine_id, actor, e, instance)
        raise
    norm = accepted.normalized
    rule_labels, rule_rack = apply_rules(cfg.rules, norm, m.rack_position)
    labels = {**rule_labels, **(m.labels or {})}  # labels set by people win over rules
    updates: dict[str, Any] = {
        **accepted.machine_fields,
        "inventory": accepted.document,
        "inventory_at": utcnow(),
        "labels": labels,
        "last_error": None,
        "boot_intent": None,
    }
    if rule_rack and not m.rack:
        updates["rack"] = rule_rack
    # The leaf comes from the fabric's own discovery, matched with the ports reported now.
    updates["ib_leaf"] = topology.leaf_of(s, topology.port_guids(accepted.document))
    if profile := bios_profile(cfg.rules, norm, m.rack_position):
        updates["bios"] = {**(m.bios or {}), "desired": profile}  # staged by metald.bmc.firmware
    if not m.rack_position and norm.rack_position_hint:
        updates["rack_position"] = norm.rack_position_hint
    serial = accepted.machine_fields.get("serial")
    if better := machines.name_to_take(s, m, serial):
        updates["name"] = better  # its serial instead of a generated name (issue 31)
    machines.sync_nics(s, m.id, norm.nics)
    commission = profile_for(cfg.rules, norm, updates.get("rack_position", m.rack_position))
    machines.transition(
        s,
        m.id,
        commissioning.trigger_after_inventory(s, m.id, commission),
        actor=actor,
        reason="inventory accepted",
        machine=m,
        updates=updates,
        data={
            "gpu_model": norm.gpu_model,
            "gpu_count": norm.gpu_count,
            "memory_mb": norm.memory_mb,
            "cpu_count": norm.cpu_count,
        },
        instance=instance,
        commit=False,
    )
    machines.take_name(s, m, serial)
    if accepted.changes:
        machines.add_event(
            s,
            "inventory.changed",
            actor,
            machine_id=m.id,
            reason="; ".join(accepted.changes)[:500],
            data={"changes": accepted.changes},
            instance=instance,
        )
    if commission is not None:
        commissioning.start_run(s, m, commission, norm, actor=actor, instance=instance)
    if commit:
        s.commit()
    return m


def next_instruction(m: Machine, cfg: EnrollConfig) -> dict[str, Any]:
    """What the agent in the discovery image should do now."""
    state = State(m.state)
    if state in INVENTORY_ACCEPTED:
        return {"action": "inspect", "reason": "post the inventory"}
    if state in COMMISSION_RUNNING:
        return {"action": "commission", "reason": "run the commissioning checks"}
    if state is State.COMMISSION_FAILED:
        # Repair happens with the power off; a technician's commission boots it again.
        return {"action": "poweroff", "reason": f"commissioning failed: {m.last_error}"}
    if state is State.READY:
        return {"action": cfg.after_inspection, "reason": "inspected; waiting for a claim"}
    if state in OUT_OF_SERVICE:
        return {"action": "poweroff", "reason": f"machine is {state.value}"}
    return {"action": "wait", "retry_after_s": 10, "reason": f"machine is {state.value}"}
