"""A claim that asks ``attested: true`` takes only machines whose current boot passed
attestation (``machines.attested_boot == boot_current``): not one attested in an older boot."""

from __future__ import annotations

import pytest
from sqlmodel import select

from metald.claims.allocation import Selector, create_claim
from metald.errors import MetaldError
from metald.store import Store
from metald.store.models import Machine
from tests.claims.helpers import DEPLOY, add_image, add_ready, add_tenant


def test_attested_claims_take_only_machines_attested_in_their_current_boot(store: Store) -> None:
    fresh, stale, never = add_ready(store, 3)
    with store.session() as s:
        for mid, attested, current in (
            (fresh, "b2", "b2"),
            (stale, "b1", "b2"),
            (never, None, "b2"),
        ):
            m = s.get(Machine, mid)
            assert m is not None
            m.attested_boot, m.boot_current = attested, current
            s.add(m)
        s.commit()
    tenant, image = add_tenant(store, "acme"), add_image(store)
    with store.session() as s, pytest.raises(MetaldError):
        create_claim(s, tenant, 2, Selector(attested=True), image, None, "t", deploy=DEPLOY)
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant, 1, Selector.from_dict({"attested": True}), image, None, "t", deploy=DEPLOY
        )
        taken = s.exec(select(Machine.id).where(Machine.claim_id == claim.id)).all()
    assert taken == [fresh]
