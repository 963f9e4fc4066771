"""Each tenant has its own VLAN id; claim events carry it with the machines' switch ports so
switch automation can move them (metald configures no switch). Both backends."""

from __future__ import annotations

import pytest
from sqlmodel import select

from metald.claims.allocation import Selector, create_claim
from metald.claims.release import release_claim
from metald.errors import Conflict
from metald.store import Store
from metald.store.models import Claim, Event, Machine, Nic
from metald.tenants.clusters import new_tenant
from metald.tenants.ipam import IpamExhausted, allocate_vlan
from tests.claims.helpers import DEPLOY, add_image, add_ready, add_tenant


def test_allocate_vlan_is_lowest_free() -> None:
    assert allocate_vlan([], 100, 102) == 100
    assert allocate_vlan([100, None, 102], 100, 102) == 101
    with pytest.raises(IpamExhausted):
        allocate_vlan([100, 101], 100, 101)


def test_tenants_get_distinct_vlans_until_the_range_runs_out(store: Store) -> None:
    with store.session() as s:
        a = new_tenant(s, name="a", cluster_kind="slurm", vlan_range=(10, 11))
        b = new_tenant(s, name="b", cluster_kind="slurm", vlan_range=(10, 11))
        s.commit()
        assert (a.vlan, b.vlan) == (10, 11)
        with pytest.raises(Conflict, match="every VLAN id from 10 to 11"):
            new_tenant(s, name="c", cluster_kind="slurm", vlan_range=(10, 11))


def test_claim_events_carry_vlan_and_switch_ports(store: Store) -> None:
    ids = add_ready(store, 3)
    with store.session() as s:
        for i, mid in enumerate(ids):
            s.add(Nic(machine_id=mid, mac=f"52:54:00:00:00:0{i}", pxe=True))
            m = s.get(Machine, mid)
            assert m is not None
            m.rack_position = f"leaf1/eth{i}"
            s.add(m)
        s.commit()
    add_tenant(store, "other")  # takes the first VLAN
    tenant = add_tenant(store, "acme")
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant, 2, Selector(), add_image(store), None, "t", deploy=DEPLOY
        )
        ev = s.exec(select(Event).where(Event.kind == "claim.created")).one()
        net = ev.data["network"]
        assert net["vlan"] == 101
        got = {p["machine_id"]: p for p in net["ports"]}
        assert len(got) == 2 and set(got) <= set(ids)
        for mid, port in got.items():
            i = ids.index(mid)
            assert port["switch_port"] == f"leaf1/eth{i}"
            assert port["macs"] == [f"52:54:00:00:00:0{i}"]
        c = s.get(Claim, claim.id)
        assert c is not None
        release_claim(s, c, "t", deploy=DEPLOY)
        rel = s.exec(select(Event).where(Event.kind == "claim.released")).one()
        assert rel.data["network"]["vlan"] == 101
        assert {p["machine_id"] for p in rel.data["network"]["ports"]} == set(got)


def test_release_one_machine_scales_the_claim_down(store: Store) -> None:
    add_ready(store, 2)
    tenant = add_tenant(store, "acme")
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant, 2, Selector(), add_image(store), None, "t", deploy=DEPLOY
        )
        first, second = (m.id for m in s.exec(select(Machine).where(Machine.claim_id == claim.id)))
        c = s.get(Claim, claim.id)
        assert c is not None
        assert release_claim(s, c, "t", deploy=DEPLOY, only={first}) == [first]
        s.refresh(c)
        assert c.state == "allocated"
        ev = s.exec(select(Event).where(Event.kind == "claim.machines.released")).one()
        assert [p["machine_id"] for p in ev.data["network"]["ports"]] == [first]
        assert release_claim(s, c, "t", deploy=DEPLOY, only={first}) == []
        assert release_claim(s, c, "t", deploy=DEPLOY, only={second}) == [second]
        s.refresh(c)
        assert c.state == "released"
