"""kill -9 the owner of a rack's BMCs while a claim is provisioning, with real parts: three
metald processes, each in its own network namespace on the lab's provisioning bridge, one
PostgreSQL (Debian's binaries) in another, two QEMU machines (SeaBIOS, iPXE) with the lab's
virtual BMCs (one driven over IPMI, one over Redfish).

The machines enroll through whichever instance answers their DHCP (and end ready, powered
off); they are powered on again with no network boot in their firmware's order (a warm pool
that does not PXE-boot by itself: it would fetch the claim's provisioning script on its own). A
claim is sent to the instance that owns most
BMCs; the BMCs' owners power the machines off, and the machines are slow to go off (the lab
BMC's hold file), so the kill of that instance lands mid-step. Then:

- the claim completes: a survivor takes the BMCs over, resumes the step from the store's
  journal, and the machines PXE-boot (DHCP and boot script from a live instance), write the
  image and report;
- the BMCs' own command logs show no command twice since the claim: one power-off (from the
  dead instance, for the BMCs it owned), one one-time PXE and one power-on (from a survivor);
- each machine's DHCP lease was renewed after the kill with the address it had before;
- a DHCP probe on the bridge measures when clients of the dead instance are answered again.

Timings are metald's defaults (heartbeat 2 s, dead after 10 s); METALD_TEST_FLEET_TIMINGS=
"0.5,3" runs it faster. The times are printed, never asserted.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.e2e.conftest import lab_skip_reason
from tests.waiting import wait_for

pytestmark = [pytest.mark.lab, pytest.mark.root]

HEARTBEAT_S, DEAD_AFTER_S = (
    float(x) for x in os.environ.get("METALD_TEST_FLEET_TIMINGS", "2,10").split(",")
)
READY_TIMEOUT_S = 480
COMMANDS = {"power off", "power on", "boot pxe once"}


def until(
    what: str, cond: Callable[[], Any], timeout: float, fleet: Any, every: float = 0.5
) -> Any:
    """``tests.waiting.wait_for`` with the fleet's state in the failure."""
    return wait_for(what, cond, timeout, every=every, explain=fleet.diagnostics)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Any]:
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.fleet import LabFleet

    f = LabFleet(
        f"fl{os.getpid() % 10000}",
        tmp_path / "fleet",
        machines=2,
        uefi=0,
        instances=3,
        heartbeat_s=HEARTBEAT_S,
        dead_after_s=DEAD_AFTER_S,
        extra_config="[provision]\nwatchdog_interval_s = 5\n",
    )
    try:
        yield f
    finally:
        f.down()


def leases(fleet: Any) -> dict[str, tuple[str, Any]]:
    """MAC -> (address, expiry) of the bound leases, read from PostgreSQL."""
    db = fleet.database_url.rpartition("/")[2]
    with psycopg.connect(f"host={fleet.pg.dir} port={fleet.pg.port} user=metald dbname={db}") as c:
        rows = c.execute("SELECT mac, ip, expires_at FROM leases WHERE state = 'bound'").fetchall()
    return {mac: (ip, at) for mac, ip, at in rows}


def technician(fleet: Any, method: str, path: str, body: dict[str, Any]) -> None:
    """A technician's BMC command. A 503 (the BMC's ownership is moving) is retried, as the API
    asks callers to, and reported with the store's view, so a refusal in a settled fleet shows."""
    deadline = time.monotonic() + 60
    while True:
        fleet.use(next(iter(fleet.instances)))
        status, out = fleet.api(method, path, body)
        if status == 200:
            return
        assert status == 503, (method, path, status, out)
        print(f"\n{method} {path} {body}: {status} {out} (retried)\n{fleet.store_rows()}")
        assert time.monotonic() < deadline, fleet.diagnostics()
        time.sleep(1)


def owners(fleet: Any, via: str) -> dict[str, str | None]:
    fleet.use(via)
    status, body = fleet.api("GET", "/api/v1/bmcs")
    assert status == 200, body
    return {b["id"]: b["owner_instance"] for b in body["items"]}


