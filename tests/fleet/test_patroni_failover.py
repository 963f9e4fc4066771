"""PostgreSQL itself fails over (Patroni, a synchronous standby) while metald instances take
claims and answer event reads and a DHCP server ACKs leases on the same multi-host URL: a
standby is promoted, every instance follows without a restart, no acknowledged lease, claim or
event is lost, and no instance fences itself (the fencing age, 8 s at metald's defaults, is
longer than the failover). The scenario and what it measures: tests/fleet/pg_failover.py; the
times (printed, never asserted) are in docs/fleet.md from bench/pg_failover.py.

``cut``: the same with every database host and metald instance in a network namespace of its
own and the primary's host cut off by nftables, then healed (tests/fleet/netcut.py; its fast
counterpart in ``make test``: tests/fleet/test_netcut.py). ``partition``: the primary's host
cut from everything but the standby's host (etcd and metald lost, replication kept): never two
primaries, the same checks as the cut (its fast counterparts: the partition rule in
tests/fleet/test_netcut.py, the settings that order demotion before promotion in
tests/fleet/test_patroni_config.py). The storm test runs the kill -9 and the cut while
bench/storm.py's simulated machines enroll, and ``none``, the same storm without a failover
(the baseline its cost is measured against).

Under METALD_LAB_LONG=1 (``make test-long``): starting etcd, Patroni and two metald processes
takes about a minute on this box; a cut round about two.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fleet.patroni_lab import available
from tests.fleet.pg_failover import Round, failover_round
from tests.fleet.test_dhcp_peers import relay  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="etcd, Patroni and two metald processes, > 20 s: METALD_LAB_LONG=1 (make test-long)",
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


@pytest.mark.parametrize("kill", ["postmaster", "node", "cut", "partition"])
async def test_primary_killed_standby_promoted_nothing_acknowledged_lost(
    tmp_path: Path,
    relay: socket.socket,  # noqa: F811
    kill: str,
) -> None:
    """``postmaster``: the primary's postmaster crashes (its Patroni fails over at once);
    ``node``: its Patroni dies too (the standby waits out the leader key's ``ttl``, 20 s,
    longer than the fencing age: every instance fences itself meanwhile, as it should);
    ``cut``: nftables drops every packet to and from the primary's host (its etcd member
    too), its processes alive; its Patroni demotes it, the standby is promoted after ``ttl``,
    then the cut heals and the old primary rejoins as a replica (pg_rewind where needed);
    ``partition``: the same cut, but the primary's host still reaches the standby's (its
    replication goes on): cut from etcd and from metald, it must demote itself, and the
    standby, which sees it alive all along, must be promoted only once it no longer takes
    writes."""
    r = await failover_round(tmp_path, relay, kill=kill)
    print("\n" + r.summary())
    print("PG_FAILOVER_JSON " + json.dumps(r.as_json()))  # read by bench/pg_failover.py
    assert r.leader_after != r.leader_before
    assert not r.bad, r.bad  # 2xx or 503 problem+json with Retry-After, never a 500
    assert not r.lost_leases, r.lost_leases
    assert not r.lost_claims, r.lost_claims
    assert not r.lost_events, r.lost_events
    if kill in ("cut", "partition"):
        _assert_cut(r)
    if kill == "postmaster":
        # Patroni's cycle (2 s) against the fencing age (8 s): an instance that fenced itself
        # here would have stopped DHCP and BMC work for a failover it could have ridden out.
        assert not r.fenced, (r.fenced, r.summary())


def _assert_cut(r: Round) -> None:
    # The cut-off primary stopped taking writes (Patroni demoted it: it lost the etcd
    # majority) before the cut healed; no acknowledged write is on it alone (synchronous
    # commit), and every one is on it again once it rejoined.
    assert r.demoted_s is not None and r.old_state in ("stopped", "read-only"), r.summary()
    assert not r.both_primary, r.summary()  # never two primaries at once
    assert r.cut_dropped.get("input", 0) > 0, r.cut_dropped  # the cut was real
    assert r.acked_only_on_old == 0, r.summary()
    assert r.rejoined_s is not None, r.summary()
    assert r.replica_missing == 0, r.summary()


@pytest.mark.parametrize("kill", ["postmaster", "cut", "none"])
async def test_failover_during_enrollment_storm(
    tmp_path: Path,
    relay: socket.socket,  # noqa: F811
    kill: str,
) -> None:
    """The same failover while bench/storm.py's simulated machines (300, or
    METALD_PG_FAILOVER_STORM) enroll against the first instance's boot plane: every machine
    reaches ready (its agent retries, as the real one does) and is ready in the database, and
    nothing the load was acknowledged is lost. ``none``: the storm's baseline, no failover
    (bench/pg_failover.py --kill none --storm N), so that the failover's cost is a difference:
    the leader stays."""
    n = int(os.environ.get("METALD_PG_FAILOVER_STORM", "300"))
    r = await failover_round(tmp_path, relay, kill=kill, storm=n)
    print("\n" + r.summary())
    print("PG_FAILOVER_JSON " + json.dumps(r.as_json()))  # read by bench/pg_failover.py
    if kill == "none":
        # Fencing is reported, not asserted: with no failover an instance fences only when its
        # heartbeat is starved for 8 s, which is the box's load, a timing (seen once at load 35).
        assert r.leader_after == r.leader_before, r.summary()
    else:
        assert r.leader_after != r.leader_before
    assert not r.bad, r.bad
    assert not (r.lost_leases or r.lost_claims or r.lost_events), r.summary()
    assert r.storm["ready"] == n and r.storm["ready_in_db"] == n, r.storm
    if kill == "cut":
        _assert_cut(r)


def test_lab_is_cleaned_up_when_its_caller_is_killed() -> None:
    """kill -9 of the process that started the lab: its watchdog kills every etcd, Patroni
    and postmaster and removes the folder."""
    code = (
        "import time\n"
        "from tests.fleet.patroni_lab import PatroniLab\n"
        "lab = PatroniLab().start(); lab.wait_ready(timeout=180)\n"
        "pids = [p.pid for p in lab.etcd] + [n.proc.pid for n in lab.nodes]\n"
        "pids += [n.postmaster_pid() for n in lab.nodes]\n"
        "print(lab.root, *pids, flush=True); time.sleep(600)\n"
    )
    root = Path(__file__).resolve().parents[2]  # `python -c` imports `tests` from here
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line, "the lab did not start"
        folder, pids = Path(line[0]), [int(x) for x in line[1:]]
        assert folder.is_dir() and len(pids) == 7
    finally:
        proc.kill()
        proc.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 60
    while folder.exists() or any(alive(p) for p in pids):
        assert time.monotonic() < deadline, (folder.exists(), [p for p in pids if alive(p)])
        time.sleep(0.1)
