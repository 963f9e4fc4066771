"""Zero-touch enrollment of a virtual rack, for real: QEMU machines (2 BIOS, 1 UEFI) with
virtual BMCs, metald inside the lab's namespace serving DHCP/TFTP/HTTP boot, the discovery
image built from Debian packages, and the agent posting inventory. Nobody types a MAC:
BMCs are registered by address, powered on through metald's API, and linked to the machines
that enroll themselves by their system UUID.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "vm-lab"))

pytestmark = [
    pytest.mark.lab,
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, taps, QEMU)"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
]

BIN = Path(sys.executable).parent
MACHINES = 3
UEFI = 1
READY_TIMEOUT_S = 420


class Rack:
    """A lab with metald running inside it, and metalctl calls made from inside too."""

    def __init__(self, tmp: Path) -> None:
        from bootassets.build import ensure_built
        from vmlab.lab import Lab

        self.assets = ensure_built()
        self.lab = Lab(f"e2e{os.getpid() % 10000}", machines=MACHINES, uefi=UEFI, workdir=tmp / "lab")
        self.state = self.lab.up()
        addr = self.state["boot_address"]
        subnet = self.state["subnet"]
        lo, hi = self.state["dhcp_range"]
        self.url = f"http://{addr}:8080"
        self.state_dir = tmp / "metald"
        conf = tmp / "metald.toml"
        conf.write_text(
            f'state_dir = "{self.state_dir}"\ninstance = "e2e"\n'
            f'[api]\nlisten = "{addr}:8080"\n'
            "[bmc]\npower_sync_interval_s = 0\nmin_interval_ms = 0\n"
            f'[boot]\nenabled = true\ninterfaces = ["{self.state["bridge"]}"]\nserver_address = "{addr}"\n'
            f'assets_dir = "{self.assets}"\nrouter_advertisements = true\n'
            f'[[boot.networks]]\nname = "lab"\nsubnet = "{subnet}"\npool_start = "{lo}"\npool_end = "{hi}"\n'
            f'interface = "{self.state["bridge"]}"\nlease_seconds = 600\n'
            '[[enroll.rules]]\nmatch = { vendor = "QEMU*" }\nlabels = { pool = "lab" }\n'
        )
        self.metald = self.lab.spawn([str(BIN / "metald"), "serve", "--config", str(conf)], role="metald", log=tmp / "metald.log")
        self.log = tmp / "metald.log"
        deadline = time.monotonic() + 60
        while not (self.state_dir / "admin.token").exists() or self.ctl("whoami", check=False)[0] != 0:
            if time.monotonic() > deadline:
                raise AssertionError("metald did not start:\n" + self.log.read_text()[-3000:])
            time.sleep(0.3)

    def ctl(self, *args: str, check: bool = True, env: dict[str, str] | None = None) -> tuple[int, str]:
        token = (self.state_dir / "admin.token").read_text().strip() if (self.state_dir / "admin.token").exists() else ""
        full_env = {**os.environ, "METALD_URL": self.url, "METALD_TOKEN": token, **(env or {})}
        r = self.lab.run([str(BIN / "metalctl"), *args], capture_output=True, text=True, env=full_env, timeout=120)
        if check:
            assert r.returncode == 0, f"metalctl {' '.join(args)}: {r.stderr}"
        return r.returncode, r.stdout

    def json(self, *args: str) -> object:
        return json.loads(self.ctl("--json", *args)[1])

    def down(self) -> None:
        self.lab.down(keep_logs=True)


@pytest.fixture
def rack(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = Rack(tmp_path)
    try:
        yield r
    finally:
        r.down()


def _ts(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


def test_rack_powers_on_and_enrolls_itself(rack: Rack) -> None:
    machines_cfg = rack.state["machines"]
    # 1. Register each machine's BMC by address only (IPMI, Redfish, and auto-detect).
    bmc_ids = {}
    protocols = ["ipmi", "redfish", "auto"]
    for m, proto in zip(machines_cfg, protocols, strict=True):
        b = m["bmc"]
        port = str(b["ipmi_port"] if proto == "ipmi" else b["redfish_port"]) if proto != "auto" else None
        args = ["bmcs", "register", b["address"], "--protocol", proto, "--username", b["username"]]
        if port:
            args += ["--port", port]
        out = json.loads(rack.ctl("--json", *args, env={"BMC_PASSWORD": b["password"]})[1])
        assert out["health"] == "ok" and "password" not in json.dumps(out)
        bmc_ids[m["name"]] = out["id"]
    # 2. Power every machine on through metald's API.
    t_on = {}
    for m in machines_cfg:
        rack.ctl("bmcs", "power", bmc_ids[m["name"]], "on")
        t_on[m["mac"]] = time.monotonic()
    t0 = min(t_on.values())
    # 3. Wait for all of them to enroll themselves and reach ready.
    deadline = time.monotonic() + READY_TIMEOUT_S
    ready: dict[str, float] = {}
    while len(ready) < MACHINES:
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {m['name']}\n" + Path(m["serial_log"]).read_text(errors="replace")[-1500:] for m in machines_cfg)
            raise AssertionError(f"only {len(ready)} of {MACHINES} ready\n{logs}\n--- metald\n{rack.log.read_text()[-3000:]}")
        page = rack.json("machines", "list", "--state", "ready")
        for item in page["items"]:  # type: ignore[index]
            for nic in item["nics"]:
                if nic["mac"] in t_on and nic["mac"] not in ready:
                    ready[nic["mac"]] = time.monotonic()
        time.sleep(2)
    # 4. Inventory matches the QEMU configuration.
    rows = []
    for m in machines_cfg:
        page = rack.json("machines", "list")
        found = [x for x in page["items"] if any(n["mac"] == m["mac"] for n in x["nics"])]  # type: ignore[index]
        assert len(found) == 1, m["mac"]
        full = rack.json("machines", "show", found[0]["id"])
        inv = full["inventory"]["normalized"]  # type: ignore[index]
        assert full["cpu_count"] == m["cpus"]  # type: ignore[index]
        mem = m["memory_mb"]
        assert 0.85 * mem <= full["memory_mb"] <= mem  # type: ignore[index,operator]
        disks = {d["name"]: d["size_bytes"] for d in inv["disks"]}
        assert 2 * 1024**3 in disks.values(), disks
        assert m["mac"] in [n["mac"] for n in inv["nics"]]
        assert full["system_uuid"] == m["uuid"].lower()  # type: ignore[index]
        assert full["labels"] == {"pool": "lab"}  # type: ignore[index]
        # The BMC registered by address was linked to this machine by its UUID.
        bmcs = rack.json("bmcs", "list")["items"]  # type: ignore[index]
        assert [b["machine_id"] for b in bmcs if b["id"] == bmc_ids[m["name"]]] == [found[0]["id"]]  # type: ignore[index]
        rows.append((m["name"], m["firmware"], m["mac"], ready[m["mac"]] - t_on[m["mac"]]))
    print(f"\npower-on to ready (TCG, {MACHINES} machines, RA on):")
    for name, fw, mac, secs in rows:
        print(f"  {name} {fw:5} {mac}  {secs:6.1f} s")
    print(f"  rack: {max(ready.values()) - t0:6.1f} s")
