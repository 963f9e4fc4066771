"""The machine lifecycle: one table of legal transitions, and nothing else.

Everything that can change a machine's state is a ``Trigger``; ``TRANSITIONS`` maps
(state, trigger) to the next state. This module is pure: it knows no database, no API and no
roles. ``metald.machines`` applies a transition atomically with its event row.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum


class State(StrEnum):
    DISCOVERED = "discovered"
    INSPECTING = "inspecting"
    INSPECT_FAILED = "inspect-failed"
    COMMISSIONING = "commissioning"
    COMMISSION_FAILED = "commission-failed"
    READY = "ready"
    CLAIMED = "claimed"
    PROVISIONING = "provisioning"
    PROVISION_FAILED = "provision-failed"
    PROVISIONED = "provisioned"
    JOINING = "joining"
    JOIN_FAILED = "join-failed"
    ACTIVE = "active"
    RELEASING = "releasing"
    WIPING = "wiping"
    WIPE_FAILED = "wipe-failed"
    MAINTENANCE = "maintenance"
    BROKEN = "broken"
    #: A technician works on the machine's repair (``metald.repairs``): out of service until
    #: "repaired" sends it through commissioning again.
    REPAIRING = "repairing"
    #: The boot's measured-boot attestation differs from the machine's golden values
    #: (``metald.attestation``): held out of the pool until a technician accepts the new
    #: measurements (with a reason) or marks it broken.
    ATTESTATION_FAILED = "attestation-failed"
    RETIRED = "retired"


class Trigger(StrEnum):
    INSPECT = "inspect"  # start (re-)inspection: boot the discovery image
    INSPECTED = "inspected"  # the agent posted a valid inventory
    INSPECT_FAIL = "inspect-fail"  # agent error or watchdog timeout
    #: The inventory was accepted and an enroll rule gives the machine a commissioning profile
    #: (``metald.commissioning``): the discovery agent runs its checks before ready.
    COMMISSION = "commission"
    COMMISSIONED = "commissioned"  # every check of the profile passed (metald's verdict)
    COMMISSION_FAIL = "commission-fail"  # a check failed, the agent gave up, or the watchdog
    CLAIM = "claim"  # allocated to a tenant's claim
    PROVISION = "provision"  # start installing the claim's image (also a retry)
    PROVISIONED = "provisioned"  # image written/booted
    PROVISION_FAIL = "provision-fail"
    JOIN = "join"  # node started joining its tenant's cluster (also a retry)
    JOINED = "joined"  # handshake seen and the scheduler reports the node
    JOIN_FAIL = "join-fail"
    RELEASE = "release"  # the tenant gives the machine back
    WIPE = "wipe"  # start wiping (also a retry)
    WIPED = "wiped"  # wipe verified: back to the pool
    WIPE_FAIL = "wipe-fail"
    MAINTENANCE_ON = "maintenance-on"
    MAINTENANCE_OFF = "maintenance-off"
    MARK_BROKEN = "mark-broken"
    REPAIR = "repair"  # broken -> maintenance, for the technician to work on it
    #: A technician takes the machine's repair from the queue (``metald.repairs``); "repaired"
    #: is an ``inspect`` (with a commissioning run) or, when a tenant's data is still on its
    #: disks, a ``wipe`` followed by commissioning.
    TAKE_REPAIR = "take-repair"
    RETIRE = "retire"
    #: A technician vouches that a machine's disks were wiped by hand (no BMC to boot the wipe
    #: image through, or no disk the agent can see): back to ready, recorded with who and why.
    CONFIRM_WIPE = "confirm-wipe"
    #: The wipe (or discovery) boot's attestation failed: held instead of ready.
    ATTEST_FAIL = "attest-fail"
    #: A technician accepts the failed attestation's measurements as the new golden values
    #: (e.g. after a firmware rollout), with a reason: back to ready.
    ACCEPT_GOLDEN = "accept-golden"


S, T = State, Trigger

#: States in which a machine belongs to a tenant.
ALLOCATED = frozenset(
    {
        S.CLAIMED,
        S.PROVISIONING,
        S.PROVISION_FAILED,
        S.PROVISIONED,
        S.JOINING,
        S.JOIN_FAILED,
        S.ACTIVE,
    }
)
#: States in which a machine runs its tenant's image: what Day 2 watches (metald.healthwatch).
IN_USE = frozenset({S.PROVISIONED, S.JOINING, S.ACTIVE})
#: States in which a machine is not allocated and no operation is under way.
IDLE = frozenset({S.DISCOVERED, S.READY, S.INSPECT_FAILED, S.COMMISSION_FAILED, S.WIPE_FAILED})
#: Out of the pool by a technician's hand (nothing claims, boots or wipes them by itself):
#: where metald flashes firmware (metald.firmware).
HELD = frozenset({S.MAINTENANCE, S.BROKEN})
#: Where a firmware rollout takes a machine from (metald.firmware.rollouts): the pool, left
#: through maintenance-on (so no claim takes it while it is flashed), or maintenance already.
ROLLOUT_FREE = frozenset({S.READY, S.MAINTENANCE})
#: Never flashed by a rollout: out of service for good, or a technician's to repair.
ROLLOUT_GONE = frozenset({S.RETIRED, S.BROKEN, S.REPAIRING})
#: States a watchdog times out of, and where it sends them.
TIMEOUTS: dict[State, Trigger] = {
    S.INSPECTING: T.INSPECT_FAIL,
    S.COMMISSIONING: T.COMMISSION_FAIL,
    S.PROVISIONING: T.PROVISION_FAIL,
    S.JOINING: T.JOIN_FAIL,
    S.WIPING: T.WIPE_FAIL,
}


def _table() -> dict[tuple[State, Trigger], State]:
    t: dict[tuple[State, Trigger], State] = {}

    def add(sources: object, trigger: Trigger, target: State) -> None:
        for src in sources if isinstance(sources, (set, frozenset, tuple, list)) else (sources,):
            assert (src, trigger) not in t, (src, trigger)
            t[(src, trigger)] = target

    # Inspection
    add(
        {S.DISCOVERED, S.READY, S.INSPECT_FAILED, S.MAINTENANCE, S.REPAIRING},
        T.INSPECT,
        S.INSPECTING,
    )
    add(S.INSPECTING, T.INSPECTED, S.READY)
    add(S.INSPECTING, T.INSPECT_FAIL, S.INSPECT_FAILED)
    # Commissioning: in the same discovery boot, right after the inventory. On demand (and
    # after a repair) a machine is inspected again with a commissioning run requested, so its
    # profile is compared with a fresh inventory; the run starts when that inventory arrives.
    add(S.INSPECTING, T.COMMISSION, S.COMMISSIONING)
    add(S.COMMISSIONING, T.COMMISSIONED, S.READY)
    add(S.COMMISSIONING, T.COMMISSION_FAIL, S.COMMISSION_FAILED)
    add(S.COMMISSION_FAILED, T.INSPECT, S.INSPECTING)
    # Allocation and provisioning
    add(S.READY, T.CLAIM, S.CLAIMED)
    add({S.CLAIMED, S.PROVISION_FAILED}, T.PROVISION, S.PROVISIONING)
    add(S.PROVISIONING, T.PROVISIONED, S.PROVISIONED)
    add(S.PROVISIONING, T.PROVISION_FAIL, S.PROVISION_FAILED)
    # Joining the tenant's cluster
    add({S.PROVISIONED, S.JOIN_FAILED}, T.JOIN, S.JOINING)
    add(S.JOINING, T.JOINED, S.ACTIVE)
    add(S.JOINING, T.JOIN_FAIL, S.JOIN_FAILED)
    # Release and wipe
    add(ALLOCATED, T.RELEASE, S.RELEASING)
    add({S.RELEASING, S.WIPE_FAILED, S.MAINTENANCE, S.REPAIRING}, T.WIPE, S.WIPING)
    add(S.WIPING, T.WIPED, S.READY)
    add(S.WIPING, T.WIPE_FAIL, S.WIPE_FAILED)
    add({S.RELEASING, S.WIPING, S.WIPE_FAILED, S.MAINTENANCE}, T.CONFIRM_WIPE, S.READY)
    # Attestation: a wipe whose boot measured something other than the golden values ends
    # held, its disks wiped but not back in the pool; so does a discovery boot's.
    add({S.WIPING, S.INSPECTING, S.COMMISSIONING}, T.ATTEST_FAIL, S.ATTESTATION_FAILED)
    add(S.ATTESTATION_FAILED, T.ACCEPT_GOLDEN, S.READY)
    # Technician operations
    add(IDLE | {S.BROKEN}, T.MAINTENANCE_ON, S.MAINTENANCE)
    add(S.MAINTENANCE, T.MAINTENANCE_OFF, S.READY)
    add(set(State) - {S.BROKEN, S.RETIRED}, T.MARK_BROKEN, S.BROKEN)
    add(S.BROKEN, T.REPAIR, S.MAINTENANCE)
    # The repair queue: a technician takes a broken machine's repair; "repaired" leaves
    # through inspect (commissioning) or wipe, both above; a failed verification marks the
    # machine broken again (mark-broken), back in the queue or out for good.
    add(S.BROKEN, T.TAKE_REPAIR, S.REPAIRING)
    add(IDLE | {S.MAINTENANCE, S.BROKEN, S.REPAIRING, S.ATTESTATION_FAILED}, T.RETIRE, S.RETIRED)
    return t


TRANSITIONS: dict[tuple[State, Trigger], State] = _table()

#: The agent phase of each state: an agent token is minted for the phase its machine is in
#: and works only while the machine stays in that phase (``metald.auth``); every transition
#: that changes the phase revokes the machine's agent tokens. States without a phase (broken,
#: maintenance, retired) accept no agent token at all.
PHASES: dict[State, str] = {
    **{s: "inspect" for s in (S.DISCOVERED, S.INSPECTING, S.INSPECT_FAILED, S.READY)},
    #: Commissioning runs in the discovery boot that posted the inventory: the same phase, so
    #: the discovery agent's token carries on; a provisioning or wipe token never works here.
    **{s: "inspect" for s in (S.COMMISSIONING, S.COMMISSION_FAILED)},
    **{s: "provision" for s in ALLOCATED},
    **{s: "wipe" for s in (S.RELEASING, S.WIPING, S.WIPE_FAILED)},
}

#: States whose entry starts a boot metald expects (a new phase): the first script fetch of
#: that boot carries an agent token. A wipe boot is never armed on entry: the tenant's own OS
#: may still run then, so only the driver arms it, after powering the machine off.
ARM_ON_ENTRY = frozenset({S.INSPECTING, S.PROVISIONING})
DISARM_ON_ENTRY = frozenset({S.WIPING, S.RELEASING})
#: Triggers that may bring a machine that owes a wipe back to ready.
WIPE_ENDS = frozenset({T.WIPED, T.CONFIRM_WIPE})
#: Triggers refused while a tenant is attached (a machine marked broken during a claim stays
#: the tenant's until the claim releases it).
TENANT_BLOCKS = frozenset(
    {T.REPAIR, T.TAKE_REPAIR, T.MAINTENANCE_ON, T.MAINTENANCE_OFF, T.INSPECT, T.RETIRE}
)


def sources(trigger: Trigger) -> frozenset[State]:
    """The states ``trigger`` is allowed from."""
    return frozenset(s for (s, t) in TRANSITIONS if t is trigger)


def reachable(start: State, via: frozenset[Trigger]) -> frozenset[State]:
    """``start`` and every state reachable from it through ``via`` triggers only."""
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for (src, t), target in TRANSITIONS.items():
            if src is here and t in via and target not in seen:
                seen.add(target)
                todo.append(target)
    return frozenset(seen)


# ---- sets derived from the table: code elsewhere imports these, never lists states itself ----

#: The retry action: the trigger that starts a failed operation again (the failed state an
#: operation's timeout leads to, and the trigger from there back into the operation).
RETRY: dict[State, Trigger] = {
    TRANSITIONS[(op, fail)]: t
    for op, fail in TIMEOUTS.items()
    for (src, t), target in TRANSITIONS.items()
    if target is op and src is TRANSITIONS[(op, fail)]
}
#: The states an operation ends in when it fails.
FAILED = frozenset(RETRY)
#: States whose operation metald starts by network-booting the machine through its BMC and
#: an agent carries out (the agent asks what to install or wipe, and reports progress).
AGENT_OPERATIONS = frozenset({S.PROVISIONING, S.WIPING})
#: Where a failed BMC step of such an operation sends the machine.
OPERATION_FAIL: dict[State, Trigger] = {s: TIMEOUTS[s] for s in AGENT_OPERATIONS}
#: States whose work the provisioning runner starts with a network boot: those whose entry arms
#: the boot, and those whose wipe boot it arms itself after powering the machine off.
NETWORK_BOOT = ARM_ON_ENTRY | DISARM_ON_ENTRY
#: A machine not (successfully) inspected yet, or being inspected: it boots the discovery image.
UNINSPECTED = frozenset({S.DISCOVERED, S.INSPECTING, S.INSPECT_FAILED})
#: States in which a machine's agent may post its inventory.
INVENTORY_ACCEPTED = sources(T.INSPECTED)
#: States in which the discovery agent runs commissioning checks and may post their results.
COMMISSION_RUNNING = frozenset(TIMEOUTS.keys() & sources(T.COMMISSIONED))
#: States from which a technician's commissioning request boots the discovery image again.
COMMISSION_REQUESTABLE = sources(T.INSPECT) - UNINSPECTED
#: States without an agent phase: out of service (maintenance, broken, retired); an agent
#: that still runs there is told to power off.
OUT_OF_SERVICE = frozenset(State) - PHASES.keys()
#: A tenant's installed node: provisioned and what follows until it leaves the claim. Such a
#: node that boots again (a stateless image lives in RAM) gets a fresh join token, no install.
INSTALLED = reachable(S.PROVISIONED, frozenset({T.JOIN, T.JOINED, T.JOIN_FAIL}))
#: States in which a machine may be handed a join token: it belongs to a tenant and its
#: install has not failed.
JOINABLE = ALLOCATED - {TRANSITIONS[(S.PROVISIONING, TIMEOUTS[S.PROVISIONING])]}
#: States a node starts joining its tenant's cluster from (also a retry).
JOIN_STARTS = sources(T.JOIN)
#: States metald leaves by itself at once (the runner starts provisioning or the wipe).
HANDOFF = frozenset({S.CLAIMED, S.RELEASING})
#: A machine in the repair queue's hands: broken, or taken by a technician (repairing).
IN_REPAIR = reachable(S.BROKEN, frozenset({T.TAKE_REPAIR}))
#: Where a machine of a claim stops moving on its own, from the claim to its release back to
#: ready: neither an operation under way (``TIMEOUTS``) nor a hand-off.
#: Boots whose agent attests (metald.provision.attestation): discovery and wipe boots.
ATTESTED_BOOTS = sources(T.ATTEST_FAIL)
#: The discovery boot (its agent token's phase, while an operation runs): where an attestation
#: key is enrolled, and where a failed attestation holds the machine at once (a wipe boot's
#: hold waits for the wipe to finish).
DISCOVERY_BOOT = frozenset(s for s, ph in PHASES.items() if ph == "inspect") & TIMEOUTS.keys()
SETTLED = (
    (ALLOCATED | reachable(S.RELEASING, frozenset({T.WIPE, T.WIPED, T.WIPE_FAIL})))
    - TIMEOUTS.keys()
    - HANDOFF
)


def boot_on_entry(target: State, new_nonce: Callable[[], str]) -> dict[str, str | None]:
    """Pure given ``new_nonce``: the boot columns a transition into ``target`` sets."""
    if target in ARM_ON_ENTRY:
        return {"boot_armed": new_nonce()}
    if target in DISARM_ON_ENTRY:
        return {"boot_armed": None}
    return {}


def phase_of(state: State | str) -> str | None:
    return PHASES.get(State(state))


def check_guards(
    state: State | str, trigger: Trigger | str, *, tenant_attached: bool, wipe_owed: bool
) -> None:
    """Pure: refuse what the table allows but the machine's data forbids. A machine that held a
    tenant's data reaches ready only through a verified wipe or a technician's confirmation."""
    s, t = State(state), Trigger(trigger)
    target = next_state(s, t)
    if tenant_attached and t in TENANT_BLOCKS:
        raise GuardRefused(
            s,
            t,
            f"cannot {t.value} machine: it still belongs to a tenant's claim; release the claim "
            "(or this machine of it) first, which detaches it and starts its wipe",
        )
    if wipe_owed and (t is T.INSPECT or (target is S.READY and t not in WIPE_ENDS)):
        raise GuardRefused(
            s,
            t,
            f"cannot {t.value} machine: it held a tenant's data and has not been wiped since; "
            "start a wipe (POST /api/v1/machines/{id}/wipe) or, if its disks were erased by "
            "hand, confirm it (POST /api/v1/machines/{id}/confirm-wipe)",
        )


class IllegalTransition(Exception):
    """The trigger is not allowed in the machine's current state. Nothing was changed."""

    def __init__(self, state: State, trigger: Trigger) -> None:
        self.state = state
        self.trigger = trigger
        self.allowed_from = sorted(s.value for (s, t) in TRANSITIONS if t == trigger)
        self.allowed_triggers = allowed_triggers(state)
        hint = ""
        if state in ALLOCATED and trigger in (T.RETIRE, T.MAINTENANCE_ON, T.INSPECT):
            hint = " The machine belongs to a tenant: release it first."
        elif state is S.RETIRED:
            hint = " A retired machine cannot change state."
        super().__init__(
            f"cannot {trigger.value} a machine that is {state.value}; "
            f"{trigger.value} is allowed only from: {', '.join(self.allowed_from)}.{hint}"
        )


class GuardRefused(IllegalTransition):
    """The table allows the trigger but the machine's tenant or owed wipe forbids it. Nothing
    was changed."""

    def __init__(self, state: State, trigger: Trigger, detail: str) -> None:
        super().__init__(state, trigger)
        self.args = (detail,)

    def __str__(self) -> str:
        return str(self.args[0])


def next_state(state: State | str, trigger: Trigger | str) -> State:
    """The state ``trigger`` leads to from ``state``; raises IllegalTransition."""
    s, t = State(state), Trigger(trigger)
    try:
        return TRANSITIONS[(s, t)]
    except KeyError:
        raise IllegalTransition(s, t) from None


def allowed_triggers(state: State | str) -> list[str]:
    s = State(state)
    return sorted(t.value for (src, t) in TRANSITIONS if src == s)
