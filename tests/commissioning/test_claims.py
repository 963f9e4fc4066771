"""Claims can require commissioning: a selector asks for machines that passed within N days,
or with a named profile; a machine that failed commissioning is never allocated."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlmodel import select

from metald import machines
from metald.claims.allocation import Selector, count_matching, create_claim
from metald.errors import Unprocessable
from metald.lifecycle import Trigger
from metald.provision.intents import DeployImage
from metald.store import Store
from metald.store.models import CommissioningRun, Machine, utcnow
from tests.claims.helpers import add_image, add_ready, add_tenant

DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")


def _run(store: Store, machine_id: str, *, status: str, days_ago: float, profile: str) -> None:
    with store.session() as s:
        s.add(
            CommissioningRun(
                machine_id=machine_id,
                profile=profile,
                status=status,
                requested_by="t",
                finished_at=utcnow() - timedelta(days=days_ago),
            )
        )
        s.commit()


def test_selectors_require_a_recent_passed_run_of_the_profile(store: Store) -> None:
    ids = add_ready(store, 4)
    _run(store, ids[0], status="passed", days_ago=2, profile="h100")
    _run(store, ids[1], status="passed", days_ago=40, profile="h100")
    _run(store, ids[2], status="failed", days_ago=1, profile="h100")
    _run(store, ids[3], status="passed", days_ago=1, profile="burn-in")
    with store.session() as s:
        assert count_matching(s, Selector()) == (4, 4)
        assert count_matching(s, Selector(commissioned_within_days=30)) == (2, 2)
        assert count_matching(
            s, Selector(commissioned_within_days=30, commission_profile="h100")
        ) == (1, 1)
        assert count_matching(s, Selector(commission_profile="h100")) == (2, 2)
    tenant, image = add_tenant(store, "acme"), add_image(store)
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant, 1, Selector(commissioned_within_days=7), image, None, "t", deploy=DEPLOY
        )
        held = s.exec(select(Machine.id).where(Machine.claim_id == claim.id)).all()
        assert set(held) <= {ids[0], ids[3]} and len(held) == 1
    # A selector round-trips through the stored claim (idempotent replays compare them).
    sel = Selector(commissioned_within_days=7, commission_profile="h100")
    assert Selector.from_dict(sel.to_dict()) == sel


def test_a_machine_that_failed_commissioning_is_never_allocated(store: Store) -> None:
    (mid,) = add_ready(store, 1)
    with store.session() as s:
        machines.transition(s, mid, Trigger.INSPECT, actor="t")
        machines.transition(s, mid, Trigger.COMMISSION, actor="t")
        machines.transition(s, mid, Trigger.COMMISSION_FAIL, actor="t")
    tenant, image = add_tenant(store, "acme"), add_image(store)
    with store.session() as s, pytest.raises(Unprocessable, match="0 of them are ready"):
        create_claim(s, tenant, 1, Selector(), image, None, "t", deploy=DEPLOY)
