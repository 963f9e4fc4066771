"""Watchdog timeouts, the retry action, the network-boot step's BMC failure path, and resuming after a
restart (state and boot intent are all in the database). Both backends."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta

import pytest
from sqlalchemy import event, update
from sqlmodel import select

from metald.bmc.base import PowerState
from metald.boot.hooks import BootAction, target_for_machine
from metald.claims.allocation import Selector, create_claim
from metald.config import ProvisionConfig
from metald.lifecycle import State
from metald.provision import netboot
from metald.provision.watchdog import Watchdog, interrupted_boots, sweep, timeouts
from metald.store import Store
from metald.store.models import Event, Machine, utcnow
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DEPLOY, add_image, add_ready, add_tenant, boot_token, claimed

CFG = ProvisionConfig(provisioning_timeout_s=600, claimed_resume_s=60)


def _age(store: Store, ids: list[str], seconds: int) -> None:
    with store.session() as s:
        s.execute(
            update(Machine)
            .where(Machine.id.in_(ids))  # type: ignore[attr-defined]
            .values(state_changed_at=utcnow() - timedelta(seconds=seconds))
        )
        s.commit()


def _get(store: Store, mid: str) -> Machine:
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None
        return m


def test_stuck_provisioning_times_out_then_retry_resumes(store: Store) -> None:
    fresh, stale = claimed(store, 2)
    _age(store, [stale], 601)
    with store.session() as s:
        assert sweep(s, timeouts(CFG), actor="metald:test") == [stale]
        assert sweep(s, timeouts(CFG), actor="metald:test") == []  # idempotent
        ev = s.exec(select(Event).where(Event.kind == "watchdog.timeout")).one()
        assert ev.machine_id == stale and ev.from_state == "provisioning"
    m = _get(store, stale)
    assert m.state == State.PROVISION_FAILED.value and "more than 600 s" in (m.last_error or "")
    assert _get(store, fresh).state == State.PROVISIONING.value
    with store.session() as s:
        m = netboot.retry(s, stale, actor="tech", deploy=DEPLOY)
    assert m.state == State.PROVISIONING.value and m.last_error is None
    assert target_for_machine(m).action is BootAction.PROVISION


def test_racing_sweeps_move_each_machine_once(store: Store) -> None:
    ids = claimed(store, 4)
    _age(store, ids, 3600)
    moved: list[str] = []
    barrier = threading.Barrier(4)

    def sweeper(i: int) -> None:
        barrier.wait()
        with store.session() as s:
            moved.extend(sweep(s, timeouts(CFG), actor=f"metald:i{i}"))

    threads = [threading.Thread(target=sweeper, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(moved) == sorted(ids)
    with store.session() as s:
        assert len(s.exec(select(Event).where(Event.kind == "watchdog.timeout")).all()) == 4


async def test_bmc_failure_fails_provisioning_and_no_bmc_leaves_it(store: Store) -> None:
    failing, absent = claimed(store, 2)
    assert not await netboot.boot_from_network(store, FakeBmc(fail="error"), failing, actor="t")
    m = _get(store, failing)
    assert m.state == State.PROVISION_FAILED.value
    assert m.last_error == "BMC: the BMC did not answer within 10 s"
    assert not await netboot.boot_from_network(store, FakeBmc(fail="absent"), absent, actor="t")
    assert _get(store, absent).state == State.PROVISIONING.value
    with store.session() as s:
        assert (
            s.exec(select(Event).where(Event.kind == "provision.no-bmc")).one().machine_id == absent
        )


async def test_restart_resumes_where_it_was(db_url: str) -> None:
    """A new Store (a restarted metald) on the same database: a provisioning machine still
    boots its image, and a claim interrupted before provisioning is provisioned and rebooted
    by the watchdog."""
    store = Store(db_url)
    store.migrate()
    provisioning = claimed(store, 1)[0]
    add_ready(store, 1, prefix="late")
    with store.session() as s:
        tenant = add_tenant(store, "globex")
        claim, _ = create_claim(
            s, tenant, 1, Selector(), add_image(store, "n2"), None, "t", deploy=DEPLOY
        )
        stalled = s.exec(select(Machine).where(Machine.claim_id == claim.id)).one().id
    store.close()

    store = Store(db_url)
    try:
        target = target_for_machine(_get(store, provisioning))
        assert target.action is BootAction.PROVISION and target.kernel == DEPLOY.kernel
        assert target.kernel_args["metald.image.url"].startswith("http://images.test/")
        bmc = FakeBmc()
        dog = Watchdog(store, CFG, "restarted", bmc=bmc)
        assert await dog.sweep_once() == []  # claimed only moments ago: not stalled yet
        _age(store, [stalled], 61)
        assert await dog.sweep_once() == [stalled]
        assert _get(store, stalled).state == State.PROVISIONING.value
        # Taken first (hard off, confirmed), then a one-time PXE boot, armed, and on.
        assert bmc.calls == [
            (stalled, "power", "status"),
            (stalled, "power", "off"),
            (stalled, "power", "status"),
            (stalled, "boot", "pxe"),
            (stalled, "power", "on"),
        ]
        await dog.start()
        await dog.stop()
    finally:
        store.close()


async def test_restart_resumes_a_boot_cut_off_before_the_bmc_call(store: Store) -> None:
    """metald stopped after moving machines to provisioning/wiping but before the BMC call: the
    next sweep boots each from the network once; a machine whose boot was asked for (or whose
    agent reports) is left alone."""
    cut, booted, reporting = claimed(store, 3)
    bmc = FakeBmc()
    assert await netboot.boot_from_network(store, bmc, booted, actor="t")
    with store.session() as s:  # the agent of a machine booted by hand already reports
        from metald.machines import add_event

        add_event(s, "provision.progress", "agent", machine_id=reporting, data={"percent": 5})
        s.commit()
    with store.session() as s:  # a released machine whose wipe boot was cut off as well
        from metald.claims.release import release_claim

        claim_id = _get(store, cut).claim_id
        assert claim_id
        from metald.store.models import Claim

        c = s.get(Claim, claim_id)
        assert c is not None
        wiping = release_claim(s, c, "t", deploy=DEPLOY)
    assert sorted(wiping) == sorted([cut, booted, reporting])
    _age(store, [cut, booted, reporting], 121)
    with store.session() as s:  # the boot note and the progress came before the wipe began
        s.execute(
            update(Event)
            .where(Event.machine_id.in_([booted, reporting]))  # type: ignore[union-attr]
            .where(Event.kind.in_(["provision.network-boot", "provision.progress"]))  # type: ignore[attr-defined]
            .values(at=utcnow() - timedelta(seconds=200))
        )
        s.commit()
    with store.session() as s:  # so all three still wait for their wipe boot
        from metald.provision.watchdog import interrupted_boots

        assert interrupted_boots(s, 120) == sorted([cut, booted, reporting])
    bmc = FakeBmc()
    dog = Watchdog(store, ProvisionConfig(claimed_resume_s=120), "restarted", bmc=bmc)
    assert sorted(await dog.sweep_once()) == sorted([cut, booted, reporting])
    assert sorted(c[0] for c in bmc.calls if c[1:] == ("power", "on")) == sorted(
        [cut, booted, reporting]
    )
    assert await dog.sweep_once() == []  # resumed once: each left its network-boot note
    assert _get(store, cut).state == State.WIPING.value


async def test_resume_skips_recent_and_handled_provisioning(store: Store) -> None:
    cut, booted, reporting = claimed(store, 3)
    assert await netboot.boot_from_network(store, FakeBmc(), booted, actor="t")
    with store.session() as s:
        from metald.machines import add_event

        add_event(s, "provision.progress", "agent", machine_id=reporting, data={"percent": 5})
        s.commit()
    from metald.provision.watchdog import interrupted_boots

    with store.session() as s:
        assert interrupted_boots(s, 120) == []  # all entered provisioning moments ago
    # Age the state change only: the note and the progress stay newer than it.
    _age(store, [cut, booted, reporting], 300)
    with store.session() as s:
        assert interrupted_boots(s, 120) == [cut]


def test_a_boot_whose_step_is_journaled_is_not_counted_as_cut_off(store: Store) -> None:
    """A step journaled on the machine's BMC (``requested`` by an instance that does not hold
    the BMC, or a command under way) is the BMC holder's to run or resume (unfinished steps),
    however long its queue: the cut-off sweep leaves it alone. At 10,000 machines with 8,000
    claimed it resumed thousands of such boots every sweep (bench/FLEET.md). A journal of an
    older step (an earlier state entry) is no sign for this one. Fails on the old code, which
    did not read the journal."""
    from metald.bmc import ownership
    from metald.bmc.control import step_key
    from metald.store.models import Bmc

    queued, older, bare = claimed(store, 3)
    _age(store, [queued, older, bare], 300)
    with store.session() as s:
        for i, mid in enumerate((queued, older)):
            s.add(
                Bmc(
                    address=f"10.0.9.{i + 1}",
                    protocol="ipmi",
                    username="admin",
                    password_enc=b"x",
                    machine_id=mid,
                )
            )
        s.commit()
        m = s.get(Machine, queued)
        assert m is not None
        ownership.mark_step(s, queued, step_key(m), command="requested", done=False)
        ownership.mark_step(s, older, "ready@2020-01-01T00:00:00+00:00", command=None, done=True)
    with store.session() as s:
        assert interrupted_boots(s, 120) == sorted([older, bare])


def test_daemon_mounts_the_watchdog(cfg) -> None:  # type: ignore[no-untyped-def]
    from metald.daemon import Daemon

    d = Daemon(cfg)
    try:
        dog = d.ctx.services.watchdog
        assert isinstance(dog, Watchdog) and dog.bmc is d.ctx.services.bmc
    finally:
        d.store.close()


async def test_each_service_stops_only_its_own_background_steps(store: Store) -> None:
    """A step the API started in the background is not the watchdog's: stopping the watchdog
    leaves it running; the Provisioner that owns it stops it."""
    started = asyncio.Event()

    async def step() -> None:
        started.set()
        await asyncio.Event().wait()

    from metald.provision.netboot import Provisioner

    owner = Provisioner()
    await owner.start()
    task = owner.spawn(step())
    await started.wait()
    dog = Watchdog(store, ProvisionConfig(watchdog_interval_s=0), "x")
    await dog.start()
    await dog.stop()
    assert not task.done()  # the watchdog's stop() reached no one else's work
    await owner.stop()
    assert task.cancelled()


class _Owner:
    """A fleet view where instance ``a`` owns every machine."""

    fenced = False

    def __init__(self, instance: str) -> None:
        self.instance = instance

    def owns_machine(self, machine_id: str, bmc: tuple[str, str] | None) -> bool:
        return self.instance == "a"

    def owns_bmc(self, bmc_id: str, address: str) -> bool:
        return self.instance == "a"


async def test_a_machine_is_swept_by_its_owner_only(store: Store) -> None:
    stale = claimed(store, 1)[0]
    _age(store, [stale], 601)
    other = Watchdog(store, CFG, "b", bmc=FakeBmc(), ownership=_Owner("b"))
    assert await other.sweep_once() == []
    assert _get(store, stale).state == State.PROVISIONING.value
    mine = Watchdog(store, CFG, "a", bmc=FakeBmc(), ownership=_Owner("a"))
    assert await mine.sweep_once() == [stale]
    assert _get(store, stale).state == State.PROVISION_FAILED.value


def _journal(store: Store, machine_id: str, command: str) -> str:
    """Link a BMC to the machine and journal ``command`` as sent in its current step (as the
    instance that died had done before it was killed)."""
    from metald.bmc import ownership
    from metald.bmc.control import step_key
    from metald.store.models import Bmc

    with store.session() as s:
        s.add(
            Bmc(
                address=f"10.9.0.{len(machine_id) % 200}",
                port=abs(hash(machine_id)) % 60000 + 1,
                protocol="ipmi",
                username="u",
                password_enc=b"x",
                machine_id=machine_id,
            )
        )
        s.commit()
        bid = s.exec(select(Bmc.id).where(Bmc.machine_id == machine_id)).one()
        step = step_key(s.get(Machine, machine_id))  # type: ignore[arg-type]
        assert ownership.check_and_journal(s, bid, None, None, step, command)
    return bid


@pytest.mark.parametrize(
    ("state", "sent", "expected"),
    [
        # The power-off reached the BMC: read until off, never send it again.
        ("wiping", "power:off", [("power", "status"), ("boot", "pxe"), ("power", "on")]),
        # The boot device was journaled, which is done before it is sent: it may never have
        # reached the BMC, so it is set again (a one-time override cannot act twice), then
        # arm and power on.
        ("inspecting", "boot:pxe", [("boot", "pxe"), ("power", "on")]),
        # The power-on was sent and the machine is on: nothing to send.
        ("provisioning", "power:on", [("power", "status")]),
    ],
)
async def test_a_step_cut_off_mid_way_resumes_from_its_journal(
    store: Store, state: str, sent: str, expected: list[tuple[str, str]]
) -> None:
    """A wipe, an inspection or a provisioning whose instance died mid-step is finished by the
    watchdog from the BMC's journal, sending only what was not sent, and only once."""
    mid = claimed(store, 1)[0]
    if state != "provisioning":
        with store.session() as s:
            s.execute(update(Machine).where(Machine.id == mid).values(state=state))  # type: ignore[arg-type]
            s.commit()
    _journal(store, mid, sent)
    bmc = FakeBmc(power_state="off" if sent == "power:off" else "on")
    dog = Watchdog(store, CFG, "survivor", bmc=bmc)
    assert await dog.resume_once() == [mid]
    assert [c[1:] for c in bmc.calls] == expected
    assert await dog.resume_once() == []  # done: journaled as finished
    if sent != "power:on":
        assert boot_token(store, mid), "the resumed step armed the boot"


