"""A claim's storage layout checked against one machine's inventory disks. Pure.

Root device hints pick the disk an image goes to, as Ironic's do: ``size`` (GiB; an integer is
``==``, or a string with ``>=``, ``<=``, ``>``, ``<``), ``model``, ``vendor`` (substring),
``serial``, ``wwn``, ``name`` (``sda`` or ``/dev/sda``), ``by_path`` (``/dev/disk/by-path/...``,
when the inventory knows it) and ``rotational``; every given hint must hold, and the smallest
disk that fits wins (Ironic's rule). A layout adds

- ``root``: ``{"hints": {...}}`` (one disk) or ``{"raid": 1, "disks": [hints, hints]}`` (an
  mdadm RAID1 over two disks; the image goes onto the array);
- ``volumes``: RAID0/RAID1 arrays and plain disks for scratch, each with ``disks`` (hints or
  ``"rest"``: every disk the layout does not use otherwise), ``fs`` (ext4, xfs), ``mount``,
  optional ``lvm`` (``{"vg": "data", "lvs": [{"name": "scratch", "size_gib": 100}]}``).

``plan(layout, disks)`` answers the disks chosen, or ``LayoutError`` saying why the layout
does not fit this machine (which hint no disk meets, a disk asked for twice, too few disks).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
HINT_KEYS = ("size", "model", "vendor", "serial", "wwn", "name", "by_path", "rotational")
FILESYSTEMS = ("ext4", "xfs")
_SIZE = re.compile(r"^\s*(>=|<=|==|>|<)?\s*(\d+)\s*$")
#: What the deploy agent puts on a command line or in the OS's fstab (docs/deploy-agent.md):
#: volume, volume group and logical volume names (also file system labels; xfs takes 12) and
#: mount points.
_NAME = re.compile(r"^[A-Za-z0-9_]{1,16}$")
_MOUNT = re.compile(r"^/[A-Za-z0-9/_.-]+$")


def _check_name(what: str, name: str, fs: str | None = None) -> None:
    if not _NAME.match(name):
        raise LayoutError(f"{what} {name!r}: use 1-16 letters, digits or _")
    if fs == "xfs" and len(name) > 12:
        raise LayoutError(f"{what} {name!r} labels an xfs file system: use 12 characters at most")


class LayoutError(ValueError):
    """The layout does not fit this machine's disks; the message says what is missing."""


@dataclass(frozen=True)
class DiskInfo:
    name: str
    size_bytes: int
    model: str | None = None
    serial: str | None = None
    wwn: str | None = None
    by_path: str | None = None
    rotational: bool | None = None
    removable: bool | None = None


@dataclass
class Plan:
    #: The devices the image goes to: one disk, or two for a RAID1 root.
    root: list[str]
    root_raid: int | None = None
    #: Scratch volumes: {"name", "raid" (0/1/None), "devices", "fs", "mount", "lvm"}.
    volumes: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "root_raid": self.root_raid, "volumes": self.volumes}


def disks_from_inventory(inventory: Mapping[str, Any] | None) -> list[DiskInfo]:
    out = []
    for d in (inventory or {}).get("disks") or []:
        if d.get("removable"):
            continue
        out.append(
            DiskInfo(
                name=str(d.get("name")),
                size_bytes=int(d.get("size_bytes") or 0),
                model=d.get("model"),
                serial=d.get("serial"),
                wwn=d.get("wwn"),
                by_path=d.get("by_path"),
                rotational=d.get("rotational"),
            )
        )
    return out


def _size_ok(hint: Any, size_bytes: int) -> bool:
    gib = size_bytes // GIB
    if isinstance(hint, int):
        return gib == hint
    m = _SIZE.match(str(hint))
    if not m:
        raise LayoutError(f"size hint {hint!r}: write GiB as a number or '>= 100'")
    op, n = m.group(1) or "==", int(m.group(2))
    return {">=": gib >= n, "<=": gib <= n, "==": gib == n, ">": gib > n, "<": gib < n}[op]


def _by_path(v: Any) -> str:
    """``pci-0000:00:04.0``, with or without ``/dev/disk/by-path/`` before it."""
    return str(v).removeprefix("/dev/disk/by-path/")


def matches(hints: Mapping[str, Any], d: DiskInfo) -> bool:
    for k, v in hints.items():
        if k not in HINT_KEYS:
            raise LayoutError(f"unknown root device hint {k!r}; use {', '.join(HINT_KEYS)}")
        if k == "size":
            if not _size_ok(v, d.size_bytes):
                return False
        elif k == "name":
            if str(v).removeprefix("/dev/") != d.name:
                return False
        elif k in ("model", "vendor"):
            if not d.model or str(v).lower() not in d.model.lower():
                return False
        elif k == "rotational":
            if d.rotational is None or bool(v) != d.rotational:
                return False
        elif k == "wwn":
            if not d.wwn or str(v).lower().removeprefix("0x") != d.wwn.lower().removeprefix("0x"):
                return False
        elif k == "by_path":
            if not d.by_path or _by_path(v) != _by_path(d.by_path):
                return False
        elif str(getattr(d, k) or "") != str(v):
            return False
    return True


