"""Several real metald processes: the instances list, refusals at start, and a killed instance
seen as dead by the survivor."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_daemon import BIN, share_secrets_key, wait_http
from vmlab.labnet import free_port


def _conf(tmp: Path, name: str, state: str, port: int, url: str = "") -> Path:
    conf = tmp / f"{name}.toml"
    store = f'[store]\nurl = "{url}"\n' if url else ""
    conf.write_text(
        f'state_dir = "{tmp / state}"\ninstance = "{name}"\n{store}'
        f'[api]\nlisten = "127.0.0.1:{port}"\n[fleet]\nheartbeat_s = 0.2\ndead_after_s = 1.5\n'
        '[bmc]\nnetworks = ["10.1.0.0/16"]\n'
    )
    return conf


def _start(conf: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [BIN / "metald", "serve", "--config", conf], stderr=subprocess.PIPE, text=True
    )


def _get(port: int, path: str, token: str) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_a_second_metald_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    p1, p2 = free_port(), free_port()
    first = _start(_conf(tmp_path, "one", "state", p1))
    try:
        wait_http(p1, first)
        second = _start(_conf(tmp_path, "two", "state", p2))
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        assert "SQLite is for one instance" in err and "PostgreSQL" in err
        assert first.poll() is None  # the first one is untouched
    finally:
        first.terminate()
        first.wait(timeout=15)


def test_a_crashed_instance_starts_again_at_once(tmp_path: Path) -> None:
    """kill -9, then the same instance again (systemd's Restart=): its own stale heartbeat
    does not hold it out."""
    port = free_port()
    conf = _conf(tmp_path, "one", "state", port)
    first = _start(conf)
    try:
        wait_http(port, first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    again = _start(conf)
    try:
        wait_http(port, again)
    finally:
        again.terminate()
        again.wait(timeout=15)


@pytest.mark.postgres
def test_an_instance_with_another_secrets_key_is_refused(tmp_path: Path, pg_server) -> None:  # type: ignore[no-untyped-def]
    url = pg_server.new_database()
    p1, p2 = free_port(), free_port()
    first = _start(_conf(tmp_path, "one", "s1", p1, url))
    try:
        wait_http(p1, first)
        second = _start(_conf(tmp_path, "two", "s2", p2, url))  # its own, new key
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        assert "cannot decrypt this store's secrets" in err and "Copy secrets.key" in err
    finally:
        first.terminate()
        first.wait(timeout=15)


@pytest.mark.postgres
def test_instances_list_and_a_killed_instance_goes_dead(tmp_path: Path, pg_server) -> None:  # type: ignore[no-untyped-def]
    url = pg_server.new_database()
    share_secrets_key(tmp_path, ["s0", "s1"])
    ports = [free_port(), free_port()]
    procs = [_start(_conf(tmp_path, f"rack{i}", f"s{i}", ports[i], url)) for i in range(2)]
    try:
        for p, port in zip(procs, ports, strict=True):
            wait_http(port, p)
        token = next(
            f.read_text().strip()
            for f in (tmp_path / "s0" / "admin.token", tmp_path / "s1" / "admin.token")
            if f.exists()
        )
        # Same name as a live instance: refused before it serves.
        dup = _start(_conf(tmp_path, "rack0", "s1", free_port(), url))
        _, err = dup.communicate(timeout=60)
        assert dup.returncode == 2 and "held by a live metald" in err

        listed = _get(ports[1], "/api/v1/instances", token)
        by = {i["name"]: i for i in listed["items"]}
        assert set(by) == {"rack0", "rack1"} and all(i["alive"] for i in by.values())
        assert by["rack0"]["owns"]["bmc_networks"] == ["10.1.0.0/16"]
        assert listed["answered_by"] == "rack1"
        out = subprocess.run(
            [BIN / "metalctl", "--url", f"http://127.0.0.1:{ports[0]}", "instances"],
            env={"METALD_TOKEN": token, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "rack0" in out and "rack1" in out and "DEAD" not in out

        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        killed = time.monotonic()
        while True:
            by = {i["name"]: i for i in _get(ports[1], "/api/v1/instances", token)["items"]}
            if not by["rack0"]["alive"]:
                break
            assert time.monotonic() - killed < 15, "the killed instance never went dead"
            time.sleep(0.1)
        assert by["rack0"]["heartbeat_age_s"] >= 1.5
        out = subprocess.run(
            [BIN / "metalctl", "--url", f"http://127.0.0.1:{ports[1]}", "instances"],
            env={"METALD_TOKEN": token, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert any(line.startswith("rack0") and "DEAD" in line for line in out.splitlines())
        assert by["rack1"]["alive"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=15)
