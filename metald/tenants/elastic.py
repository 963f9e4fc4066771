"""Elastic pools: a tenant's Slurm cluster that grows and shrinks by itself. Pure.

Slurm's power saving does the watching: the pool's node names are written into the tenant's
``slurm.conf`` as ``State=CLOUD`` nodes (reserved up to the pool's max); when jobs need them,
slurmctld runs ``ResumeProgram`` with their names; once idle for ``SuspendTime`` it runs
``SuspendProgram``. Those programs only leave a request in the control plane's spool
(``metald.tenants.elasticspool``); metald turns a resume into one claim per node name and a
suspend into a release. This module holds the decisions and the text: the pool, its
``slurm.conf`` lines, Slurm's hostlist syntax, which names get machines and which are let go.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: A pool's node name prefix: a Slurm node name must also be a hostname.
PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
#: Slurm caps a hostlist range; far more than a pool needs.
MAX_POOL_NODES = 4096
#: Reasons a node is set down with (``sinfo -R`` shows them to the tenant's users).
REASON_POOL_MAX = "elastic: the pool is at its max"
REASON_QUOTA = "elastic: the tenant's quota is used up"
REASON_NO_MACHINE = "elastic: no free machine matches the pool's selector"
REASON_NOT_POOL = "elastic: not a node of an elastic pool"
#: The reasons a freed machine or a raised quota can lift: nodes down with one are retried.
RETRYABLE = (REASON_NO_MACHINE, REASON_QUOTA)
#: The flags sinfo appends to a node's compact state (``down#``, ``idle~``, ``alloc*``).
STATE_FLAGS = "*~#%!$@^-"


class HostlistError(ValueError):
    pass


@dataclass(frozen=True)
class ElasticPool:
    """min..max machines of one selector and image, named ``<prefix>1`` .. ``<prefix><max>``."""

    tenant_id: str
    name: str
    prefix: str
    min_nodes: int
    max_nodes: int
    image_id: str
    selector: Mapping[str, Any] = field(default_factory=dict)
    suspend_time_s: int = 300
    resume_timeout_s: int = 1800

    def __post_init__(self) -> None:
        if not PREFIX_RE.match(self.prefix):
            raise ValueError(
                f"prefix {self.prefix!r}: use 1-31 lowercase letters, digits and '-', "
                "starting with a letter"
            )
        if not 0 <= self.min_nodes <= self.max_nodes <= MAX_POOL_NODES or self.max_nodes < 1:
            raise ValueError(
                f"min {self.min_nodes}, max {self.max_nodes}: need 0 <= min <= max, "
                f"1 <= max <= {MAX_POOL_NODES}"
            )

    @property
    def hostlist(self) -> str:
        return f"{self.prefix}[1-{self.max_nodes}]" if self.max_nodes > 1 else f"{self.prefix}1"

    @property
    def feature(self) -> str:
        return "elastic_" + re.sub(r"[^a-z0-9]+", "_", self.name.lower()).strip("_")

    def node_names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.max_nodes + 1)]

    def owns(self, node: str) -> bool:
        m = re.fullmatch(re.escape(self.prefix) + r"([1-9][0-9]*)", node)
        return m is not None and int(m.group(1)) <= self.max_nodes

    def kept(self) -> list[str]:
        """The names never suspended (the pool's min)."""
        return self.node_names()[: self.min_nodes]


def pool_of(row: Any) -> ElasticPool:
    """The pool a stored row (``metald.store.models.ElasticPoolRow``) describes."""
    return ElasticPool(
        tenant_id=row.tenant_id,
        name=row.name,
        prefix=row.prefix,
        min_nodes=row.min_nodes,
        max_nodes=row.max_nodes,
        image_id=row.image,
        selector=dict(row.selector),
        suspend_time_s=row.suspend_time_s,
        resume_timeout_s=row.resume_timeout_s,
    )


# ---- hostlists ----------------------------------------------------------------------------

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested brackets in {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"unbalanced '[' in {text!r}")
    out.append("".join(cur))
    return out


def expand_hostlist(text: str, *, limit: int = MAX_POOL_NODES) -> list[str]:
    """Slurm's hostlist syntax as ResumeProgram gets it: ``e[1-3,5],f2`` -> e1 e2 e3 e5 f2.

    Zero padding is kept (``n[01-03]`` -> n01 n02 n03); one bracket per name (what slurmctld
    writes). More than ``limit`` names is an error, not a memory blow-up."""
    names: list[str] = []
    text = text.strip()
    if not text:
        return names
    for part in _split_top(text):
        if not part:
            raise HostlistError(f"empty name in {text!r}")
        if "[" not in part:
            if "]" in part:
                raise HostlistError(f"unbalanced ']' in {text!r}")
            names.append(part)
        else:
            head, _, rest = part.partition("[")
            body, _, tail = rest.partition("]")
            if "[" in tail or "]" in tail or not body:
                raise HostlistError(f"cannot read {part!r}")
            for r in body.split(","):
                m = _RANGE.match(r)
                if m is None:
                    raise HostlistError(f"bad range {r!r} in {part!r}")
                lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
                lo, hi = int(lo_s), int(hi_s)
                if hi < lo:
                    raise HostlistError(f"range {r!r} runs backwards")
                if len(names) + (hi - lo + 1) > limit:
                    raise HostlistError(f"{text!r} names more than {limit} nodes")
                width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
                names.extend(f"{head}{i:0{width}d}{tail}" for i in range(lo, hi + 1))
        if len(names) > limit:
            raise HostlistError(f"{text!r} names more than {limit} nodes")
    return names


def compress_hostlist(prefix: str, numbers: Iterable[int]) -> str:
    """``e``, [1, 2, 3, 5] -> ``e[1-3,5]`` (unpadded numbers)."""
    ns = sorted(set(numbers))
    if not ns:
        return ""
    if len(ns) == 1:
        return f"{prefix}{ns[0]}"
    ranges, start, prev = [], ns[0], ns[0]
    for n in ns[1:]:
        if n == prev + 1:
            prev = n
            continue
        ranges.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = n
    ranges.append(f"{start}-{prev}" if prev > start else str(start))
    return f"{prefix}[{','.join(ranges)}]"


# ---- slurm.conf ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Programs:
    """Where the control plane finds the programs slurmctld runs (paths inside its mounts)."""

    resume: str
    suspend: str
    resume_fail: str


def slurm_conf_lines(
    pools: list[ElasticPool], programs: Programs, *, node_conf: str = ""
) -> list[str]:
    """The lines a control plane's ``slurm.conf`` gets for its elastic pools (none: none).

    SuspendTime and ResumeTimeout are set on each pool's own partition (Slurm 21.08+), so the
    cluster's dynamic (``slurmd -Z``) nodes are never powered down by slurmctld; the pool's
    first ``min`` names are in SuspendExcNodes."""
    if not pools:
        return []
    lines = [
        f"ResumeProgram={programs.resume}",
        f"SuspendProgram={programs.suspend}",
        f"ResumeFailProgram={programs.resume_fail}",
        # The nodes are machines: POST and an image install take minutes.
        "SuspendTimeout=300",
        f"ResumeTimeout={max(p.resume_timeout_s for p in pools)}",
        # Cluster-wide: no power saving outside the pools' partitions.
        "SuspendTime=INFINITE",
        "ResumeRate=0",
        "SuspendRate=0",
        "PrivateData=cloud",
    ]
    if any(p.min_nodes for p in pools):
        lines.append(
            "SuspendExcNodes="
            + ",".join(
                compress_hostlist(p.prefix, range(1, p.min_nodes + 1)) for p in pools if p.min_nodes
            )
        )
    extra = f" {node_conf}" if node_conf else ""
    for p in pools:
        lines.append(f"NodeName={p.hostlist} State=CLOUD Feature={p.feature}{extra}")
    for p in pools:
        lines.append(
            f"PartitionName={p.feature} Nodes={p.hostlist} MaxTime=INFINITE State=UP "
            f"SuspendTime={p.suspend_time_s} ResumeTimeout={p.resume_timeout_s}"
        )
    return lines


#: SlurmctldParameters a control plane with pools adds to ``enable_configless``: a CLOUD node
#: registers from whatever address it has (its overlay address), and a powered-down node that
#: is suspended comes back idle, not down.
CLOUD_PARAMETERS = ["cloud_reg_addrs", "idle_on_node_suspend"]


# ---- decisions ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Quota:
    """A tenant's limits on machines held at once (None: no limit)."""

    max_machines: int | None = None
    per_sku: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Holdings:
    """What is held now: the pool's node names with a live claim, the tenant's machines in
    all claims and per SKU (GPU model)."""

    pool_claimed: frozenset[str] = frozenset()
    tenant_machines: int = 0
    tenant_by_sku: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ResumeDecision:
    #: Names to claim a machine for, in the order slurmctld asked.
    claim: list[str]
    #: Names that already hold a claim (a retried request, a metald restarted mid-resume).
    already: list[str]
    #: Name -> the reason it is set down with.
    down: dict[str, str]


def decide_resume(
    pool: ElasticPool,
    names: list[str],
    held: Holdings,
    quota: Quota,
    *,
    sku: str | None,
    free_machines: int,
) -> ResumeDecision:
    """Which of the names slurmctld resumes get a claim. In order, first come: a name gets a
    machine while the pool's max, the tenant's quota (all and per SKU) and the free matching
    machines allow; the others are set down with the reason that stopped them."""
    claim: list[str] = []
    already: list[str] = []
    down: dict[str, str] = {}
    in_pool = len(held.pool_claimed)
    tenant = held.tenant_machines
    per_sku = held.tenant_by_sku.get(sku, 0) if sku else 0
    sku_cap = quota.per_sku.get(sku) if sku else None
    for n in dict.fromkeys(names):
        if not pool.owns(n):
            down[n] = REASON_NOT_POOL
        elif n in held.pool_claimed:
            already.append(n)
        elif in_pool >= pool.max_nodes:
            down[n] = REASON_POOL_MAX
        elif (quota.max_machines is not None and tenant >= quota.max_machines) or (
            sku_cap is not None and per_sku >= sku_cap
        ):
            down[n] = REASON_QUOTA
        elif len(claim) >= free_machines:
            down[n] = REASON_NO_MACHINE
        else:
            claim.append(n)
            in_pool += 1
            tenant += 1
            per_sku += 1
    return ResumeDecision(claim=claim, already=already, down=down)


def decide_suspend(pool: ElasticPool, names: list[str], claimed: set[str]) -> list[str]:
    """Which suspended names are released: the pool's, holding a claim, never one of the
    first ``min`` names (slurmctld does not suspend those; a hand-edited conf might)."""
    kept = set(pool.kept())
    return [n for n in dict.fromkeys(names) if pool.owns(n) and n in claimed and n not in kept]


# ---- what slurmctld's node states say -----------------------------------------------------


@dataclass(frozen=True)
class NodeState:
    """A node as ``sinfo -N -o '%N|%T|%E'`` shows it: compact state and reason."""

    state: str
    reason: str = ""

    @property
    def base(self) -> str:
        return self.state.rstrip(STATE_FLAGS)

    @property
    def powering_up(self) -> bool:
        return "#" in self.state


def powering_up(pools: list[ElasticPool], nodes: Mapping[str, NodeState]) -> list[str]:
    """Pool nodes slurmctld is powering up (and that are not down): each must hold a claim.
    One without is a resume metald never acted on (its request was lost with a killed
    instance's host, or failed); handing these to the resume again is harmless (a name that
    holds a claim is ``already``)."""
    return sorted(
        n
        for n, st in nodes.items()
        if st.powering_up and st.base != "down" and any(p.owns(n) for p in pools)
    )


def stuck(pools: list[ElasticPool], nodes: Mapping[str, NodeState]) -> dict[str, bool]:
    """Pool nodes metald set down for want of a machine (or quota) -> whether slurmctld still
    powers them up (``down#``: it waits for them until ResumeTimeout) rather than having given
    up on them (``down~``). Nodes down for any other reason (an operator's, a failed machine)
    are not metald's to bring back."""
    return {
        n: st.powering_up
        for n, st in sorted(nodes.items())
        if st.base == "down" and st.reason.startswith(RETRYABLE) and any(p.owns(n) for p in pools)
    }
