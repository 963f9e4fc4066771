"""What changed between two inventories of a machine (a re-inspection), in sentences for the
``inventory.changed`` event. Pure functions over normalised inventories."""

from __future__ import annotations

from typing import Any

from metald.inventory.normalize import NormalizedInventory

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
