"""BMC ownership in the store: acquired only from nobody alive, a generation per acquisition,
and a command sent only while the sender still holds the BMC at its generation. Both backends;
a real ipmi_sim counts what reached the BMC."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from metald.bmc import ownership
from metald.bmc.base import PowerAction
from metald.bmc.control import NotOwner
from metald.bmc.service import BmcService
from metald.config import BmcConfig
from metald.fleet import registry
from metald.machines import create_machine
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Bmc, Instance, utcnow
from tests.bmc.peers import IpmiSim, ipmi_sim  # noqa: F401 - fixture
from tests.conftest import LAB_BMC_NETWORKS

DEAD_AFTER_S = 10.0


def _instance(store: Store, name: str) -> None:
    with store.session() as s:
        registry.register(
            s,
            name=name,
            incarnation=name,
            version="t",
            api_url=None,
            host=None,
            serves={},
            dead_after_s=DEAD_AFTER_S,
        )


def _kill(store: Store, name: str) -> None:
    """The instance's last heartbeat was long ago: it is dead to everybody."""
    with store.session() as s:
        s.execute(
            update(Instance)
            .where(Instance.name == name)  # type: ignore[arg-type]
            .values(heartbeat_at=utcnow() - timedelta(seconds=60))
        )
        s.commit()


def _bmc(store: Store) -> str:
    with store.session() as s:
        b = Bmc(address="10.1.0.5", protocol="ipmi", username="u", password_enc=b"x")
        s.add(b)
        s.commit()
        return b.id


def test_acquire_takes_only_what_no_live_instance_holds(store: Store) -> None:
    _instance(store, "a")
    _instance(store, "b")
    bid = _bmc(store)
    with store.session() as s:
        assert ownership.acquire(s, "a", [bid], DEAD_AFTER_S) == {bid: 1}
        assert ownership.acquire(s, "a", [bid], DEAD_AFTER_S) == {bid: 1}  # held: unchanged
        assert ownership.acquire(s, "b", [bid], DEAD_AFTER_S) == {}  # a is alive
        assert ownership.check_and_journal(s, bid, "a", 1, None, "power:on")
    _kill(store, "a")
    with store.session() as s:
        assert ownership.acquire(s, "b", [bid], DEAD_AFTER_S) == {bid: 2}
        # The old owner's generation no longer matches: it must not send.
        assert not ownership.check_and_journal(s, bid, "a", 1, None, "power:on")
        assert ownership.check_and_journal(s, bid, "b", 2, "s1", "power:off")
        assert ownership.read_step(s, "nope", "s1") is None
        # b gives it back (the hash moved it): a live a can take it at a new generation.
        assert ownership.acquire(s, "b", [], DEAD_AFTER_S, release_others=True) == {}
        assert s.get(Bmc, bid).owner is None  # type: ignore[union-attr]


@dataclass
class View:
    """What a Membership tells BMC control: this instance's name, whether it is fenced, and
    who it believes owns a BMC (frozen here, as a stalled instance's view would be)."""

    instance: str
    owner: str | None
    fenced: bool = False
    dead_after_s: float = DEAD_AFTER_S
    lease_epoch: int = 0

    def lease_until(self) -> float:
        return 0.0 if self.fenced else float("inf")

    def bmc_owner(self, bmc_id: str, address: str) -> str | None:
        return self.owner

    def owns_bmc(self, bmc_id: str, address: str) -> bool:
        return not self.fenced and self.owner == self.instance


@pytest.fixture
async def svc(store: Store, tmp_path: Path):  # type: ignore[no-untyped-def]
    cfg = BmcConfig(
        networks=LAB_BMC_NETWORKS,
        min_interval_ms=0,
        timeout_s=3,
        retries=1,
        power_sync_interval_s=0,
    )
    service = BmcService(store, SecretBox.from_file(tmp_path / "k"), cfg, instance="a")
    yield service
    await service.stop()


async def _registered(svc: BmcService, store: Store, sim: IpmiSim) -> tuple[str, str]:
    def machine(s):  # type: ignore[no-untyped-def]
        m = create_machine(s, macs=["52:54:00:00:10:01"], actor="test")
        return m.id

    mid = await store.run(machine)
    b = await svc.register("127.0.0.1", sim.port, "ipmi", "admin", sim.password, machine_id=mid)
    return mid, b["id"]


def _sets(sim: IpmiSim) -> list[str]:
    return [c for c in sim.calls() if c.startswith("set ")]


async def test_a_superseded_owner_sends_nothing(
    svc: BmcService,
    store: Store,
    ipmi_sim: IpmiSim,  # noqa: F811
) -> None:
    """a held the BMC and still believes it does (a stale view); b took it over in the store
    after a was judged dead. a's command is refused by the store check, before the BMC."""
    _instance(store, "a")
    _instance(store, "b")
    mid, bid = await _registered(svc, store, ipmi_sim)
    svc.ownership = View("a", owner="a")
    assert await svc.control.power(mid, PowerAction.ON) == "on"
    assert _sets(ipmi_sim) == ["set power 1"]
    _kill(store, "a")
    with store.session() as s:
        assert ownership.acquire(s, "b", [bid], DEAD_AFTER_S) == {bid: 2}
    with pytest.raises(NotOwner, match="taken over"):
        await svc.control.power(mid, PowerAction.OFF)
    assert _sets(ipmi_sim) == ["set power 1"]  # the off never reached the BMC


async def test_a_fenced_or_non_owner_instance_sends_nothing(
    svc: BmcService,
    store: Store,
    ipmi_sim: IpmiSim,  # noqa: F811
) -> None:
    _instance(store, "a")
    mid, _ = await _registered(svc, store, ipmi_sim)
    svc.ownership = View("a", owner="a", fenced=True)
    with pytest.raises(NotOwner, match="cannot reach the store"):
        await svc.control.power(mid, PowerAction.OFF)
    svc.ownership = View("a", owner="b")
    with pytest.raises(NotOwner, match="owned by instance b") as e:
        await svc.power(mid, "cycle")
    assert e.value.status == 503 and e.value.extra["owner_instance"] == "b"
    assert _sets(ipmi_sim) == []


async def test_sync_ownership_acquires_and_releases(
    svc: BmcService,
    store: Store,
    ipmi_sim: IpmiSim,  # noqa: F811
) -> None:
    _instance(store, "a")
    _, bid = await _registered(svc, store, ipmi_sim)
    svc.ownership = View("a", owner="a")
    await svc.control.sync_ownership()
    assert svc.control.held == {bid: 1}
    svc.ownership = View("a", owner="b")  # the hash moved it (b joined)
    await svc.control.sync_ownership()
    assert svc.control.held == {}
    with store.session() as s:
        assert s.get(Bmc, bid).owner is None  # type: ignore[union-attr]