def _pick(hints: Mapping[str, Any], disks: list[DiskInfo], used: set[str], what: str) -> DiskInfo:
    fits = sorted(
        (d for d in disks if d.name not in used and matches(hints, d)),
        key=lambda d: (d.size_bytes, d.name),
    )
    if not fits:
        taken = [d.name for d in disks if d.name in used and matches(hints, d)]
        why = f" ({', '.join(taken)} matched but is used already)" if taken else ""
        have = "; ".join(
            f"{d.name} {d.size_bytes // GIB} GiB model={d.model} serial={d.serial}" for d in disks
        )
        raise LayoutError(f"{what}: no disk matches {dict(hints)}{why}; disks: {have or 'none'}")
    used.add(fits[0].name)
    return fits[0]


def plan(layout: Mapping[str, Any] | None, disks: list[DiskInfo]) -> Plan:
    """The disks a layout uses on this machine, or ``LayoutError``."""
    layout = layout or {}
    used: set[str] = set()
    root = layout.get("root") or {}
    if not disks:
        raise LayoutError("the machine's inventory has no disks; inspect it again")
    if root.get("raid") is not None:
        if int(root["raid"]) != 1:
            raise LayoutError("root raid must be 1 (a mirror); RAID0 is for scratch volumes")
        members = root.get("disks") or [{}, {}]
        if len(members) != 2:
            raise LayoutError(f"a RAID1 root needs exactly two disks, got {len(members)}")
        chosen = [_pick(h, disks, used, f"root RAID1 disk {i}") for i, h in enumerate(members)]
        small = min(d.size_bytes for d in chosen)
        if max(d.size_bytes for d in chosen) > 2 * small:
            pass  # mdadm takes the smaller size; allowed, the rest is unused
        root_plan = Plan([d.name for d in chosen], 1)
    else:
        root_plan = Plan([_pick(root.get("hints") or {}, disks, used, "root").name])
    for i, v in enumerate(layout.get("volumes") or []):
        name = str(v.get("name") or f"vol{i}")
        raid = v.get("raid")
        sel = v.get("disks") or []
        if sel == "rest":
            devs = [d for d in sorted(disks, key=lambda d: d.name) if d.name not in used]
            used.update(d.name for d in devs)
        else:
            devs = [_pick(h, disks, used, f"volume {name} disk {j}") for j, h in enumerate(sel)]
        need = {0: 2, 1: 2, None: 1}.get(raid)
        if need is None:
            raise LayoutError(f"volume {name}: raid {raid!r}; use 0, 1 or leave it out")
        if len(devs) < need or (raid is None and len(devs) != 1 and not v.get("lvm")):
            raise LayoutError(
                f"volume {name}: {'RAID' + str(raid) if raid is not None else 'a plain volume'} "
                f"needs {need}{'+' if raid is not None else ''} disks, "
                f"{len(devs)} left ({', '.join(d.name for d in devs) or 'none'})"
            )
        fs = v.get("fs", "ext4")
        if fs not in FILESYSTEMS:
            raise LayoutError(f"volume {name}: file system {fs!r}; use {', '.join(FILESYSTEMS)}")
        if raid == 0:
            size = min(d.size_bytes for d in devs) * len(devs)
        elif raid == 1:
            size = min(d.size_bytes for d in devs)
        else:
            size = sum(d.size_bytes for d in devs)
        lvm = v.get("lvm")
        _check_name("volume name", name, None if lvm else fs)
        mount = v.get("mount")
        if mount is not None and (not _MOUNT.match(str(mount)) or ".." in str(mount)):
            raise LayoutError(
                f"volume {name}: mount point {mount!r}; use an absolute path below / of "
                "letters, digits and /_.-"
            )
        if lvm:
            _check_name("volume group", str(lvm.get("vg") or ""))
            lvs = lvm.get("lvs") or []
            if not lvs:
                raise LayoutError(f"volume {name}: volume group {lvm.get('vg')} has no lvs")
            for lv in lvs:
                _check_name("logical volume", str(lv.get("name") or ""), fs)
            want = sum(int(lv.get("size_gib") or 0) for lv in lvm.get("lvs") or [])
            if want * GIB > size:
                raise LayoutError(
                    f"volume {name}: logical volumes ask {want} GiB, the volume has "
                    f"{size // GIB} GiB"
                )
        root_plan.volumes.append(
            {
                "name": name,
                "raid": raid,
                "devices": [d.name for d in devs],
                "size_bytes": size,
                "fs": fs,
                "mount": v.get("mount"),
                "lvm": lvm,
            }
        )
    return root_plan
