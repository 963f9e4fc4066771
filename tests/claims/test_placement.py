"""The placement rule (metald.claims.placement) against a brute-force oracle: every way to put
the groups in domains is tried, and the allocator's choice must leave the same sorted free
vector as the best of them (and fit whenever any way fits)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metald.claims.placement import (
    Candidate,
    Placement,
    Unplaceable,
    choose,
    pack_groups,
    remaining,
)
from metald.errors import Unprocessable


def oracle(free: dict[str, int], groups: int, size: int) -> tuple[int, ...] | None:
    names = sorted(free)
    best = None
    for combo in itertools.combinations_with_replacement(names, groups):
        taken: dict[str, int] = {}
        for d in combo:
            taken[d] = taken.get(d, 0) + size
        if any(taken[d] > free[d] for d in taken):
            continue
        vec = remaining(free, taken)
        best = vec if best is None or vec > best else best
    return best


@settings(max_examples=400, deadline=None)
@given(
    free=st.dictionaries(
        st.sampled_from([f"d{i}" for i in range(6)]), st.integers(0, 18), max_size=6
    ),
    groups=st.integers(1, 4),
    size=st.integers(1, 18),
)
def test_pack_matches_the_brute_force_oracle(free: dict[str, int], groups: int, size: int) -> None:
    plan = pack_groups(free, groups, size)
    want = oracle(free, groups, size)
    if want is None:
        assert plan is None
        return
    assert plan is not None
    assert sum(plan.values()) == groups
    assert all(k * size <= free[d] for d, k in plan.items())
    assert remaining(free, {d: k * size for d, k in plan.items()}) == want


def _fleet(free: dict[str, int]) -> list[Candidate]:
    return [
        Candidate(id=f"{d}-{i:02d}", nvlink_domain=d, rack=f"rack-{d}", power_domain=f"p{i % 3}")
        for d, n in sorted(free.items())
        for i in range(n)
    ]


def test_single_group_is_best_fit_and_keeps_whole_domains() -> None:
    cands = _fleet({"nvl-a": 18, "nvl-b": 18, "nvl-c": 10, "nvl-d": 17})
    got = choose(cands, 9, Placement(pack="nvlink-domain"))
    assert all(g.startswith("nvl-c-") for g in got)
    got = choose(cands, 16, Placement(pack="nvlink-domain"))
    assert all(g.startswith("nvl-d-") for g in got)  # 17 free: the whole 18s stay whole
    got = choose(cands, 18, Placement(pack="nvlink-domain"))
    assert all(g.startswith("nvl-a-") for g in got)


def test_groups_may_share_a_domain_when_that_keeps_more_whole() -> None:
    # 2 groups of 5 over 9 and 10 free: both in the 10 leaves the 9 untouched.
    assert pack_groups({"a": 9, "b": 10}, 2, 5) == {"b": 2}
    cands = _fleet({"a": 18, "b": 18, "c": 18, "d": 18})
    got = choose(cands, 36, Placement(pack="nvlink-domain", group_size=9))
    assert {g[0] for g in got} == {"a", "b"}  # two domains, two whole ones left


def test_unplaceable_says_free_per_domain() -> None:
    cands = _fleet({"nvl-a": 8, "nvl-b": 12}) + [Candidate(id="loose")]
    with pytest.raises(Unplaceable) as e:
        choose(cands, 16, Placement(pack="nvlink-domain"))
    assert "free per nvlink-domain: nvl-b 12, nvl-a 8" in str(e.value)
    assert "1 free matching machine(s) have no nvlink-domain" in str(e.value)
    assert e.value.extra["free_per_domain"] == {"nvl-a": 8, "nvl-b": 12}


def test_spread_over_power_domains_is_even() -> None:
    cands = _fleet({"x": 9})  # power domains p0, p1, p2 with 3 each
    got = choose(cands, 6, Placement(spread="power-domain"))
    pd = {c.id: c.power_domain for c in cands}
    counts: dict[str, int] = {}
    for g in got:
        counts[pd[g]] = counts.get(pd[g], 0) + 1
    assert sorted(counts.values()) == [2, 2, 2]
    with pytest.raises(Unplaceable):
        choose(cands, 10, Placement(spread="power-domain"))


def test_placement_is_validated() -> None:
    assert Placement.from_dict(None, 4) is None
    p = Placement.from_dict({"pack": "ib-leaf", "group_size": 2}, 4)
    assert p is not None and p.to_dict() == {"pack": "ib-leaf", "group_size": 2}
    for bad in (
        {"pack": "row"},
        {"pack": "rack", "spread": "power-domain"},
        {"pack": "rack", "group_size": 3},
        {"spread": "power-domain", "group_size": 2},
        {"pack": "rack", "extra": 1},
        {},
    ):
        if bad:
            with pytest.raises(Unprocessable):
                Placement.from_dict(bad, 4)
