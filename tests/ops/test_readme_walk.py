"""README.md's "Run it on your network", steps 1-5, walked as a new operator would, with real
processes: the wheel built and installed into a fresh venv, a config written from the example
the wheel ships, ``metald serve`` started the way the shipped unit starts it, the shipped alert
rules and dashboard checked, and a rack of one real ``ipmi_sim`` BMC imported, powered on and
watched with ``metalctl``. Every step asserts on what the operator reads.

Adapted for a test box only where the README's paths need root: /opt/metald is a venv in
tmp_path, /etc/metald/metald.toml and /var/lib/metald are files in tmp_path, and the unit's
command is run directly (no systemd). The venv installs the wheel without network: it sees this
venv's site-packages (the dependencies) through a .pth, as tests/ops/test_deploy.py does."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bmc.peers import start_ipmi_sim, stop_peer
from tests.conftest import LAB_BMC_NETWORKS
from tests.test_daemon import wait_http

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
VENV_BIN = Path(sys.executable).parent
PROMTOOL = shutil.which("promtool")


def _readme_steps() -> str:
    text = README.read_text()
    start = text.index("## Run it on your network")
    return text[start : text.index("\n## ", start + 3)]


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def _install_wheel(tmp_path: Path, steps: str) -> Path:
    """Step 1: the README's two commands, without network (no build isolation, no index)."""
    assert "python3 -m pip wheel --no-deps -w dist ." in steps
    assert "python3 -m venv /opt/metald && /opt/metald/bin/pip install dist/metald-*.whl" in steps
    dist = tmp_path / "dist"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)])
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("metald-*.whl")
    venv = tmp_path / "opt-metald"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    site = next((venv / "lib").glob("python3.*/site-packages"))
    deps_site = next(
        p for p in sys.path if p.endswith("site-packages") and p.startswith(str(VENV_BIN.parent))
    )
    (site / "_deps.pth").write_text(deps_site + "\n")
    r = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ]
    )
    if r.returncode != 0 and "no such option: --python" in r.stderr:
        pytest.skip("pip too old for --python")
    assert r.returncode == 0, r.stderr[-3000:]
    return venv


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set(text: str, section: str, key: str, value: str) -> str:
    """Change one key of the example in place (its comment kept), as an operator edits it."""
    at = text.index(f"[{section}]") if section else 0
    m = re.compile(rf"^{re.escape(key)} = .*?(?=\s+#|$)", re.M).search(text, at)
    assert m, (section, key)
    return text[: m.start()] + f"{key} = {value}" + text[m.end() :]


