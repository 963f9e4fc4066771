"""metalctl power / sensors / bmcs against a real metald process and ipmi_sim, the daemon
logging at debug level: the BMC password shows up in neither its logs nor any output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.bmc.peers import IpmiSim, free_port
from tests.conftest import LAB_BMC_TOML
from tests.test_daemon import wait_http

BIN = Path(sys.executable).parent


@pytest.fixture
def debug_daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    import socket

    port = free_port(socket.SOCK_STREAM)
    conf = tmp_path / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\ninstance = "bmc-test"\n'
        f'[api]\nlisten = "127.0.0.1:{port}"\n[log]\nlevel = "debug"\nformat = "json"\n'
        "[bmc]\n" + LAB_BMC_TOML + "min_interval_ms = 0\ntimeout_s = 5\nretries = 1\n"
    )
    log = (tmp_path / "metald.log").open("w+")
    proc = subprocess.Popen(
        [BIN / "metald", "serve", "--config", conf], stderr=log, stdout=log, text=True
    )
    try:
        wait_http(port, proc)
        yield port, tmp_path / "state", tmp_path / "metald.log"
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_metalctl_registers_powers_and_reads_sensors(debug_daemon, ipmi_sim: IpmiSim) -> None:  # type: ignore[no-untyped-def]
    port, state, log_path = debug_daemon
    token = (state / "admin.token").read_text().strip()
    url = f"http://127.0.0.1:{port}"
    req = urllib.request.Request(
        f"{url}/api/v1/machines",
        data=json.dumps({"macs": ["52:54:00:12:34:56"]}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    mid = json.loads(urllib.request.urlopen(req, timeout=10).read())["id"]
    env = {
        **os.environ,
        "METALD_URL": url,
        "METALD_TOKEN": token,
        "BMC_PASSWORD": ipmi_sim.password,
    }

    def ctl(*args: str) -> str:
        r = subprocess.run(
            [BIN / "metalctl", *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        return r.stdout + r.stderr

    outputs = [
        ctl(
            "bmcs",
            "register",
            "127.0.0.1",
            "--port",
            str(ipmi_sim.port),
            "--protocol",
            "ipmi",
            "--username",
            "admin",
            "--machine",
            mid,
        ),
        ctl("power", mid, "on", "--wait"),
        ctl("power", mid),
        ctl("boot-device", mid, "pxe"),
        ctl("sensors", mid),
        ctl("bmcs", "list"),
        ctl("locate", mid, "on"),
    ]
    assert "registered (ipmi, ok)" in outputs[0]
    assert "power on" in outputs[1] and "power on" in outputs[2]
    assert "CPU Temp" in outputs[4]
    assert "set power 1" in ipmi_sim.calls() and "set boot pxe" in ipmi_sim.calls()
    assert "set identify 0 1" in ipmi_sim.calls()
    assert "locate unknown" in outputs[6]  # ipmi_sim does not report the light's state
    logs = log_path.read_text()
    levels = {str(json.loads(x).get("level")).lower() for x in logs.splitlines() if x[:1] == "{"}
    assert "debug" in levels, levels  # it really logged at debug level
    for text in (*outputs, logs):
        assert ipmi_sim.password not in text
