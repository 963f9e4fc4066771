"""Rendezvous hashing: every instance agrees, and membership changes move about 1/N of keys."""

from __future__ import annotations

from metald.fleet.rendezvous import owner

KEYS = [f"bmc:{i}" for i in range(3000)]


def test_no_members_no_owner() -> None:
    assert owner("bmc:1", []) is None


def test_order_of_members_does_not_matter() -> None:
    a = ["m1", "m2", "m3"]
    assert all(owner(k, a) == owner(k, list(reversed(a))) for k in KEYS[:200])


def test_shares_are_even() -> None:
    members = ["m1", "m2", "m3"]
    counts = {m: 0 for m in members}
    for k in KEYS:
        counts[owner(k, members)] += 1  # type: ignore[index]
    assert all(800 < c < 1200 for c in counts.values()), counts


def test_leaving_moves_only_the_leavers_keys() -> None:
    before = {k: owner(k, ["m1", "m2", "m3"]) for k in KEYS}
    after = {k: owner(k, ["m1", "m3"]) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert moved and all(before[k] == "m2" for k in moved)
    assert len(moved) == sum(1 for k in KEYS if before[k] == "m2")


def test_joining_takes_about_one_nth() -> None:
    before = {k: owner(k, ["m1", "m2", "m3"]) for k in KEYS}
    after = {k: owner(k, ["m1", "m2", "m3", "m4"]) for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "m4" for k in moved)
    assert 0.18 < len(moved) / len(KEYS) < 0.32