class Follow:
    """``metalctl events --follow`` in the background, its lines read as they come."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout
        for ln in self.proc.stdout:
            self.lines.put(ln.rstrip("\n"))

    def until(self, pred: object, timeout: float = 20) -> list[str]:
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                seen.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                continue
            if pred(seen):  # type: ignore[operator]
                return seen
        raise AssertionError(f"events --follow never showed it; it showed: {seen}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Every process the walk starts, stopped at the end whatever happens."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in reversed(started):
        stop_peer(p)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("ipmi_sim") is None, reason="ipmi_sim (openipmi) is missing")
def test_readme_run_it_on_your_network(tmp_path: Path, procs: list[subprocess.Popen[str]]) -> None:
    steps = _readme_steps()
    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}

    # 1. Build the wheel and install it into a fresh venv (/opt/metald).
    venv = _install_wheel(tmp_path, steps)
    bin_ = venv / "bin"
    for cmd in ("metald", "metalctl"):
        r = _run([str(bin_ / cmd), "--version"], env=clean_env, cwd=tmp_path)
        assert r.returncode == 0 and re.search(r"\d+\.\d+", r.stdout + r.stderr), r.stderr

    # 2. /etc/metald/metald.toml from the example under <venv>/share/metald/, changing what
    # step 2 names: the staff API's listen (loopback here, so no TLS), and nothing of the boot
    # plane (off in the example: no DHCP or TFTP listeners on a test box). The state dir is
    # tmp, and the BMC below is a simulated one on loopback, which the [bmc] networks comment
    # says a lab must allow.
    assert "/opt/metald/share/metald/" in steps and "metald check-config -c FILE" in steps
    share = venv / "share" / "metald"
    example = (share / "metald.toml").read_text()
    assert "[boot]" in example and re.search(r"^enabled = false", example, re.M)
    state = tmp_path / "var-lib-metald"
    port = _free_tcp_port()
    conf_text = _set(example, "", "state_dir", json.dumps(str(state)))
    conf_text = _set(conf_text, "api", "listen", json.dumps(f"127.0.0.1:{port}"))
    conf_text = _set(conf_text, "bmc", "networks", json.dumps(LAB_BMC_NETWORKS))
    conf_text = _set(conf_text, "bmc", "min_interval_ms", "0")
    conf = tmp_path / "etc-metald" / "metald.toml"
    conf.parent.mkdir()
    conf.write_text(conf_text)
    r = _run([str(bin_ / "metald"), "check-config", "-c", str(conf)], env=clean_env)
    assert r.returncode == 0 and "config ok" in r.stdout, r.stdout + r.stderr

    # 3. The shipped unit: its commands are the venv's entry point on /etc/metald/metald.toml,
    # its state dir /var/lib/metald holds the admin token the README names. Run them as systemd
    # would, paths adapted.
    assert "/var/lib/metald/admin.token" in steps and "METALD_TOKEN" in steps
    unit = (share / "metald.service").read_text()
    directives = dict(
        ln.split("=", 1) for ln in unit.splitlines() if "=" in ln and not ln.startswith("#")
    )
    assert directives["Environment"] == "METALD_STATE_DIR=/var/lib/metald"
    assert directives["StateDirectory"] == "metald"  # /var/lib/metald

    def adapt(command: str) -> list[str]:
        argv = shlex.split(command)
        assert argv[0] == "/opt/metald/bin/metald", argv
        assert argv[-2:] == ["--config", "/etc/metald/metald.toml"], argv
        return [str(bin_ / "metald"), *argv[1:-1], str(conf)]

    env = {**clean_env, "METALD_STATE_DIR": str(state)}
    r = _run(adapt(directives["ExecStartPre"]), env=env)
    assert r.returncode == 0 and "config ok" in r.stdout, r.stdout + r.stderr
    log = (tmp_path / "metald.log").open("w")
    daemon = subprocess.Popen(
        adapt(directives["ExecStart"]), env=env, stdout=log, stderr=log, text=True
    )
    procs.append(daemon)
    wait_http(port, daemon)
    token_file = state / "admin.token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 20

    # 4. Prometheus rules and the Grafana dashboard, as shipped.
    assert "deploy/prometheus/alerts.yml" in steps and "deploy/grafana/metald.json" in steps
    if PROMTOOL:
        r = _run([PROMTOOL, "check", "rules", str(share / "alerts.yml")])
        assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    else:
        warnings.warn(
            "promtool (Debian package prometheus) is not installed: the shipped alert rules "
            "were not checked in the README walk",
            stacklevel=1,
        )
    dashboard = json.loads((share / "metald.json").read_text())
    assert dashboard["panels"] and dashboard["title"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b"# TYPE metald_" in metrics  # what the rules and the dashboard query

    # 5. A rack of one real BMC: import it, power it on, watch.
    sim, sim_proc = start_ipmi_sim(tmp_path / "bmc")
    procs.append(sim_proc)
    ctl_env = {
        **clean_env,
        "METALD_URL": f"http://127.0.0.1:{port}",
        "METALD_TOKEN": token,
        "METALD_BMC_PASSWORD_RACK07": sim.password,
    }

    def ctl(*args: str) -> str:
        r = _run([str(bin_ / "metalctl"), *args], env=ctl_env, cwd=tmp_path)
        assert r.returncode == 0, f"metalctl {' '.join(args)}: {r.stdout}{r.stderr}"
        return r.stdout + r.stderr

    assert "metalctl bmcs import rack07.csv" in steps
    # The CSV's columns and where passwords come from, as the command's help tells them.
    helptext = " ".join(ctl("bmcs", "import", "--help").split())
    assert "columns: address,username,password-env and optionally protocol" in helptext
    assert "METALD_BMC_PASSWORD_*" in helptext, helptext
    (tmp_path / "rack07.csv").write_text(
        "address,port,protocol,username,password-env\n"
        f"127.0.0.1,{sim.port},ipmi,{sim.username},METALD_BMC_PASSWORD_RACK07\n"
    )
    out = ctl("bmcs", "import", "rack07.csv")
    m = re.search(r"registered\s+([0-9a-f]{8}) ok", out)
    assert m, out
    bmc = m.group(1)  # the id the operator reads off the import's table
    assert sim.password not in out

    assert "metalctl bmcs power <id> on" in steps
    out = ctl("bmcs", "power", bmc, "on")
    assert f"bmc {bmc}: power on" in out, out
    assert "set power 1" in sim.calls()

    # The rack PXE-boots and enrolls: that needs the boot plane and real or QEMU machines (the
    # lab tests, make demo); here the machines are created over the API, as enrollment does.
    for i in range(12):
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/v1/machines",
            data=json.dumps({"macs": [f"52:54:00:07:00:{i:02x}"]}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=10).read()
    assert "metalctl machines list" in steps
    out = ctl("machines", "list")
    lines = out.splitlines()
    assert "STATE" in lines[0] and sum("discovered" in ln for ln in lines) == 12, out

    out = ctl("events", "--tail", "5")
    newest = [ln for ln in out.splitlines() if re.match(r"\s*\d+ ", ln)]
    assert len(newest) == 5, out
    ids = [int(ln.split()[0]) for ln in newest]
    assert ids == sorted(ids, reverse=True), out  # newest first
    total = int(json.loads(ctl("events", "-o", "json", "--tail", "1"))["items"][0]["id"])
    assert total == ids[0] and total > 12, out

    # --follow: the newest ones first (not the history from event #1), then live ones.
    assert "metalctl events --follow" in steps and "the newest events, then live ones" in steps
    follow = Follow([str(bin_ / "metalctl"), "events", "--follow"], ctl_env)
    procs.append(follow.proc)
    try:
        first = follow.until(lambda seen: len(seen) >= 10)
        shown = [int(x.split()[0]) for x in first]
        assert shown == list(range(total - 9, total + 1)), first  # the newest 10, oldest first
        ctl("bmcs", "power", bmc, "off", "--yes")
        live = follow.until(lambda seen: any("bmc.power" in x for x in seen))
        assert all(int(x.split()[0]) > total for x in live), live  # live, after the tail
    finally:
        follow.stop()
    assert "set power 0" in sim.calls()
    # Nothing the operator read or metald logged holds the BMC password.
    log.close()
    assert sim.password not in (tmp_path / "metald.log").read_text()
    assert os.path.exists(token_file)
