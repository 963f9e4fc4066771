"""Topology placement: which free machines a claim takes when it asks to be packed into one
NVLink domain, rack or InfiniBand leaf, or spread over power domains. Pure.

**Pack.** A claim of ``count`` machines in groups of ``group_size`` (default: one group of
``count``) needs every group inside one domain (two groups may share one). Of all the ways to
place the groups, the allocator takes the one whose free machines per domain, sorted from
largest to smallest, are greatest in lexicographic order: the largest free block left is as
large as it can be, then the second largest, and so on. A wholly free domain is the largest
block there is, so whole domains stay whole while anything else holds the claim; for one group
this is best fit (the domain with the fewest free machines that still holds it). Ties go to
the domain whose name sorts first.

**Spread.** Machines are taken one at a time from the power domain that holds the fewest of the
claim's machines so far (then the one with most free machines, then by name), so the counts per
power domain differ by at most one where the free machines allow.

Machines without the domain asked for (no NVLink fabric, no rack, no known leaf) are never
taken by a placed claim. A claim that cannot be placed raises ``Unplaceable`` with the free
machines per domain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from metald.errors import Unprocessable

#: What a claim may be packed into, and the ``Candidate`` attribute that names it.
PACK_KEYS = {"nvlink-domain": "nvlink_domain", "rack": "rack", "ib-leaf": "ib_leaf"}
SPREAD_KEYS = {"power-domain": "power_domain"}


class Unplaceable(Unprocessable):
    title = "Claim cannot be placed"


@dataclass(frozen=True)
class Placement:
    pack: str | None = None
    spread: str | None = None
    group_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, count: int) -> Placement | None:
        if not d:
            return None
        if not isinstance(d, dict):
            raise Unprocessable('placement must be an object such as {"pack": "nvlink-domain"}')
        unknown = set(d) - {"pack", "spread", "group_size"}
        if unknown:
            raise Unprocessable(f"placement: unknown field(s) {sorted(unknown)}; use pack, "
                                "group_size or spread")  # fmt: skip
        pack, spread, size = d.get("pack"), d.get("spread"), d.get("group_size")
        if (pack is None) == (spread is None):
            raise Unprocessable("placement needs exactly one of pack or spread")
        if pack is not None and pack not in PACK_KEYS:
            raise Unprocessable(f"placement.pack must be one of {sorted(PACK_KEYS)}")
        if spread is not None and spread not in SPREAD_KEYS:
            raise Unprocessable(f"placement.spread must be one of {sorted(SPREAD_KEYS)}")
        if size is not None:
            if spread is not None:
                raise Unprocessable("placement.group_size goes with pack, not spread")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise Unprocessable("placement.group_size must be a whole number of at least 1")
            if count % size:
                raise Unprocessable(
                    f"count {count} is not a multiple of placement.group_size {size}; ask "
                    "for whole groups"
                )
        return cls(pack=pack, spread=spread, group_size=size)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pack": self.pack} if self.pack else {"spread": self.spread}
        if self.group_size is not None:
            out["group_size"] = self.group_size
        return out

    @property
    def key(self) -> str:
        return PACK_KEYS[self.pack] if self.pack else SPREAD_KEYS[self.spread or ""]

    @property
    def kind(self) -> str:
        return self.pack or self.spread or ""


@dataclass(frozen=True)
class Candidate:
    """A free machine matching the claim's selector, with the domains it sits in."""

    id: str
    nvlink_domain: str | None = None
    rack: str | None = None
    ib_leaf: str | None = None
    power_domain: str | None = None


