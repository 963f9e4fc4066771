"""Enrollment rules: labels and rack from what a machine is and where it is cabled. Pure
functions over normalised inventories (what changed at a re-inspection: ``changes``).

A rule in the config file::

    [[enroll.rules]]
    match = { gpu_model = "NVIDIA H100*", rack_position = "leaf-r12/*" }
    labels = { pool = "training" }
    rack = "r12"

Every key of ``match`` must match (shell-style glob, case-insensitive); rules apply in order, later
labels override earlier ones, and the last matching rule that sets ``rack`` wins.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from metald.commissioning.profile import CommissioningProfile
from metald.inventory.normalize import NormalizedInventory

MatchKey = Literal[
    "gpu_model", "gpu_family", "vendor", "product", "rack_position", "cpu_model", "serial"
]


#: Keys that name a machine's own field, never a label: ``rack`` is the rack column, what
#: selectors (``rack=r07``) and the fleet views match, so a label of that name would be a second,
#: silently different rack.
FIELD_NOT_LABEL = frozenset({"rack"})


def field_not_label(key: str) -> str:
    """``key`` unless it names a machine field (ValueError saying how to set that field)."""
    if key in FIELD_NOT_LABEL:
        raise ValueError(
            f"{key!r} is a machine field, not a label: set it with PATCH /api/v1/machines/{{id}} "
            f'{{"{key}": "r07"}} (metalctl machines label ID {key}=r07 does), an enrollment '
            f"rule's {key} =, and select it with {key}=r07"
        )
    return key


class EnrollmentRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Field -> glob. An empty match applies to every machine.
    match: dict[MatchKey, str] = {}
    labels: dict[Annotated[str, AfterValidator(field_not_label)], str] = Field(default_factory=dict)
    rack: str | None = None
    #: Only machines with at least this many GPUs (handy with gpu_family).
    min_gpu_count: int = Field(default=0, ge=0)
    #: What a machine matched by this rule must have and which checks prove it, run between
    #: inspection and ready (docs/commissioning.md); the last matching rule with one wins.
    commissioning: CommissioningProfile | None = None
    #: Desired BIOS attributes (Redfish names): staged as pending settings through the BMC,
    #: applied at the next reboot; a difference later is reported as drift (metald.bmc.firmware).
    bios: dict[str, str | int | bool] = Field(default_factory=dict)


def _value(key: str, inv: NormalizedInventory, rack_position: str | None) -> str | None:
    if key == "rack_position":
        return rack_position or inv.rack_position_hint
    value = getattr(inv, key)
    return None if value is None else str(value)


def rule_matches(rule: EnrollmentRule, inv: NormalizedInventory, rack_position: str | None) -> bool:
    if inv.gpu_count < rule.min_gpu_count:
        return False
    for key, pattern in rule.match.items():
        value = _value(key, inv, rack_position)
        if value is None or not fnmatchcase(value.lower(), pattern.lower()):
            return False
    return True


def apply_rules(
    rules: list[EnrollmentRule], normalized: NormalizedInventory, rack_position: str | None
) -> tuple[dict[str, str], str | None]:
    """Labels and rack for a machine; ``rack_position`` is the switch port (option 82 / LLDP)."""
    labels: dict[str, str] = {}
    rack: str | None = None
    for rule in rules:
        if rule_matches(rule, normalized, rack_position):
            labels.update(rule.labels)
            rack = rule.rack if rule.rack is not None else rack
    return labels, rack


def profile_for(
    rules: list[EnrollmentRule], normalized: NormalizedInventory, rack_position: str | None
) -> CommissioningProfile | None:
    """The commissioning profile of the last matching rule that has one."""
    found = None
    for rule in rules:
        if rule.commissioning is not None and rule_matches(rule, normalized, rack_position):
            found = rule.commissioning
    return found


def bios_profile(
    rules: list[EnrollmentRule], normalized: NormalizedInventory, rack_position: str | None
) -> dict[str, str | int | bool]:
    """The desired BIOS attributes of a machine: every matching rule's, later ones win."""
    profile: dict[str, str | int | bool] = {}
    for rule in rules:
        if rule.bios and rule_matches(rule, normalized, rack_position):
            profile.update(rule.bios)
    return profile
