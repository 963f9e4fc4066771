"""PostgreSQL itself fails over (Patroni, a synchronous standby) while metald instances take
claims and answer event reads and a DHCP server ACKs leases on the same multi-host URL: a
standby is promoted, every instance follows without a restart, no acknowledged lease, claim or
event is lost, and no instance fences itself (the fencing age, 8 s at metald's defaults, is
longer than the failover). The scenario and what it measures: tests/fleet/pg_failover.py; the
times (printed, never asserted) are in docs/fleet.md from bench/pg_failover.py.

Under METALD_LAB_LONG=1 (``make test-long``): starting etcd, Patroni and two metald processes
takes about a minute on this box.
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
from tests.fleet.pg_failover import failover_round
from tests.fleet.test_dhcp_peers import relay  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        os.environ.get("METALD_LAB_LONG") != "1",
        reason="etcd, Patroni and two metald processes, > 20 s: METALD_LAB_LONG=1 (make test-long)",
    ),
    pytest.mark.skipif(available() is not None, reason=str(available())),
]


@pytest.mark.parametrize("kill", ["postmaster", "node"])
async def test_primary_killed_standby_promoted_nothing_acknowledged_lost(
    tmp_path: Path,
    relay: socket.socket,  # noqa: F811
    kill: str,
) -> None:
    """``postmaster``: the primary's postmaster crashes (its Patroni fails over at once);
    ``node``: its Patroni dies too (the standby waits out the leader key's ``ttl``, 20 s,
    longer than the fencing age: every instance fences itself meanwhile, as it should)."""
    r = await failover_round(tmp_path, relay, kill=kill)
    print("\n" + r.summary())
    print("PG_FAILOVER_JSON " + json.dumps(r.as_json()))  # read by bench/pg_failover.py
    assert r.leader_after != r.leader_before
    assert not r.bad, r.bad  # 2xx or 503 problem+json with Retry-After, never a 500
    assert not r.lost_leases, r.lost_leases
    assert not r.lost_claims, r.lost_claims
    assert not r.lost_events, r.lost_events
    if kill == "postmaster":
        # Patroni's cycle (2 s) against the fencing age (8 s): an instance that fenced itself
        # here would have stopped DHCP and BMC work for a failover it could have ridden out.
        assert not r.fenced, (r.fenced, r.summary())


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