def free_per_domain(candidates: Sequence[Candidate], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in candidates:
        d = getattr(c, key)
        if d:
            out[d] = out.get(d, 0) + 1
    return dict(sorted(out.items()))


def _insert(vec: tuple[int, ...], x: int) -> tuple[int, ...]:
    """``vec`` (sorted from largest) with ``x`` in its place."""
    i = 0
    while i < len(vec) and vec[i] >= x:
        i += 1
    return (*vec[:i], x, *vec[i:])


def pack_groups(free: dict[str, int], groups: int, size: int) -> dict[str, int] | None:
    """How many groups go to each domain (domains getting none left out), or None when they
    do not fit. Exact: a dynamic programme over classes of domains with equal free counts
    (within a class, filling as few domains as possible is best), each step keeping the best
    sorted vector of what is left, which is sound because inserting one number into two sorted
    vectors keeps their lexicographic order."""
    classes: dict[int, list[str]] = {}
    for name, f in free.items():
        classes.setdefault(f, []).append(name)
    vals = sorted(classes)  # smallest free first: the tie-break below prefers them
    fixed: tuple[int, ...] = ()

    def spread_class(f: int, n: int, m: int) -> tuple[int, ...] | None:
        """Remainders of ``n`` domains of ``f`` free holding ``m`` groups, fullest packing."""
        cap = f // size
        if m > cap * n:
            return None
        out: list[int] = []
        left = m
        for _ in range(n):
            k = min(cap, left)
            out.append(f - k * size)
            left -= k
        return tuple(sorted(out, reverse=True))

    # best[r]: (vector, per-class group counts) for the classes seen so far holding r groups.
    best: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {0: (fixed, ())}
    for f in vals:
        n = len(classes[f])
        nxt: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for r, (vec, ks) in best.items():
            for m in range(0, groups - r + 1):
                part = spread_class(f, n, m)
                if part is None:
                    break
                merged = vec
                for x in part:
                    merged = _insert(merged, x)
                cand = (merged, (*ks, m))
                cur = nxt.get(r + m)
                # Ties: more groups in the smaller classes (they come first).
                if cur is None or cand[0] > cur[0]:
                    nxt[r + m] = cand
        best = nxt
    if groups not in best:
        return None
    _vec, ks = best[groups]
    out: dict[str, int] = {}
    for f, m in zip(vals, ks, strict=True):
        cap = f // size
        for name in sorted(classes[f]):
            if m <= 0:
                break
            k = min(cap, m)
            out[name] = k
            m -= k
    return out


def remaining(free: dict[str, int], taken: dict[str, int]) -> tuple[int, ...]:
    """Free machines per domain after ``taken``, sorted from largest: what the rule maximises."""
    return tuple(sorted((f - taken.get(d, 0) for d, f in free.items()), reverse=True))


def _describe(free: dict[str, int], kind: str, limit: int = 12) -> str:
    if not free:
        return f"no free machine that matches has a {kind}"
    parts = [f"{d} {n}" for d, n in sorted(free.items(), key=lambda x: (-x[1], x[0]))]
    more = f" and {len(parts) - limit} more" if len(parts) > limit else ""
    return f"free per {kind}: " + ", ".join(parts[:limit]) + more


def choose(candidates: Sequence[Candidate], count: int, placement: Placement) -> list[str]:
    """The ids to take, ``count`` of them, in ``candidates`` order within each domain (the
    caller orders them best fit first). Raises ``Unplaceable`` saying why not."""
    key = placement.key
    free = free_per_domain(candidates, key)
    by_domain: dict[str, list[str]] = {}
    for c in candidates:
        d = getattr(c, key)
        if d:
            by_domain.setdefault(d, []).append(c.id)
    unplaced = sum(1 for c in candidates if not getattr(c, key))
    note = f"; {unplaced} free matching machine(s) have no {placement.kind}" if unplaced else ""
    if placement.spread:
        total = sum(free.values())
        if total < count:
            raise Unplaceable(
                f"cannot spread {count} machine(s) over power domains: {total} free "
                f"({_describe(free, placement.kind)}){note}; ask for fewer or wait for "
                "machines to be released",
                free_per_domain=free,
                requested=count,
            )
        held = {d: 0 for d in free}
        left = dict(free)
        picked: list[str] = []
        for _ in range(count):
            d = min((d for d in left if left[d] > 0), key=lambda d: (held[d], -left[d], d))
            picked.append(by_domain[d][held[d]])
            held[d] += 1
            left[d] -= 1
        return picked
    size = placement.group_size or count
    groups = count // size
    plan = pack_groups(free, groups, size)
    if plan is None:
        what = (
            f"{count} machine(s) into one {placement.kind}"
            if groups == 1
            else f"{groups} group(s) of {size} machine(s), each in one {placement.kind}"
        )
        raise Unplaceable(
            f"cannot place {what}: {_describe(free, placement.kind)}{note}; ask for fewer or "
            "smaller groups, or wait for machines to be released",
            free_per_domain=free,
            requested=count,
            group_size=size,
        )
    picked = []
    for d, k in sorted(plan.items()):
        picked += by_domain[d][: k * size]
    return picked
