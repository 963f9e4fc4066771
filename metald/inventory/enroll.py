"""Enrollment rules (labels and rack from what a machine is and where it is cabled) and
inventory diffs for re-inspection. Pure functions over normalised inventories.

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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from metald.inventory.normalize import NormalizedInventory

MatchKey = Literal[
    "gpu_model", "gpu_family", "vendor", "product", "rack_position", "cpu_model", "serial"
]


class EnrollmentRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Field -> glob. An empty match applies to every machine.
    match: dict[MatchKey, str] = {}
    labels: dict[str, str] = Field(default_factory=dict)
    rack: str | None = None
    #: Only machines with at least this many GPUs (handy with gpu_family).
    min_gpu_count: int = Field(default=0, ge=0)


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


#: Fields whose change is worth an ``inventory.changed`` event (not link state or speed).
_SCALARS = (
    "vendor",
    "product",
    "serial",
    "system_uuid",
    "cpu_model",
    "cpu_count",
    "memory_mb",
    "gpu_model",
    "gpu_count",
)


def _as_dict(inv: NormalizedInventory | dict[str, Any] | None) -> dict[str, Any]:
    if inv is None:
        return {}
    if isinstance(inv, NormalizedInventory):
        return inv.model_dump(mode="json")
    # a stored inventory_document, or a normalized dict
    return inv.get("normalized", inv)


def diff(
    old_inventory: NormalizedInventory | dict[str, Any] | None,
    new_inventory: NormalizedInventory | dict[str, Any],
) -> list[str]:
    """Human-readable differences, e.g. ``gpu_count: 8 -> 7``, ``disk removed: nvme1n1 (...)``.

    Empty when nothing that matters changed. Accepts normalised inventories or the documents
    ``inventory_document`` stores.
    """
    old, new = _as_dict(old_inventory), _as_dict(new_inventory)
    if not old:
        return []
    out = [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in _SCALARS
        if old.get(key) != new.get(key)
    ]
    out += _list_diff(
        "disk",
        old.get("disks", []),
        new.get("disks", []),
        "name",
        ("size_bytes", "serial", "model"),
    )
    out += _list_diff("nic", old.get("nics", []), new.get("nics", []), "mac", ("driver",))
    out += _list_diff(
        "gpu", old.get("gpus", []), new.get("gpus", []), "address", ("model", "serial")
    )
    old_bmc, new_bmc = (old.get("bmc") or {}).get("address"), (new.get("bmc") or {}).get("address")
    if old_bmc != new_bmc:
        out.append(f"bmc address: {old_bmc!r} -> {new_bmc!r}")
    return out


def _describe(kind: str, item: dict[str, Any]) -> str:
    bits = [str(item[k]) for k in ("name", "mac", "address", "model", "serial") if item.get(k)]
    return f"{kind} " + " ".join(dict.fromkeys(bits))


def _list_diff(
    kind: str,
    old: list[dict[str, Any]],
    new: list[dict[str, Any]],
    key: str,
    fields: tuple[str, ...],
) -> list[str]:
    before = {str(i.get(key)): i for i in old}
    after = {str(i.get(key)): i for i in new}
    out = [f"{_describe(kind, before[k])} removed" for k in before if k not in after]
    out += [f"{_describe(kind, after[k])} added" for k in after if k not in before]
    for k in before.keys() & after.keys():
        for f in fields:
            if before[k].get(f) != after[k].get(f):
                out.append(f"{kind} {k} {f}: {before[k].get(f)!r} -> {after[k].get(f)!r}")
    return sorted(out)
