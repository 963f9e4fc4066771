"""The DHCP server's memory of clients it reported to the hooks stays bounded."""

from __future__ import annotations

from metald.boot.dhcp.server import RecentClients


def test_due_when_new_moved_or_stale() -> None:
    r = RecentClients(limit=10, ttl_s=300)
    assert r.due("a", None, 0)
    r.mark("a", None, 0)
    assert not r.due("a", None, 299)
    assert r.due("a", {"circuit_id": "swp2"}, 10)  # moved to another port
    assert r.due("a", None, 300)  # stale
    r.forget("a")
    assert r.due("a", None, 1)


def test_a_flood_of_macs_stays_bounded_and_keeps_the_latest() -> None:
    r = RecentClients(limit=100, ttl_s=300)
    for i in range(10_000):
        r.mark(f"m{i}", None, float(i) / 1000)  # all fresh: within the TTL
        assert len(r) <= 100
    assert not r.due("m9999", None, 10.0)  # the newest are kept
    assert r.due("m0", None, 10.0)  # the oldest were forgotten (a repeat hook call at worst)


def test_expired_entries_go_first() -> None:
    r = RecentClients(limit=4, ttl_s=10)
    for i, mac in enumerate("abcd"):
        r.mark(mac, None, float(i))
    r.mark("b", None, 20.0)  # b reported again: now the newest
    r.mark("e", None, 21.0)  # over the limit: a, c, d are stale (> 10 s) and go
    assert len(r) == 2 and not r.due("b", None, 21.0) and not r.due("e", None, 21.0)
