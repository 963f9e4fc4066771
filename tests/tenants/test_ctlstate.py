"""The Slurm controller's state in the store: restored on the next owner, fenced against an
old owner, kept in place on a restart (both backends)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metald.store.models import TenantCtlState
from metald.tenants import ctlstate
from tests.tenants.conftest import Env


@pytest.fixture(autouse=True)
def _no_duty_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves right after one another (the duty cycle has its own test)."""
    monkeypatch.setattr(ctlstate, "SAVE_DUTY", 0)


def _write(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def test_next_owner_restores_old_owner_is_fenced(env: Env, tmp_path: Path) -> None:
    tid = env.tokens.tenant_a
    a, b = tmp_path / "a" / "slurm" / "state", tmp_path / "b" / "slurm" / "state"
    ka = ctlstate.Keeper(env.store, env.box, tid, "rack0", a)
    got = ka.take()
    assert not got.restored and a.is_dir()
    _write(a, {"job_state": b"jobs-1", "hash.7/job.7/script": b"#!/bin/sh\n"})
    assert ka.save_if_changed()
    assert not ka.save_if_changed()  # nothing changed: nothing written

    kb = ctlstate.Keeper(env.store, env.box, tid, "rack1", b)
    got = kb.take()
    assert got.restored
    assert (b / "job_state").read_bytes() == b"jobs-1"
    assert (b / "hash.7/job.7/script").read_bytes() == b"#!/bin/sh\n"

    # The old owner (judged dead, still running) cannot overwrite the new one's state.
    _write(a, {"job_state": b"stale"})
    with pytest.raises(ctlstate.Superseded):
        ka.save_if_changed()
    _write(b, {"job_state": b"jobs-2"})
    assert kb.save_if_changed()
    with env.store.session() as s:
        data = ctlstate.read(s, env.box, tid)
        row = s.get(TenantCtlState, tid)
        assert row is not None and row.owner == "rack1"
        # Encrypted: the state's bytes are not in the row.
        assert b"jobs-2" not in row.data_enc
    assert data is not None and ctlstate.files(data)["job_state"] == b"jobs-2"

    # The hub comes back to rack0: its folder is stale (rack1 held it since): replaced.
    assert ctlstate.Keeper(env.store, env.box, tid, "rack0", a).take().restored
    assert (a / "job_state").read_bytes() == b"jobs-2"


def test_restart_in_place_keeps_the_newer_local_state(env: Env, tmp_path: Path) -> None:
    tid = env.tokens.tenant_a
    folder = tmp_path / "slurm" / "state"
    k = ctlstate.Keeper(env.store, env.box, tid, "rack0", folder)
    k.take()
    _write(folder, {"job_state": b"saved"})
    k.save_if_changed()
    _write(folder, {"job_state": b"newer, written after the last snapshot"})
    # metald restarts here: nobody took the hub since, so the local folder is kept.
    again = ctlstate.Keeper(env.store, env.box, tid, "rack0", folder)
    assert not again.take().restored
    assert (folder / "job_state").read_bytes() == b"newer, written after the last snapshot"


def test_too_large_a_snapshot_is_not_written(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = env.tokens.tenant_a
    folder = tmp_path / "state"
    k = ctlstate.Keeper(env.store, env.box, tid, "rack0", folder)
    k.take()
    _write(folder, {"job_state": b"small"})
    k.save_if_changed()
    monkeypatch.setattr(ctlstate, "MAX_SNAPSHOT_BYTES", 64)
    _write(folder, {"big": os.urandom(4096)})
    k.save_if_changed()
    with env.store.session() as s:
        data = ctlstate.read(s, env.box, tid)
    assert data is not None and set(ctlstate.files(data)) == {"job_state"}

    # Not packed again at every interval while nothing changed.
    def boom(folder: Path) -> bytes:
        raise AssertionError("packed again")

    monkeypatch.setattr(ctlstate, "pack", boom)
    assert not k.save_if_changed()


def test_snapshot_cannot_write_outside_the_folder(env: Env, tmp_path: Path) -> None:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(tarfile.TarError):
        ctlstate.unpack(buf.getvalue(), tmp_path / "state")
    assert not (tmp_path / "escaped").exists()


def test_saving_is_held_to_a_duty_cycle_but_not_the_final_save(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ctlstate, "SAVE_DUTY", 1_000_000)  # the next save waits for ever
    folder = tmp_path / "state"
    k = ctlstate.Keeper(env.store, env.box, env.tokens.tenant_a, "rack0", folder)
    k.take()
    _write(folder, {"job_state": b"one"})
    assert k.save_if_changed()
    _write(folder, {"job_state": b"two"})
    assert not k.save_if_changed()  # a tenant changing the state all the time waits
    assert k.save_if_changed(final=True)  # slurmctld stopped: its last state is kept
    with env.store.session() as s:
        data = ctlstate.read(s, env.box, env.tokens.tenant_a)
    assert data is not None and ctlstate.files(data)["job_state"] == b"two"
