"""Expected hardware (SKU) profiles, and the pure comparison of an inventory against one.

A profile rides on an enroll rule (``[enroll.rules.commissioning]``): what a machine of that
kind must have, and which checks its commissioning runs, each with a timeout.
``compare_sku`` fails with one sentence naming every difference.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from metald.commissioning.verdict import Verdict, judge

#: Checks the discovery agent knows how to run (``bootassets/agent/metald-commission``).
CheckName = Literal[
    "nvidia-smi",
    "xid",
    "nvlink",
    "dcgm",
    "rocm-smi",
    "ib",
    "stress-ng",
    "memtester",
    "edac",
    "smart",
    "fio",
    "bmc-sel",
]
#: Checks metald runs itself, through the machine's BMC: never sent to the agent, and a report
#: of one from the agent is refused (the host cannot vouch for its own event log).
METALD_CHECKS = frozenset({"bmc-sel"})
#: The SKU comparison runs in metald on the inventory; it is not sent to the agent.
SKU_CHECK = "sku"
_GIB = 1024**3


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckSpec(_Spec):
    name: CheckName
    #: The agent kills the check after this many seconds and reports an error.
    timeout_s: int = Field(default=600, ge=1, le=7 * 86400)
    #: How long a stress or burn-in runs (stress-ng, memtester loops, fio); 0: the tool's
    #: shortest meaningful run.
    duration_s: int = Field(default=0, ge=0, le=7 * 86400)
    #: memtester: MiB of memory to test; 0: a quarter of the free memory, at most 1 GiB.
    size_mb: int = Field(default=0, ge=0, le=1 << 20)
    #: dcgmi diag level (1 quick ... 4 hours).
    level: int = Field(default=1, ge=1, le=4)
    #: A missing tool or device is a failure rather than a skip.
    required: bool = False
    #: fio: floors on every job's read bandwidth (MB/s, 10^6 bytes) and read IOPS.
    min_read_mbps: float | None = Field(default=None, gt=0)
    min_read_iops: float | None = Field(default=None, gt=0)
    #: smart (NVMe): the most wear (percentage_used) and media errors a disk may show, and the
    #: least available spare (%). Unset: wear fails at 90 %, any media error fails.
    max_percentage_used: int | None = Field(default=None, ge=0, le=255)
    min_available_spare: int | None = Field(default=None, ge=0, le=100)
    max_media_errors: int | None = Field(default=None, ge=0)


class NicSpec(_Spec):
    #: At least ``count`` NICs with link up at ``speed_mbps`` or more.
    speed_mbps: int = Field(ge=1)
    count: int = Field(default=1, ge=1)


class DiskSpec(_Spec):
    #: At least ``count`` disks of ``min_size_gb`` (10^9 bytes) or more.
    min_size_gb: float = Field(gt=0)
    count: int = Field(default=1, ge=1)
    rotational: bool | None = None


class IbSpec(_Spec):
    #: At least ``count`` InfiniBand ports Active at ``rate_gbps`` or more.
    count: int = Field(ge=1)
    rate_gbps: int = Field(default=0, ge=0)


class CommissioningProfile(_Spec):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    gpu_model: str | None = None  # glob, case-insensitive
    gpu_count: int | None = Field(default=None, ge=0)
    min_memory_gb: float | None = Field(default=None, gt=0)  # GiB, as the inventory counts it
    cpu_model: str | None = None  # glob
    min_cpu_count: int | None = Field(default=None, ge=1)  # logical CPUs
    nics: list[NicSpec] = []
    disks: list[DiskSpec] = []
    ib: IbSpec | None = None
    checks: list[CheckSpec] = []
    #: Commission again after every release: once the wipe is verified the machine is
    #: inspected and commissioned before it is ready for the next tenant.
    on_release: bool = False

    def plan(self) -> list[dict[str, Any]]:
        """What the agent is told to run (metald's own checks are not in it)."""
        return [c.model_dump() for c in self.agent_checks()]

    def agent_checks(self) -> list[CheckSpec]:
        return [c for c in self.checks if c.name not in METALD_CHECKS]

    def check(self, name: str) -> CheckSpec | None:
        return next((c for c in self.checks if c.name == name), None)


def _glob(value: str | None, pattern: str) -> bool:
    return value is not None and fnmatchcase(value.lower(), pattern.lower())


def compare_sku(profile: CommissioningProfile, inv: Any) -> Verdict:
    """Pure: a ``metald.inventory.normalize.NormalizedInventory`` against the profile; failed
    names every difference. (Typed loosely: the enroll rules in metald.inventory carry the
    profile, so this layer sits below it and cannot import it.)"""
    problems: list[str] = []
    if profile.gpu_model is not None:
        off = sorted({g.model for g in inv.gpus if not _glob(g.model, profile.gpu_model)})
        if off or not inv.gpus:
            found = ", ".join(off) if off else "no GPU"
            problems.append(f"expected GPUs {profile.gpu_model}, found {found}")
    if profile.gpu_count is not None and inv.gpu_count != profile.gpu_count:
        problems.append(f"expected {profile.gpu_count} GPUs, found {inv.gpu_count}")
    mem_gib = None if inv.memory_mb is None else inv.memory_mb / 1024
    if profile.min_memory_gb is not None and (mem_gib is None or mem_gib < profile.min_memory_gb):
        found = "unknown" if mem_gib is None else f"{mem_gib:.1f} GiB"
        problems.append(f"expected at least {profile.min_memory_gb:g} GiB of memory, found {found}")
    if profile.cpu_model is not None and not _glob(inv.cpu_model, profile.cpu_model):
        problems.append(f"expected CPU {profile.cpu_model}, found {inv.cpu_model or 'unknown'}")
    if profile.min_cpu_count is not None and (inv.cpu_count or 0) < profile.min_cpu_count:
        problems.append(
            f"expected at least {profile.min_cpu_count} logical CPUs, found {inv.cpu_count or 0}"
        )
    for spec in profile.nics:
        good = [n for n in inv.nics if n.link and (n.speed_mbps or 0) >= spec.speed_mbps]
        if len(good) < spec.count:
            seen = ", ".join(
                f"{n.name} {n.speed_mbps or '?'} Mb/s{'' if n.link else ' (no link)'}"
                for n in inv.nics
            )
            problems.append(
                f"expected {spec.count} NIC(s) linked at {spec.speed_mbps} Mb/s or more, "
                f"found {len(good)} ({seen or 'no NIC'})"
            )
    for spec in profile.disks:
        floor = spec.min_size_gb * 1e9
        good = [
            d
            for d in inv.disks
            if d.size_bytes >= floor
            and (spec.rotational is None or d.rotational is spec.rotational)
        ]
        if len(good) < spec.count:
            seen = ", ".join(f"{d.name} {d.size_bytes / 1e9:.1f} GB" for d in inv.disks)
            problems.append(
                f"expected {spec.count} disk(s) of {spec.min_size_gb:g} GB or more, "
                f"found {len(good)} ({seen or 'no disk'})"
            )
    values = {
        "gpu_model": inv.gpu_model,
        "gpu_count": inv.gpu_count,
        "memory_gib": None if mem_gib is None else round(mem_gib, 1),
        "cpu_model": inv.cpu_model,
        "cpu_count": inv.cpu_count,
        "nics": [[n.name, n.speed_mbps, n.link] for n in inv.nics],
        "disks": [[d.name, d.size_bytes] for d in inv.disks],
    }
    return judge(problems, f"hardware matches profile {profile.name}", **values)