@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason=(
        "three instances and two QEMU machines (~1-3 min): METALD_LAB_LONG=1; make test keeps tests/fleet/ (kill -9 takeover, journal resume, partition)"
    ),
)
def test_kill_9_the_bmc_owner_mid_claim_in_a_lab(fleet, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from vmlab.fleet import DhcpProbe

    names = list(fleet.instances)
    address_of = {n: i.address for n, i in fleet.instances.items()}
    bmcs = fleet.register_bmcs(["ipmi", "redfish"])
    for m in fleet.machines:
        fleet.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
    macs = [m["mac"] for m in fleet.machines]
    fleet.wait_state(macs, "ready", READY_TIMEOUT_S)
    assert set(macs) <= set(leases(fleet))

    # Every instance agrees on who owns each BMC, and the store says those hold them; the
    # victim holds most (ties: the first's).
    views = until(
        "every instance to agree on the BMCs' owners",
        lambda: (
            (v := [owners(fleet, n) for n in names])
            and all(x == v[0] for x in v)
            and None not in v[0].values()
            and fleet.bmc_holders() == v[0]  # and the store says they hold them
            and v
        ),
        60,
        fleet,
    )
    owner_of = views[0]
    victim = Counter(owner_of[bmcs[m["name"]]["id"]] for m in fleet.machines).most_common(1)[0][0]
    survivors = [n for n in names if n != victim]
    victims_bmcs = [b for b, o in owner_of.items() if o == victim]

    # DHCP load balancing on the bridge: each probe client is answered by exactly one instance.
    probe = DhcpProbe(fleet.state["netns"], fleet.state["bridge"])
    try:
        probe_macs = [
            ":".join(f"{b:02x}" for b in (2, 0, 0x5E, *random.randbytes(3))) for _ in range(24)
        ]
        answered = probe.discover(probe_macs, timeout=30, linger=1.0)
        assert all(len(a) == 1 for a in answered.values()), answered
        victim_clients = [m for m, a in answered.items() if a[0][0] == address_of[victim]]
        assert victim_clients, f"no probe client fell to {victim}: {answered}"

        # Ready machines are off (the discovery agent powers them off): power them on, as a
        # pool kept warm, with no network boot in their firmware's order, so they do not
        # PXE-boot on their own (they would fetch the claim's provisioning script by
        # themselves; SeaBIOS retries the empty disk instead). The claim goes to the victim;
        # every machine is slow to go off, so the power-off step is cut mid-way.
        for m in fleet.machines:
            fleet.no_network_boot(m)
            on = {"action": "on"}
            technician(fleet, "POST", f"/api/v1/bmcs/{bmcs[m['name']]['id']}/power", on)
            Path(m["bmc_hold_off"]).touch()
        image_args = fleet.publish_test_image(tmp_path)
        fleet.use(victim)
        tenant = fleet.json("tenants", "create", "acme")["id"]
        img = fleet.json("images", "create", "test-disk", *image_args)
        t_claim = time.time()
        claim = fleet.json(
            "claims", "create", "--tenant", tenant, "--count", "2", "--image", img["id"]
        )
        assert {m["id"] for m in claim["machines"]} == {
            fleet.machine_by_mac(mac)["id"] for mac in macs
        }

        def sent(m: dict[str, Any], since: float) -> list[dict[str, Any]]:
            return [c for c in fleet.commands(m) if c["t"] >= since and c["command"] != "read"]

        victim_machines = [m for m in fleet.machines if owner_of[bmcs[m["name"]]["id"]] == victim]
        until(
            f"{victim} to send its power-offs",
            lambda: all(
                any(c["command"] == "power off" for c in sent(m, t_claim)) for m in victim_machines
            ),
            120,
            fleet,
            every=0.1,
        )
        before = leases(fleet)
        killed = fleet.kill(victim)
        t_killed = time.time()

        # Until both happened: a survivor answers the dead instance's DHCP clients, and the
        # survivors hold its BMCs in the store.
        dhcp_s = bmc_s = None
        first_answer: dict[str, list[tuple[str, str]]] = {}
        while dhcp_s is None or bmc_s is None:
            assert time.monotonic() - killed < 120, f"no takeover\n{fleet.diagnostics()}"
            if dhcp_s is None:
                got = probe.discover(victim_clients, timeout=0.25)
                if any(got.values()):
                    dhcp_s = time.monotonic() - killed
                    first_answer = got
            if bmc_s is None:
                now = fleet.bmc_holders()
                if all(now[b] in survivors for b in victims_bmcs):
                    bmc_s = time.monotonic() - killed
        assert all(
            a[0] in {address_of[n] for n in survivors} for v in first_answer.values() for a in v
        )
        later = probe.discover(victim_clients, timeout=30, linger=1.0)
        assert all(len(a) == 1 for a in later.values()), later  # one survivor each, not both
    finally:
        probe.close()

    # The survivor resumes the cut-off step: it reads the power state (the machine is still
    # going off), it does not send the power-off again. Then the machines go off.
    fleet.use(survivors[0])
    until(
        "a survivor to read every held BMC",
        lambda: all(
            any(c["command"] == "read" and c["t"] > t_killed and c["from"] != address_of[victim]
                for c in fleet.commands(m))
            for m in fleet.machines
        ),
        60,
        fleet,
    )  # fmt: skip
    for m in fleet.machines:
        Path(m["bmc_hold_off"]).unlink()

    def states() -> set[str]:
        return {m["state"] for m in fleet.json("claims", "show", claim["id"])["machines"]}

    t0 = time.monotonic()
    until("the claim to complete", lambda: states() == {"provisioned"}, 420, fleet, every=2)
    provisioned_s = time.monotonic() - t0

    # No BMC received any command twice; the power-off came from the dead owner only.
    for m in fleet.machines:
        cmds = sent(m, t_claim)
        counts = Counter(c["command"] for c in cmds)
        assert set(counts) == COMMANDS and all(n == 1 for n in counts.values()), (m["name"], cmds)
        by = {c["command"]: c["from"] for c in cmds}
        assert by["power on"] != address_of[victim], (m["name"], cmds)
        if m in victim_machines:
            assert by["power off"] == address_of[victim], (m["name"], cmds)

    # Each machine booted again through DHCP after the kill and kept its address.
    after = leases(fleet)
    for mac in macs:
        assert after[mac][0] == before[mac][0], (mac, before[mac], after[mac])
        assert after[mac][1] > before[mac][1], f"{mac}: no DHCP lease written after the kill"

    print(
        f"\nfleet failover (heartbeat_s {HEARTBEAT_S}, dead_after_s {DEAD_AFTER_S}; "
        f"{len(victims_bmcs)}/2 BMCs on {victim}): kill -> DHCP of its clients answered by a "
        f"survivor {dhcp_s:.1f} s; kill -> its BMCs held by survivors {bmc_s:.1f} s; "
        f"holds released -> claim provisioned {provisioned_s:.1f} s"
    )
