"""The disk form's stored joined state (bootassets/node/metald-node): the functions run for real
under busybox sh, with the host's wg and jq, on folders in tmp_path standing in for /run/metald
and the root partition's /var/lib/metald-node. No VM; QEMU tests in test_node_qemu.py."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from metald.tenants import keys
from tests.bootassets.conftest import ROOT

SCRIPT = ROOT / "bootassets/node/metald-node"
MUNGE_KEY = "bXVuZ2Uta2V5LW5vdC1hLXJlYWwtb25lLWJ1dC1sb25nLWVub3VnaA=="

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("busybox", "wg", "jq")),
    reason="needs busybox, wireguard-tools (wg) and jq",
)

JOIN = {
    "overlay_address": "10.200.0.2/24",
    "hub": {"endpoint": "10.79.0.1:51820", "public_key": "A" * 43 + "=", "address": "10.200.0.1"},
    "allowed_ips": ["10.200.0.0/24"],
    "persistent_keepalive": 25,
    "cluster": {
        "kind": "slurm",
        "node_name": "node-lab1",
        "munge_key": MUNGE_KEY,
        "slurmd_args": ["-Z", "-N", "node-lab1"],
    },
}


def node_sh(tmp_path: Path, body: str) -> tuple[str, dict[str, str]]:
    """Source metald-node (functions only) and run ``body``; its output and the variables it
    prints as KEY=VALUE lines after ``---``. set_hostname only records (never the host's)."""
    script = (
        f". {SCRIPT}\n"
        'set_hostname() { [ -n "$1" ] && HOST=$1; }\n'
        f"{body}\n"
        'echo "---"; echo "rc=$rc"; echo "why=$LOAD_WHY"; echo "host=$HOST"\n'
    )
    env = {
        "PATH": os.environ["PATH"],
        "METALD_NODE_LIB": "1",
        "METALD_NODE_STATE": str(tmp_path / "run"),
        "METALD_NODE_PERSIST": str(tmp_path / "disk/var/lib/metald-node"),
    }
    out = subprocess.run(
        ["busybox", "sh", "-c", script],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    text, _, tail = out.rpartition("---\n")
    return text, dict(line.split("=", 1) for line in tail.splitlines())


@pytest.fixture
def joined(tmp_path: Path) -> tuple[Path, str]:
    """A node that has just joined: /run/metald's wg.key and join.json, then saved to the
    disk with seed sum "seed-1" and hostname seed-host-7. Returns (persist dir, private key)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    key = keys.generate_private_key()
    (run / "wg.key").write_text(key + "\n")
    (run / "join.json").write_text(json.dumps(JOIN))
    out, v = node_sh(tmp_path, "SEED_SUM=seed-1 HOST=seed-host-7; save_joined_state; rc=$?")
    assert v["rc"] == "0", out
    assert key not in out and MUNGE_KEY not in out
    for f in ("wg.key", "join.json"):
        (run / f).unlink()
    return tmp_path / "disk/var/lib/metald-node", key


def test_save_writes_key_and_answer_private_and_load_restores_them(
    tmp_path: Path, joined: tuple[Path, str]
) -> None:
    persist, key = joined
    assert stat.S_IMODE(persist.stat().st_mode) == 0o700
    assert sorted(p.name for p in persist.iterdir()) == ["state.json", "wg.key"]
    for f in ("state.json", "wg.key"):
        assert stat.S_IMODE((persist / f).stat().st_mode) == 0o600
    assert (persist / "wg.key").read_text().strip() == key
    state = json.loads((persist / "state.json").read_text())
    assert state == {
        "version": 1,
        "public_key": keys.public_key(key),
        "seed_sha256": "seed-1",
        "hostname": "seed-host-7",
        "join": JOIN,
    }
    out, v = node_sh(tmp_path, "SEED_SUM=seed-1 SEED_HOST=seed-host-7; load_joined_state; rc=$?")
    assert (v["rc"], v["why"]) == ("0", ""), out
    run = tmp_path / "run"
    assert (run / "wg.key").read_text().strip() == key
    assert stat.S_IMODE((run / "wg.key").stat().st_mode) == 0o600
    assert json.loads((run / "join.json").read_text()) == JOIN
    assert key not in out and MUNGE_KEY not in out


def test_load_takes_the_stored_hostname_when_the_seed_names_none(
    tmp_path: Path, joined: tuple[Path, str]
) -> None:
    out, v = node_sh(tmp_path, "SEED_SUM= SEED_HOST= HOST=node; load_joined_state; rc=$?")
    assert (v["rc"], v["host"]) == ("0", "seed-host-7"), out
    assert "hostname seed-host-7 (stored; the seed names none)" in out


def test_no_stored_state_is_a_first_boot(tmp_path: Path) -> None:
    out, v = node_sh(tmp_path, "SEED_SUM=seed-1; load_joined_state; rc=$?")
    assert (v["rc"], v["why"]) == ("1", ""), out
    assert not (tmp_path / "run/wg.key").exists()


def _edit_state(persist: Path, change) -> None:  # type: ignore[no-untyped-def]
    state = json.loads((persist / "state.json").read_text())
    change(state)
    (persist / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: (p / "state.json").unlink(), "state.json is missing or unreadable"),
        (lambda p: (p / "state.json").write_text('{"version": 1, '), "not a JSON object"),
        (lambda p: (p / "state.json").write_text("[1]"), "not a JSON object"),
        (
            lambda p: _edit_state(p, lambda s: s.update(version=2)),
            "lacks or has a bad: version 2, not 1",
        ),
        (
            lambda p: _edit_state(p, lambda s: s["join"].pop("overlay_address")),
            "lacks or has a bad: join.overlay_address",
        ),
        (
            lambda p: _edit_state(p, lambda s: s["join"].update(hub="10.79.0.1:51820")),
            "lacks or has a bad: join.hub.endpoint, join.hub.public_key",
        ),
        (
            lambda p: _edit_state(p, lambda s: s["join"].update(allowed_ips=[])),
            "lacks or has a bad: join.allowed_ips",
        ),
        (
            lambda p: _edit_state(p, lambda s: s["join"]["cluster"].pop("munge_key")),
            "lacks or has a bad: join.cluster.munge_key",
        ),
        (lambda p: (p / "wg.key").unlink(), "wg.key is missing or empty"),
        (lambda p: (p / "wg.key").write_text("not a key\n"), "not a WireGuard private key"),
        (
            lambda p: (p / "wg.key").write_text(keys.generate_private_key() + "\n"),
            "wg.key is not the key the node joined with",
        ),
    ],
)
def test_unusable_state_is_refused_with_the_reason(
    tmp_path: Path, joined: tuple[Path, str], damage, why: str
) -> None:  # type: ignore[no-untyped-def]
    persist, key = joined
    damage(persist)
    out, v = node_sh(tmp_path, "SEED_SUM=seed-1; load_joined_state; rc=$?")
    assert v["rc"] == "1", out
    assert why in v["why"]
    assert not (tmp_path / "run/wg.key").exists()
    assert not (tmp_path / "run/join.json").exists()
    assert key not in out + v["why"] and MUNGE_KEY not in out + v["why"]


def test_a_new_seed_wins_over_the_stored_state(tmp_path: Path, joined: tuple[Path, str]) -> None:
    """An operator who writes a new seed (a new join token) gets a join with it."""
    out, v = node_sh(tmp_path, "SEED_SUM=seed-2; load_joined_state; rc=$?")
    assert v["rc"] == "1", out
    assert v["why"] == "the seed changed since the node joined (new join info)"


def test_a_save_replaces_the_state_of_an_earlier_join(
    tmp_path: Path, joined: tuple[Path, str]
) -> None:
    persist, _ = joined
    run = tmp_path / "run"
    key2 = keys.generate_private_key()
    (run / "wg.key").write_text(key2 + "\n")
    (run / "join.json").write_text(json.dumps({**JOIN, "overlay_address": "10.200.0.9/24"}))
    out, v = node_sh(tmp_path, "SEED_SUM=seed-2 HOST=h; save_joined_state; rc=$?")
    assert v["rc"] == "0", out
    assert sorted(p.name for p in persist.iterdir()) == ["state.json", "wg.key"]
    assert (persist / "wg.key").read_text().strip() == key2
    state = json.loads((persist / "state.json").read_text())
    assert (state["seed_sha256"], state["join"]["overlay_address"]) == ("seed-2", "10.200.0.9/24")


@pytest.mark.parametrize("tenant_user_data", [False, True])
def test_join_info_from_the_seed(tmp_path: Path, tenant_user_data: bool) -> None:
    """The join token is in metald's cloud-config: the user-data, or the vendor-data beside a
    tenant's own user-data (docs/tenant-os.md)."""
    from metald.provision.metadata import nocloud

    join = {"url": "https://m.test", "token": "tok-77", "expires_at": "x"}
    files = nocloud(
        machine_id="m1",
        name="n1",
        pxe_mac=None,
        ssh_authorized_keys=[],
        join=join,
        user_data="#!/bin/sh\necho tenant\n" if tenant_user_data else None,
    )
    seed = tmp_path / "seed"
    seed.mkdir()
    for name, text in files.items():
        (seed / name).write_text(text)
    (tmp_path / "run").mkdir()
    out, v = node_sh(tmp_path, f"SEED={seed}; disk_join_info; rc=$?; cat $STATE/join-info.json")
    assert v["rc"] == "0", out
    assert json.loads(out)["token"] == "tok-77"


def test_a_seed_without_join_info_is_refused(tmp_path: Path) -> None:
    """metald's cloud-config with no join entry (a machine claimed without a cluster): no
    join info. jq 1.6's ``-e`` is true on empty input, so the empty extract is checked apart
    (before, the node went on to join with an empty url and token)."""
    from metald.provision.metadata import nocloud

    files = nocloud(machine_id="m1", name="n1", pxe_mac=None, ssh_authorized_keys=[])
    seed = tmp_path / "seed"
    seed.mkdir()
    for name, text in files.items():
        (seed / name).write_text(text)
    (tmp_path / "run").mkdir()
    out, v = node_sh(tmp_path, f"SEED={seed}; disk_join_info; rc=$?")
    assert v["rc"] == "1", out
    assert "the seed's user-data has no /etc/metald/join.json with url and token" in out