def test_a_timeout_says_when_the_boot_never_fetched_its_script(store: Store) -> None:
    """A machine whose armed network boot was never fetched (its iPXE refused the certificate
    of a server answering metald's address, say) times out with an event saying so, so the
    boot stops with a sentence a technician can act on; one whose script was fetched does
    not. Fails on the old code (the event said only "stuck")."""
    from metald.provision.boots import arm_boot, take_armed_boot
    from metald.provision.watchdog import UNFETCHED

    unfetched, fetched = claimed(store, 2)
    with store.session() as s:
        for mid in (unfetched, fetched):
            arm_boot(s, mid)
        s.commit()
        m = s.get(Machine, fetched)
        assert m is not None and take_armed_boot(s, m)
        s.commit()
    _age(store, [unfetched, fetched], 601)
    with store.session() as s:
        assert sorted(sweep(s, timeouts(CFG), actor="metald:test")) == sorted([unfetched, fetched])
        events = {
            e.machine_id: e
            for e in s.exec(select(Event).where(Event.kind == "watchdog.timeout")).all()
        }
    assert UNFETCHED in (events[unfetched].reason or "")
    assert events[unfetched].data["script_fetched"] is False
    assert UNFETCHED not in (events[fetched].reason or "")
    assert events[fetched].data["script_fetched"] is True
    assert UNFETCHED in (_get(store, unfetched).last_error or "")


