"""The ``metald`` and ``metalctl`` programs, run as real processes."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metald.config import ConfigError, load_config
from vmlab.labnet import free_port

BIN = Path(sys.executable).parent


def wait_http(port: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"metald exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
            )
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("metald did not come up")


@pytest.fixture
def daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    conf = tmp_path / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\ninstance = "test-1"\n[api]\nlisten = "127.0.0.1:{port}"\n[log]\nformat = "json"\n'
    )
    proc = subprocess.Popen(
        [BIN / "metald", "serve", "--config", conf], stderr=subprocess.PIPE, text=True
    )
    try:
        wait_http(port, proc)
        yield proc, port, tmp_path / "state"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_first_start_writes_admin_token_0600_and_sigterm_stops(daemon) -> None:  # type: ignore[no-untyped-def]
    proc, port, state = daemon
    token_file = state / "admin.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "secrets.key").stat().st_mode) == 0o600
    secret = token_file.read_text().strip()
    env = {**os.environ, "METALD_URL": f"http://127.0.0.1:{port}", "METALD_TOKEN": secret}
    out = subprocess.run(
        [BIN / "metalctl", "whoami"], env=env, capture_output=True, text=True, check=True
    )
    assert "bootstrap-admin (admin)" in out.stdout
    # The database, its WAL and shared memory, and the folder are metald's user's only.
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    db_files = [p for p in state.iterdir() if p.name.startswith("metald.db")]
    assert {p.name for p in db_files} >= {"metald.db", "metald.db-wal"}
    for p in db_files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    logs = proc.stderr.read()
    lines = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
    assert any("admin token was written" in x["msg"] for x in lines)
    assert any(x["msg"] == "metald stopped" for x in lines)
    assert any(x["msg"] == "service health started" for x in lines)  # the Day-2 watch
    assert secret not in logs


def test_metalctl_operates_the_fleet(daemon) -> None:  # type: ignore[no-untyped-def]
    _proc, port, state = daemon
    env = {
        **os.environ,
        "METALD_URL": f"http://127.0.0.1:{port}",
        "METALD_TOKEN": (state / "admin.token").read_text().strip(),
    }

    def ctl(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [BIN / "metalctl", *args], env=env, capture_output=True, text=True, timeout=30
        )
        if ok:
            assert r.returncode == 0, r.stderr
        return r

    out = ctl(
        "--json",
        "machines",
        "register",
        "--mac",
        "52:54:00:aa:00:01",
        "--name",
        "gpu-01",
        "--label",
        "pool=train",
    )
    mid = json.loads(out.stdout)["id"]
    assert "gpu-01" in ctl("machines", "list").stdout
    assert "pool=train" in ctl("machines", "list", "--label", "pool=train").stdout
    assert "(0 of 0)" in ctl("machines", "list", "--state", "ready").stdout
    ctl("machines", "maintenance-on", mid, "--reason", "reseat GPU")
    r = ctl("machines", "maintenance-off", mid, ok=False)
    assert r.returncode == 1 and "never been inspected" in r.stderr
    assert "maintenance" in ctl("machines", "show", mid).stdout
    events = ctl("events", "--machine", mid).stdout
    assert "discovered -> maintenance" in events and "reseat GPU" in events
    tid = json.loads(ctl("--json", "tenants", "create", "acme").stdout)["id"]
    r = ctl("tenants", "hub", tid, ok=False)
    assert r.returncode == 1 and "no WireGuard hub" in r.stderr
    r = ctl("tenants", "hub", tid, "--create", ok=False)  # no hub_addresses configured
    assert r.returncode == 1 and "endpoint_host" in r.stderr
    created = ctl("tenants", "hub", tid, "--create", "--endpoint-host", "192.0.2.7").stdout
    assert "endpoint 192.0.2.7:51820" in created and "overlay 100.64." in created
    assert "private" not in ctl("--json", "tenants", "hub", tid).stdout.lower()
    listed = ctl("tenants", "list").stdout
    assert "acme" in listed and "100" in listed  # the tenant's VLAN
    tok = ctl("tokens", "create", "--name", "tech1", "--role", "technician").stdout.splitlines()[-1]
    env2 = {**env, "METALD_TOKEN": tok}
    r = subprocess.run(
        [BIN / "metalctl", "tokens", "list"], env=env2, capture_output=True, text=True
    )
    assert r.returncode == 1 and "technician token cannot list tokens" in r.stderr
    # --follow streams new events as they happen.
    follower = subprocess.Popen(
        [BIN / "metalctl", "events", "--follow", "--machine", mid],
        env=env,
        stdout=subprocess.PIPE,
        bufsize=0,
    )
    try:
        time.sleep(1.0)
        ctl("machines", "label", mid, "team=ml")
        out = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "machine.labels" not in out:
            ready, _, _ = select.select([follower.stdout], [], [], 1.0)
            if ready:
                out += os.read(follower.stdout.fileno(), 65536).decode()  # type: ignore[union-attr]
        seen = out.splitlines()
        assert any("machine.created" in x for x in seen), seen  # history first
        assert any("machine.labels" in x for x in seen), seen  # then live events
    finally:
        follower.kill()
        follower.wait()


def test_invalid_config_names_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text('[api]\nlisten = "nowhere"\nlistn = "x"\n')
    r = subprocess.run(
        [BIN / "metald", "check-config", "--config", conf], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "api.listen" in r.stderr and "api.listn: unknown key" in r.stderr


def test_config_env_overrides_and_errors(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('state_dir = "/srv/metald"\n[api]\nlisten = "127.0.0.1:9000"\n')
    cfg = load_config(
        conf,
        environ={
            "METALD_API__LISTEN": "0.0.0.0:8081",
            "METALD_LOG__FORMAT": "json",
            "METALD_BMC__RETRIES": "5",
        },
    )
    assert (cfg.api.listen, cfg.log.format, cfg.bmc.retries, cfg.state_dir) == (
        "0.0.0.0:8081",
        "json",
        5,
        "/srv/metald",
    )
    with pytest.raises(ConfigError, match="log.level"):
        load_config(conf, environ={"METALD_LOG__LEVEL": "loud"})
    with pytest.raises(ConfigError, match="not valid TOML"):
        (tmp_path / "x.toml").write_text("[api\n")
        load_config(tmp_path / "x.toml", environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def test_config_env_ignores_variables_that_name_no_key(tmp_path: Path) -> None:
    """``make test-long`` sets METALD_LAB_LONG=1 for the tests: it (and any other METALD_*
    variable that is not metald's) is no override, while a typo inside a known section is still
    an error."""
    conf = tmp_path / "c.toml"
    conf.write_text(f'state_dir = "{tmp_path}"\n')
    warnings: list[str] = []
    cfg = load_config(
        conf,
        environ={"METALD_LAB_LONG": "1", "METALD_DISKS": "vda", "METALD_STATE_DIR": "/srv/m"},
        warnings=warnings,
    )
    assert cfg.state_dir == "/srv/m"
    assert len(warnings) == 2 and "METALD_LAB_LONG" in warnings[1], warnings
    assert "ignored" in warnings[1]
    with pytest.raises(ConfigError, match="api.lsten: unknown key"):
        load_config(conf, environ={"METALD_API__LSTEN": "0.0.0.0:1"})
    env = {**os.environ, "METALD_LAB_LONG": "1"}
    r = subprocess.run(
        [BIN / "metald", "check-config", "--config", conf], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "METALD_LAB_LONG is not a configuration override" in r.stderr


def test_version() -> None:
    from metald import __version__

    r = subprocess.run([BIN / "metald", "--version"], capture_output=True, text=True)
    assert r.stdout.strip() == f"metald {__version__}"


def share_secrets_key(root: Path, state_dirs: list[str]) -> None:
    """Every instance on one database holds the same secrets key (docs/fleet.md)."""
    from cryptography.fernet import Fernet

    key = Fernet.generate_key()
    for d in state_dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
        f = root / d / "secrets.key"
        f.write_bytes(key)
        f.chmod(0o600)


def test_example_config_is_valid() -> None:
    example = Path(__file__).parent.parent / "examples" / "metald.toml"
    load_config(example, environ={})
    # Turning the boot plane on is one key: its assets folder is already apart from the state.
    cfg = load_config(example, environ={"METALD_BOOT__ENABLED": "true"})
    assert cfg.boot.assets_dir and cfg.boot.assets_dir != cfg.state_dir


def test_two_instances_share_one_postgresql(tmp_path: Path, pg_server) -> None:  # type: ignore[no-untyped-def]
    """Two metald processes started at the same moment on one empty PostgreSQL database: the
    schema is migrated once, exactly one admin token is minted, and both serve the same fleet."""
    url = pg_server.new_database()
    procs, ports = [], []
    share_secrets_key(tmp_path, ["s0", "s1"])
    for i in range(2):
        port = free_port()
        conf = tmp_path / f"m{i}.toml"
        conf.write_text(
            f'state_dir = "{tmp_path / f"s{i}"}"\ninstance = "rack{i}"\n[store]\nurl = "{url}"\n[api]\nlisten = "127.0.0.1:{port}"\n'
        )
        procs.append(
            subprocess.Popen(
                [BIN / "metald", "serve", "--config", conf], stderr=subprocess.PIPE, text=True
            )
        )
        ports.append(port)
    try:
        for p, port in zip(procs, ports, strict=True):
            wait_http(port, p)
        tokens = [
            f
            for f in (tmp_path / "s0" / "admin.token", tmp_path / "s1" / "admin.token")
            if f.exists()
        ]
        assert len(tokens) == 1
        env = {
            **os.environ,
            "METALD_URL": f"http://127.0.0.1:{ports[0]}",
            "METALD_TOKEN": tokens[0].read_text().strip(),
        }
        subprocess.run(
            [BIN / "metalctl", "machines", "register", "--mac", "52:54:00:bb:00:01"],
            env=env,
            check=True,
            capture_output=True,
        )
        env["METALD_URL"] = f"http://127.0.0.1:{ports[1]}"
        out = subprocess.run(
            [BIN / "metalctl", "machines", "list"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert "(1 of 1)" in out
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=15)


def test_a_broken_bmc_install_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """BMC control's dependencies are metald's own: a module of it that cannot be imported is
    a broken install and fails the daemon's start loudly, instead of a daemon that runs on
    with BMC control silently off."""
    from metald import daemon

    monkeypatch.setitem(sys.modules, "metald.bmc.service", None)  # its import now fails
    with pytest.raises(ImportError):
        daemon._bmc(object())  # type: ignore[arg-type]
