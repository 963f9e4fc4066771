"""Allocation: all-or-nothing, idempotent, and never one machine to two claims, with threads
on both backends and with separate OS processes on one PostgreSQL database."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
from sqlmodel import select

from metald.claims.allocation import Selector, create_claim
from metald.claims.release import release_claim
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import State
from metald.provision.intents import DeployImage
from metald.store import Store
from metald.store.models import Claim, Event, Machine
from tests.claims.helpers import add_image, add_ready, add_tenant

DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")
ROOT = Path(__file__).resolve().parents[2]


def _claim(store: Store, tenant: str, count: int, image: str, key: str | None = None, **sel):  # type: ignore[no-untyped-def]
    with store.session() as s:
        return create_claim(s, tenant, count, Selector(**sel), image, key, "test", deploy=DEPLOY)


def check_no_double_allocation(store: Store) -> tuple[int, int]:
    """Every claim holds exactly its count; no machine was claimed twice; the tenants of the
    machines are their claims' tenants. Returns (claims, machines allocated)."""
    with store.session() as s:
        claims = {c.id: c for c in s.exec(select(Claim)).all()}
        held = s.exec(select(Machine).where(Machine.claim_id.is_not(None))).all()  # type: ignore[union-attr]
        per_claim = Counter(m.claim_id for m in held)
        for cid, c in claims.items():
            assert per_claim[cid] == c.count, (cid, per_claim[cid], c.count)
        for m in held:
            assert m.tenant_id == claims[m.claim_id].tenant_id  # type: ignore[index]
            assert m.state == State.CLAIMED.value
        claimed_events = Counter(
            e.machine_id
            for e in s.exec(select(Event).where(Event.kind == "machine.state")).all()
            if e.to_state == State.CLAIMED.value
        )
        assert all(n == 1 for n in claimed_events.values()), claimed_events
        assert len(claimed_events) == len(held)
        return len(claims), len(held)


def test_concurrent_claims_from_threads_never_double_allocate(store: Store) -> None:
    add_ready(store, 30)
    tenants = [add_tenant(store, "acme"), add_tenant(store, "globex")]
    image = add_image(store)
    barrier = threading.Barrier(20)
    outcomes: list[str] = []

    def claimer(i: int) -> None:
        barrier.wait()
        try:
            _claim(store, tenants[i % 2], 2, image, key=f"k{i}")
            outcomes.append("ok")
        except Unprocessable as e:
            assert e.extra["available"] < 2
            outcomes.append("refused")

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(outcomes) == {"ok": 15, "refused": 5}
    assert check_no_double_allocation(store) == (15, 30)


CHILD = """
import sys
from metald.claims.allocation import Selector, create_claim
from metald.errors import Unprocessable
from metald.provision.intents import DeployImage
from metald.store import Store

url, tenant, image, n, tag = sys.argv[1:]
store = Store(url)
ok = refused = 0
sys.stdout.write("ready\\n")
sys.stdout.flush()
sys.stdin.readline()  # start together
for i in range(int(n)):
    with store.session() as s:
        try:
            create_claim(s, tenant, 2, Selector(), image, f"{tag}-{i}", tag,
                         deploy=DeployImage("k", "i"))
            ok += 1
        except Unprocessable:
            refused += 1
store.close()
print(ok, refused)
"""


def test_two_processes_on_one_postgresql_never_double_allocate(pg_server) -> None:  # type: ignore[no-untyped-def]
    url = pg_server.new_database()
    store = Store(url)
    store.migrate()
    try:
        add_ready(store, 30)
        tenants = [add_tenant(store, "acme"), add_tenant(store, "globex")]
        image = add_image(store)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, url, tenants[i], image, "12", f"p{i}"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0
            results.append(tuple(int(x) for x in out.split()))
        assert sum(ok for ok, _ in results) == 15
        assert sum(refused for _, refused in results) == 24 - 15
        assert check_no_double_allocation(store) == (15, 30)
    finally:
        store.close()


def test_idempotency_key_returns_the_same_claim(store: Store) -> None:
    add_ready(store, 4)
    acme = add_tenant(store, "acme")
    image = add_image(store)
    first, replayed = _claim(store, acme, 2, image, key="job-7")
    assert not replayed
    again, replayed = _claim(store, acme, 2, image, key="job-7")
    assert replayed and again.id == first.id
    assert check_no_double_allocation(store) == (1, 2)
    with pytest.raises(Conflict, match="different request"):
        _claim(store, acme, 3, image, key="job-7")
    with pytest.raises(Conflict, match="different request"):
        _claim(store, acme, 2, image, key="job-7", min_gpu_count=4)
    # The key is per tenant: another tenant may use it for its own claim.
    globex = add_tenant(store, "globex")
    other, replayed = _claim(store, globex, 2, image, key="job-7")
    assert not replayed and other.id != first.id
    assert check_no_double_allocation(store) == (2, 4)


def test_same_key_raced_from_threads_makes_one_claim(store: Store) -> None:
    add_ready(store, 10)
    acme = add_tenant(store, "acme")
    image = add_image(store)
    barrier = threading.Barrier(6)
    ids: list[str] = []

    def claimer() -> None:
        barrier.wait()
        ids.append(_claim(store, acme, 3, image, key="same")[0].id)

    threads = [threading.Thread(target=claimer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 6 and len(set(ids)) == 1
    assert check_no_double_allocation(store) == (1, 3)


def test_unmet_claim_says_how_many_matched_and_writes_nothing(store: Store) -> None:
    add_ready(store, 3, labels={"pool": "train"})
    add_ready(store, 5, gpu_model="NVIDIA A100-SXM4-80GB", prefix="a")
    acme = add_tenant(store, "acme")
    image = add_image(store)
    _claim(store, acme, 1, image, gpu_model="NVIDIA H100*")
    with pytest.raises(Unprocessable, match="3 match the selector and 2 of them") as err:
        _claim(store, acme, 3, image, gpu_model="NVIDIA H100*", labels={"pool": "train"})
    assert err.value.extra == {"matched": 3, "available": 2, "requested": 3}
    assert check_no_double_allocation(store) == (1, 1)
    # Best fit: an exact ask takes exactly what it needs, from the right model.
    claim, _ = _claim(store, acme, 5, image, gpu_model="NVIDIA A100-SXM4-80GB")
    with store.session() as s:
        got = s.exec(select(Machine).where(Machine.claim_id == claim.id)).all()
        assert {m.gpu_model for m in got} == {"NVIDIA A100-SXM4-80GB"} and len(got) == 5
    with pytest.raises(Unprocessable, match="no image"):
        _claim(store, acme, 1, "nope")
    with pytest.raises(NotFound, match="no tenant"):
        _claim(store, "nope", 1, image)


def test_release_frees_nothing_twice(store: Store) -> None:
    add_ready(store, 2)
    acme = add_tenant(store, "acme")
    claim, _ = _claim(store, acme, 2, add_image(store))
    with store.session() as s:
        assert len(release_claim(s, claim, "test", deploy=DEPLOY)) == 2
        assert release_claim(s, claim, "test", deploy=DEPLOY) == []
        states = {m.state for m in s.exec(select(Machine)).all()}
        assert states == {State.WIPING.value}