class _SlowOff(FakeBmc):
    """One machine's BMC never reports it off (its power read hangs until released)."""

    def __init__(self, slow: str) -> None:
        super().__init__(power_state="on")
        self.slow = slow
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    async def read_power(self, machine_id: str, *, actor: str = "") -> PowerState:
        if machine_id == self.slow:
            self.waiting.set()
            await self.release.wait()
        return await super().read_power(machine_id, actor=actor)


async def test_one_slow_step_does_not_hold_back_the_others(store: Store) -> None:
    """The watchdog's loop used to await every step it resumed before looking again: one BMC
    slow to report off (up to a minute) held back every step requested of this instance
    meanwhile (the 10,000-machine run's release: 28 wipes waited on one)."""
    slow, fast = claimed(store, 2)
    _journal(store, slow, "requested")
    bmc = _SlowOff(slow)
    dog = Watchdog(store, CFG, "owner", bmc=bmc, resume_interval_s=0.05)
    await dog.start()
    try:
        async with asyncio.timeout(60):
            await bmc.waiting.wait()
        _journal(store, fast, "requested")  # requested while the slow step waits
        async with asyncio.timeout(60):
            while (fast, "power", "on") not in bmc.calls:
                await asyncio.sleep(0.02)
        assert not any(c[0] == slow and c[2] == "on" for c in bmc.calls)
        bmc.release.set()
        async with asyncio.timeout(60):
            while (slow, "power", "on") not in bmc.calls:
                await asyncio.sleep(0.02)
    finally:
        bmc.release.set()
        await dog.stop()


