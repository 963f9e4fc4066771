"""What a wipe must prove before a machine goes back to the pool. Pure.

The agent reports, per disk it wiped: ``device`` (/dev/NAME), ``size_bytes``, ``method`` (what
it did) and ``reads`` (the verification reads after wiping: offset, length, and whether every
byte read was zero). A report is plausible when every disk the machine's inventory recorded
(non-removable, with a size) is there with its recorded size, wiped by a known method, and
read back as zeros over its first and last MiB (where partition tables, both GPT copies and
most file-system signatures live). This cannot prove the bytes were written (a hostile
machine can lie about anything it reads); it stops a report that claims a wipe without
naming the machine's disks, and ties every accepted wipe to a record of what was done.
"""

from __future__ import annotations

from typing import Any

MIB = 1 << 20
#: What the agent may say it did (bootassets/agent/metald-agent, wipe_disk).
METHODS = frozenset({"zero-ends", "discard+zero-ends", "secure-discard+zero-ends"})
#: Block devices the agent never wipes and the inventory does not count as disks.
_NOT_DISKS = ("loop", "ram", "zram", "dm-", "sr", "md", "nbd", "fd")


def recorded_disks(inventory: dict[str, Any] | None) -> dict[str, int]:
    """The machine's disks as inspection recorded them: name -> size in bytes."""
    inv = inventory or {}
    disks = (inv.get("payload") or {}).get("disks")
    if disks is None:
        disks = (inv.get("normalized") or {}).get("disks") or []
    out: dict[str, int] = {}
    for d in disks:
        name, size = str(d.get("name") or ""), d.get("size_bytes")
        if not name or name.startswith(_NOT_DISKS) or d.get("removable"):
            continue
        if isinstance(size, int) and size > 0:
            out[name] = size
    return out


def _ends_read(disk: dict[str, Any], size: int) -> list[str]:
    n = min(MIB, size)
    reads = disk.get("reads")
    if not isinstance(reads, list):
        return ["no verification reads"]
    seen = set()
    for r in reads:
        if not isinstance(r, dict) or r.get("zero") is not True or r.get("length") != n:
            continue
        seen.add(r.get("offset"))
    missing = [what for what, off in (("first", 0), ("last", size - n)) if off not in seen]
    return [f"no zero read of its {w} {n} bytes" for w in missing]


def evidence_problems(evidence: Any, recorded: dict[str, int]) -> list[str]:
    """Why ``evidence`` does not show the recorded disks wiped; empty when it does."""
    if not recorded:
        return [
            "metald has no disks recorded for this machine, so no wipe report can be checked; "
            "a technician confirms the wipe instead"
        ]
    if not isinstance(evidence, list) or not evidence:
        return ["the report has no per-disk evidence (disks: device, size_bytes, method, reads)"]
    by_name: dict[str, dict[str, Any]] = {}
    problems = []
    for d in evidence:
        dev = str(d.get("device") or "") if isinstance(d, dict) else ""
        if not dev.startswith("/dev/"):
            problems.append(f"evidence entry {d!r} names no /dev device")
            continue
        by_name[dev.removeprefix("/dev/")] = d
    for name, size in sorted(recorded.items()):
        d = by_name.get(name)
        if d is None:
            problems.append(f"/dev/{name} ({size} bytes, recorded at inspection) was not wiped")
            continue
        if d.get("size_bytes") != size:
            problems.append(
                f"/dev/{name} reported {d.get('size_bytes')} bytes; inspection recorded {size}"
            )
            continue
        if d.get("method") not in METHODS:
            problems.append(f"/dev/{name}: unknown wipe method {d.get('method')!r}")
        problems += [f"/dev/{name}: {p}" for p in _ends_read(d, size)]
    return problems
