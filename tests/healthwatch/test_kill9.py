"""``kill -9`` of the process driving a remediation, mid-step, on both backends: the survivor
(another process's workflow, here the test's) finishes it from the stored step; nothing is
done twice in the store and no second replacement is claimed. The scheduler's side is
idempotent: a drain the dead process sent before writing its step is sent again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlmodel import select

from metald.health.remediation import Step
from metald.lifecycle import State
from metald.store.models import Machine
from tests.healthwatch.crash_child import FileScheduler, calls
from tests.healthwatch.helpers import (
    active_claim,
    bmc_fault,
    claim_members,
    events,
    health_cfg,
    rem_rows,
    workflow,
)

ROOT = Path(__file__).resolve().parents[2]


def _run_until_hung(url: str, log: Path, hang_at: str) -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.healthwatch.crash_child", url, str(log), hang_at],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    marker = Path(f"{log}.hung")
    deadline = time.monotonic() + 60
    try:
        while not marker.exists():
            if p.poll() is not None:
                pytest.fail(f"the child ended before hanging: {p.stdout.read().decode()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the child never reached its hang point"
            time.sleep(0.05)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)


@pytest.mark.parametrize("hang_at", ["drain", "replace"])
async def test_kill9_mid_step_survivor_finishes_once(
    store, db_url: str, tmp_path: Path, hang_at: str
) -> None:  # type: ignore[no-untyped-def]
    c = active_claim(store, 1, spares=2)
    cfg = health_cfg()
    bmc_fault(store, c.machines[0], cfg)
    log = tmp_path / "calls.jsonl"
    _run_until_hung(db_url, log, hang_at)
    (row,) = rem_rows(store)
    dead_at = row.step
    assert dead_at == (Step.DRAIN if hang_at == "drain" else Step.REPLACE)
    assert row.replacement_id is None  # killed inside the transaction: nothing claimed
    survivor = workflow(store, FileScheduler(log), cfg, "survivor")
    await survivor.run_all()
    (row,) = rem_rows(store)
    assert row.step == Step.DONE and row.owner == "survivor"
    with store.session() as s:
        assert claim_members(s, c.claim_id) == [row.replacement_id]
        ready = s.exec(select(Machine).where(Machine.state == State.READY)).all()
        assert len(ready) == 1  # one spare taken, never two
        assert s.get(Machine, c.machines[0]).state == State.BROKEN
    done = calls(log)
    assert done.count(("remove", row.node)) == 1
    # the dead process's drain reached the scheduler before its step: sent again (idempotent)
    assert done.count(("drain", row.node)) == (2 if hang_at == "drain" else 1)
    for kind in ("replace", "repair", "done"):
        assert len(events(store, f"health.remediation.{kind}")) == 1