def test_the_sweeps_read_no_json_column_of_the_machines_they_scan(store: Store) -> None:
    """Every instance's watchdog reads every machine in a watched state on each pass. Reading
    whole rows decoded each machine's inventory, labels, BIOS and boot intent (JSON) every
    pass: at 10,000 machines (bench/fleet.py's claims phase, 3,200 provisioning) that was 14 %
    of an instance's CPU, a cost per machine that grew with the phase's length. The scans read
    only the columns they decide on; a machine they move is still read whole, and moved.
    Fails on the old code: the scans selected machines.inventory."""
    fresh, stale = claimed(store, 2)
    with store.session() as s:
        s.execute(
            update(Machine)
            .where(Machine.id.in_([fresh, stale]))  # type: ignore[attr-defined]
            .values(inventory={"cpus": [{"model": "x"}] * 50})
        )
        s.commit()
    _age(store, [stale], 3600)
    statements: list[str] = []

    def seen(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", seen)
    try:
        with store.session() as s:
            cut_off = interrupted_boots(s, 60)
            statements_of_scans = list(statements)
            moved = sweep(s, timeouts(CFG), actor="metald:test")
    finally:
        event.remove(store.engine, "before_cursor_execute", seen)
    assert cut_off == [stale] and moved == [stale]
    scans = [st for st in statements_of_scans if "FROM machines" in st]
    scans.append(next(st for st in statements[len(statements_of_scans) :] if "FROM machines" in st))
    for st in scans:
        assert "machines.inventory" not in st and "machines.labels" not in st, st
    assert _get(store, stale).state == State.PROVISION_FAILED.value
    assert _get(store, fresh).inventory == {"cpus": [{"model": "x"}] * 50}
