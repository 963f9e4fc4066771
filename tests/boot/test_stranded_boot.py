"""A boot whose script answer was lost (the instance that minted its token died as it answered)
is started again through the BMC by the watchdog, so a fresh token goes only to a boot metald
started; a token an agent used, a boot too young, or a machine without a BMC is left alone (the
last with a technician's event)."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update
from sqlmodel import select

from metald.auth import authenticate
from metald.config import ProvisionConfig
from metald.provision import netboot
from metald.provision.watchdog import MAX_REARMS, REARM_EVENT, STRANDED_EVENT, Watchdog
from metald.store import Store
from metald.store.models import ApiToken, Bmc, Event, Lease, Machine, utcnow
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import boot_token, claimed

CFG = ProvisionConfig(stranded_boot_s=180)
BOOT = [
    ("power", "status"),
    ("power", "off"),
    ("power", "status"),
    ("boot", "pxe"),
    ("power", "on"),
]


def _with_bmc(store: Store, machine_id: str) -> None:
    with store.session() as s:
        s.add(
            Bmc(
                machine_id=machine_id,
                address="10.1.0.5",
                protocol="ipmi",
                username="admin",
                password_enc=b"-",
            )
        )
        s.commit()


def _minted_ago(store: Store, machine_id: str, seconds: int) -> None:
    """The watchdog's clock moved on: the machine's tokens were minted ``seconds`` ago."""
    with store.session() as s:
        s.execute(
            update(ApiToken)
            .where(ApiToken.machine_id == machine_id)  # type: ignore[arg-type]
            .values(created_at=utcnow() - timedelta(seconds=seconds))
        )
        s.commit()


def _kinds(store: Store, machine_id: str) -> list[str]:
    with store.session() as s:
        return list(
            s.exec(select(Event.kind).where(Event.machine_id == machine_id).order_by(Event.id))
        )


async def test_a_token_no_agent_used_is_replaced_by_a_new_bmc_boot(store: Store) -> None:
    mid = claimed(store, 1)[0]
    _with_bmc(store, mid)
    assert await netboot.boot_from_network(store, FakeBmc(), mid, actor="t")
    lost = boot_token(store, mid)  # the fetch took the boot; its answer never arrived
    assert lost is not None
    assert boot_token(store, mid) is None  # "first fetch wins": later fetches get no token
    bmc = FakeBmc()
    dog = Watchdog(store, CFG, "owner", bmc=bmc)
    assert await dog.sweep_once() == []  # minted moments ago: the agent may still be booting
    _minted_ago(store, mid, 181)
    assert await dog.sweep_once() == [mid]
    assert bmc.calls == [(mid, *c) for c in BOOT]  # off confirmed, PXE, a new armed boot, on
    kinds = _kinds(store, mid)
    assert kinds.count(REARM_EVENT) == 1
    assert kinds.index(REARM_EVENT) < len(kinds) - 1 - kinds[::-1].index("provision.network-boot")
    with store.session() as s:
        assert authenticate(s, lost) is None  # the lost token acts for nothing now
    fresh = boot_token(store, mid)  # the next fetch (the new boot's) carries a new token
    assert fresh is not None and fresh != lost
    # An agent that used its token is running: never rebooted under it, however old the token.
    with store.session() as s:
        assert authenticate(s, fresh) is not None
    _minted_ago(store, mid, 3600)
    bmc.calls.clear()
    assert await dog.sweep_once() == [] and bmc.calls == []
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None and m.boot_armed is None and m.boot_current is not None


async def test_without_a_bmc_or_after_the_last_try_a_technician_is_told_once(
    store: Store,
) -> None:
    bare, tried = claimed(store, 2)
    _with_bmc(store, tried)
    bmc = FakeBmc()
    dog = Watchdog(store, CFG, "owner", bmc=bmc)
    # bare: armed on entry to provisioning (no BMC to boot it; a person powered it on)
    for attempt in range(MAX_REARMS + 1):
        assert boot_token(store, tried) is not None
        if attempt == 0:
            assert boot_token(store, bare) is not None
        _minted_ago(store, tried, 200)
        _minted_ago(store, bare, 200)
        moved = await dog.sweep_once()
        assert moved == ([tried] if attempt < MAX_REARMS else []), attempt
    assert await dog.sweep_once() == []
    assert _kinds(store, bare).count(STRANDED_EVENT) == 1
    assert _kinds(store, bare).count(REARM_EVENT) == 0
    assert _kinds(store, tried).count(REARM_EVENT) == MAX_REARMS
    assert _kinds(store, tried).count(STRANDED_EVENT) == 1
    assert sum(1 for c in bmc.calls if c == (tried, "power", "on")) == MAX_REARMS
    assert not any(c[0] == bare for c in bmc.calls)


def _sighted(store: Store, mac: str) -> str:
    """A machine enrolled by its DHCP sighting: discovered (its first script fetch moves it to
    inspecting and takes its first boot), no inventory and so no BMC linked yet (the inventory
    links it)."""
    from metald import machines

    with store.session() as s:
        mid = machines.insert_machine(s, macs=[mac], actor="t", reason="seen on DHCP")
        s.commit()
        m = s.get(Machine, mid)
        assert m is not None and m.state == "discovered" and m.inventory is None
        return mid


async def test_a_first_inspection_without_a_bmc_is_armed_again_in_the_store(
    store: Store,
) -> None:
    """The 10,000-machine fleet run: a script fetch took a new machine's first boot and its
    instance was killed before answering; no BMC is linked before the inventory, so the old
    watchdog only told a technician and the machine sat in ``inspecting`` until its timeout."""
    mid = _sighted(store, "b0:7b:25:00:05:47")
    bmc = FakeBmc()
    dog = Watchdog(store, CFG, "owner", bmc=bmc)
    for attempt in range(MAX_REARMS):
        lost = boot_token(store, mid)  # the fetch took the boot; its answer never arrived
        assert lost is not None, attempt
        assert boot_token(store, mid) is None  # every later fetch: no token
        assert await dog.sweep_once() == []  # too young: its agent may still be booting
        _minted_ago(store, mid, 181)
        assert await dog.sweep_once() == [mid], attempt
        with store.session() as s:
            assert authenticate(s, lost) is None  # the lost token acts for nothing
            m = s.get(Machine, mid)
            assert m is not None and m.boot_armed is not None and m.state == "inspecting"
    assert bmc.calls == []  # nothing to power-cycle: only the store changed
    assert _kinds(store, mid).count(REARM_EVENT) == MAX_REARMS
    # After the last try a technician is told, once, and nothing is armed again.
    assert boot_token(store, mid) is not None
    _minted_ago(store, mid, 181)
    assert await dog.sweep_once() == []
    assert await dog.sweep_once() == []
    assert _kinds(store, mid).count(STRANDED_EVENT) == 1
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None and m.boot_armed is None


async def test_an_inspected_machine_without_a_bmc_is_not_armed_again(store: Store) -> None:
    """Past its first inventory a machine may have been a tenant's: a new token without a
    power cycle metald started is never handed out then (a technician is told)."""
    mid = _sighted(store, "b0:7b:25:00:05:48")
    with store.session() as s:
        s.execute(
            update(Machine)
            .where(Machine.id == mid)  # type: ignore[arg-type]
            .values(inventory={"schema_version": 1})
        )
        s.commit()
    dog = Watchdog(store, CFG, "owner", bmc=FakeBmc())
    assert boot_token(store, mid) is not None
    _minted_ago(store, mid, 181)
    assert await dog.sweep_once() == []
    assert _kinds(store, mid).count(REARM_EVENT) == 0
    assert _kinds(store, mid).count(STRANDED_EVENT) == 1


async def test_a_slow_agent_whose_machine_runs_its_boot_is_not_stranded(store: Store) -> None:
    """The 10,000-machine fleet run (issue 33): under a storm on a starved box an agent's first
    call came minutes after its script, and the old sweep, going by the token's age alone,
    revoked 1,898 live tokens and booted those machines again (1,080 re-armed boots in one
    minute against 210 state changes): enrollment stalled. A machine whose NIC did a DHCP
    exchange after its token was handed out (what its script booted, asking for an address) is
    running that boot: it is left alone until it asks for its script again."""
    mac = "b0:7b:25:00:05:49"
    mid = _sighted(store, mac)
    dog = Watchdog(store, CFG, "owner", bmc=FakeBmc())
    token = boot_token(store, mid)
    assert token is not None
    with store.session() as s:  # the discovery kernel's DHCP, after the script
        s.add(
            Lease(
                network="prov",
                ip="10.0.0.9",
                mac=mac,
                state="bound",
                expires_at=utcnow() + timedelta(hours=1),
                updated_at=utcnow(),
            )
        )
        s.commit()
    _minted_ago(store, mid, 181)
    assert await dog.sweep_once() == []  # the old sweep re-armed it here
    with store.session() as s:  # its agent may still report (read without using the token)
        live = s.exec(select(ApiToken).where(ApiToken.machine_id == mid)).all()
        assert [t.revoked_at for t in live] == [None]
    # It asks for its script again in this boot: that answer was lost after all.
    assert boot_token(store, mid) is None
    assert await dog.sweep_once() == [mid]
    with store.session() as s:
        assert authenticate(s, token) is None
    assert _kinds(store, mid).count(REARM_EVENT) == 1
