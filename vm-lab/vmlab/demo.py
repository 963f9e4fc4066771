"""``make demo``: metald's main job on the embedded default (SQLite) and a virtual rack.

As root with QEMU (what ``scripts/bootstrap`` installs): builds the discovery image (cached),
brings up a vm-lab rack of 3 machines (2 BIOS, 1 UEFI) with virtual BMCs, starts metald inside
it, registers the BMCs by address, powers the machines on through metald, and watches them
PXE-boot, post their inventory and become ``ready`` with nobody typing a MAC. Then it operates
the fleet as a technician and an orchestrator would. Without root it runs the operating
walk-through alone on a local metald (as does ``RACK=0``). ``KEEP=1`` leaves everything up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .lab import REPO_ROOT
from .labnet import free_port

BIN = Path(sys.executable).parent
Ctl = Callable[..., tuple[int, str]]


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def show(ctl: Ctl, *args: str, ok: bool = True, env: dict[str, str] | None = None) -> str:
    print("$ metalctl " + " ".join(args), flush=True)
    rc, out = ctl(*args, check=False, env=env)
    if out.strip():
        print(out.rstrip(), flush=True)
    if ok and rc != 0:
        raise SystemExit(f"demo: metalctl {' '.join(args)} failed ({rc})")
    return out


def quiet_json(ctl: Ctl, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``metalctl --json ARGS``, print the command (not the JSON), return the JSON."""
    print("$ metalctl " + " ".join(args), flush=True)
    rc, out = ctl("--json", *args, check=False, env=env)
    if rc != 0:
        raise SystemExit(f"demo: metalctl {' '.join(args)} failed ({rc})")
    return json.loads(out)


def _ctl(
    url: str, token: Callable[[], str], run: Callable[..., subprocess.CompletedProcess]
) -> Ctl:
    """metalctl against ``url`` with the token ``token()`` gives, started by ``run``."""

    def ctl(*args: str, check: bool = True, env: dict[str, str] | None = None) -> tuple[int, str]:
        full = {**os.environ, "METALD_URL": url, "METALD_TOKEN": token(), **(env or {})}
        r = run(
            [str(BIN / "metalctl"), *args], capture_output=True, text=True, env=full, timeout=120
        )
        if r.returncode and r.stderr:
            print(r.stderr.rstrip(), flush=True)
        if check and r.returncode:
            raise SystemExit(f"demo: metalctl {' '.join(args)} failed")
        return r.returncode, r.stdout

    return ctl


def local_ctl(url: str, token: str) -> Ctl:
    return _ctl(url, lambda: token, subprocess.run)


def rack_ctl(rack) -> Ctl:  # type: ignore[no-untyped-def]
    # The rack's token is read at each call: metald writes a new one when it restarts.
    return _ctl(rack.url, lambda: rack.token, rack.lab.run)


def can_run_rack() -> str | None:
    if os.environ.get("RACK") == "0":
        return "RACK=0 was given"
    if os.geteuid() != 0:
        return "not root (a virtual rack needs network namespaces, taps and QEMU)"
    for tool in ("qemu-system-x86_64", "qemu-img", "busybox"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (run scripts/bootstrap as root)"
    return None


def run_rack(workdir: Path) -> tuple[Ctl, Callable[[], None], dict[str, float]]:
    from .rack import LabRack, tenants_config

    timings: dict[str, float] = {}
    step("Build the discovery image from Debian packages (cached in .cache/bootassets)")
    t = time.monotonic()
    from bootassets.build import ensure_built

    assets = ensure_built()
    timings["discovery image (build or cache)"] = time.monotonic() - t
    sizes = {p.name: p.stat().st_size for p in (assets / "discovery").iterdir()}
    print(f"{assets}: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(sizes.items())))

    step(
        "Bring up a virtual rack: 3 QEMU machines (2 BIOS, 1 UEFI), a virtual BMC each, metald inside"
    )
    t = time.monotonic()
    rack = LabRack(
        "demo",
        workdir,
        machines=3,
        uefi=1,
        extra_config=lambda state: (
            '[[enroll.rules]]\nmatch = { vendor = "vm-lab" }\nlabels = { pool = "demo" }\n'
            '[[enroll.rules]]\nmatch = { product = "vm-lab bios" }\nlabels = { firmware = "bios" }\n'
            + tenants_config(state)
        ),
    )
    timings["rack up + metald started"] = time.monotonic() - t
    print(
        f"lab namespace {rack.state['netns']}, accelerator {rack.state['accel']}, metald at {rack.url} (SQLite)"
    )
    for m in rack.machines:
        print(
            f"  {m['name']} {m['firmware']:4} mac {m['mac']}  BMC {m['bmc']['address']} (IPMI :{m['bmc']['ipmi_port']}, Redfish :{m['bmc']['redfish_port']})"
        )
    ctl = rack_ctl(rack)

    step("A technician registers the BMCs by address only (IPMI, Redfish, auto-detect)")
    bmcs = {}
    for i, m in enumerate(rack.machines):
        proto = ["ipmi", "redfish", "auto"][i]
        b = m["bmc"]
        address = f"http://{b['address']}" if proto == "redfish" else b["address"]
        args = ["bmcs", "register", address, "--protocol", proto, "--username", b["username"]]
        if proto != "auto":
            args += ["--port", str(b["ipmi_port"] if proto == "ipmi" else b["redfish_port"])]
        out = show(ctl, *args, env={"BMC_PASSWORD": b["password"]})
        bmcs[m["name"]] = out.split()[1]
    show(ctl, "bmcs", "list")

    step("Power the rack on through metald; the machines PXE-boot and enroll themselves")
    t_on = {}
    for m in rack.machines:
        show(ctl, "bmcs", "power", bmcs[m["name"]], "on")
        t_on[m["mac"]] = time.monotonic()
    t0 = min(t_on.values())
    ready: dict[str, float] = {}
    last = ""
    deadline = time.monotonic() + 600
    while len(ready) < len(t_on):
        if time.monotonic() > deadline:
            print(rack.diagnostics())
            raise SystemExit("demo: the rack did not enroll in 10 minutes")
        items = json.loads(ctl("--json", "machines", "list")[1])["items"]
        states = {n["mac"]: x["state"] for x in items for n in x["nics"]}
        line = "  ".join(
            f"{m['name']}:{states.get(m['mac'], 'off/booting')}" for m in rack.machines
        )
        if line != last:
            print(f"  +{time.monotonic() - t0:5.1f}s  {line}", flush=True)
            last = line
        for mac, st in states.items():
            if st == "ready" and mac in t_on and mac not in ready:
                ready[mac] = time.monotonic()
        time.sleep(1)
    for m in rack.machines:
        timings[f"{m['name']} ({m['firmware']}) power-on to ready"] = (
            ready[m["mac"]] - t_on[m["mac"]]
        )
    timings["whole rack power-on to ready"] = max(ready.values()) - t0
    show(ctl, "machines", "list")
    show(ctl, "bmcs", "list")
    tenant_phase(rack, ctl, timings)
    if os.environ.get("DISK") == "1":
        claim_phase(rack, ctl, timings, workdir)
    return ctl, rack.down if os.environ.get("KEEP") != "1" else (lambda: None), timings


def wait_states(
    rack, ctl: Ctl, ids: list[str], want: str, timeout: float, t0: float, bad: str = "failed"
) -> None:  # type: ignore[no-untyped-def]
    """Print each change of the machines' states until all are ``want``."""
    names = {i: rack.json("machines", "show", i).get("name") or i[:8] for i in ids}
    last = ""
    deadline = time.monotonic() + timeout
    while True:
        states = {i: json.loads(ctl("--json", "machines", "show", i)[1])["state"] for i in ids}
        line = "  ".join(f"{names[i]}:{st}" for i, st in states.items())
        if line != last:
            print(f"  +{time.monotonic() - t0:5.1f}s  {line}", flush=True)
            last = line
        if all(st == want for st in states.values()):
            return
        if time.monotonic() > deadline or any(bad in st for st in states.values()):
            raise SystemExit(f"demo: machines did not reach {want}: {states}\n{rack.diagnostics()}")
        time.sleep(1)


def tenant_phase(rack, ctl: Ctl, timings: dict[str, float]) -> None:  # type: ignore[no-untyped-def]
    from metald.tenants.controlplane import exec_in

    step(
        "Tenant acme: a WireGuard hub and a Slurm control plane (slurmctld + munged), run by metald"
    )
    tenant = quiet_json(ctl, "tenants", "create", "acme")
    hub = quiet_json(ctl, "tenants", "hub", tenant["name"], "--create")
    print(
        f"  hub {hub['ifname']} at {hub['endpoint']}, overlay {hub['overlay_prefix']}, "
        f"slurmctld on {hub['address']}:6817, VLAN {tenant['vlan']} for switch automation"
    )

    step("Build the tenant node image from Debian packages (slurmd, munge, WireGuard; cached)")
    t = time.monotonic()
    image_args = rack.publish_node_image()
    timings["node image (build or cache)"] = time.monotonic() - t
    quiet_json(ctl, "images", "create", "acme-node", *image_args)
    orch = show(
        ctl, "tokens", "create", "--name", "acme-orch", "--role", "orchestrator",
        "--scope", tenant["name"],
    ).splitlines()[-1]  # fmt: skip
    as_orch = {"METALD_TOKEN": orch}

    step(
        "The orchestrator claims 2 machines for acme; they boot the node image and join by themselves"
    )
    t = time.monotonic()
    args = ["claims", "create", "--tenant", tenant["name"], "--count", "2", "--image", "acme-node",
            "--idempotency-key", "demo-acme-1"]  # fmt: skip
    claim = quiet_json(ctl, *args, env=as_orch)
    names = ", ".join(m["name"] or m["id"][:8] for m in claim["machines"])
    print(f"claim {claim['id'][:8]}: {names} allocated to acme", flush=True)
    ids = [m["id"] for m in claim["machines"]]
    wait_states(rack, ctl, ids, "active", 600, t)
    timings["claim 2 -> booted, joined over WireGuard, Slurm nodes up"] = time.monotonic() - t
    show(ctl, "claims", "show", claim["id"][:8], env=as_orch)

    step("acme's Slurm cluster (inside its control plane)")
    for argv in (["sinfo", "-N", "-l"], ["srun", "-N2", "hostname"]):
        print("$ " + " ".join(argv), flush=True)
        t = time.monotonic()
        r = exec_in(rack.state_dir, tenant["id"], argv, timeout=120)
        print((r.stdout + r.stderr).rstrip(), flush=True)
        if r.returncode != 0:
            raise SystemExit(f"demo: {' '.join(argv)} failed")
        if argv[0] == "srun":
            timings["srun -N2 hostname"] = time.monotonic() - t
    show(ctl, "tenants", "hub", tenant["name"])

    step("The orchestrator releases the claim: off the hub, out of the cluster, wiped, ready")
    t = time.monotonic()
    show(ctl, "claims", "release", claim["id"][:8], "--yes", env=as_orch)
    r = exec_in(rack.state_dir, tenant["id"], ["sinfo", "-N"], timeout=60)
    print("$ sinfo -N\n" + r.stdout.rstrip(), flush=True)
    wait_states(rack, ctl, ids, "ready", 900, t, bad="wipe-failed")
    timings["release -> off the cluster, wiped and ready"] = time.monotonic() - t


def claim_phase(rack, ctl: Ctl, timings: dict[str, float], workdir: Path) -> None:  # type: ignore[no-untyped-def]
    from .rack import MARKER

    step("DISK=1: an orchestrator claims 2 machines for tenant initech with a disk image")
    image_args = rack.publish_test_image(workdir)
    # Names where a technician would type them (every command resolves them).
    tenant = quiet_json(ctl, "tenants", "create", "initech")["name"]
    img = quiet_json(ctl, "images", "create", "demo-disk", *image_args)["name"]
    orch = show(
        ctl, "tokens", "create", "--name", "initech-orch", "--role", "orchestrator",
        "--scope", tenant,
    ).splitlines()[-1]  # fmt: skip
    as_orch = {"METALD_TOKEN": orch}
    t = time.monotonic()
    claim = json.loads(
        show(
            ctl,
            "--json",
            "claims",
            "create",
            "--tenant",
            tenant,
            "--count",
            "2",
            "--image",
            img,
            "--label",
            "firmware=bios",
            "--idempotency-key",
            "demo-disk-1",
            env=as_orch,
        )
    )
    step(
        "metald sets PXE once and power-cycles them; the agent writes, verifies and seeds the image"
    )
    show(ctl, "claims", "show", claim["id"][:8], "--watch", env=as_orch)
    by_id = {rack.machine_by_mac(m["mac"])["id"]: m for m in rack.machines}
    deadline = time.monotonic() + 300
    for mid in (m["id"] for m in claim["machines"]):
        log = Path(by_id[mid]["serial_log"])
        while MARKER[:24] not in log.read_bytes():
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: {mid} did not boot its disk\n{rack.diagnostics()}")
            time.sleep(1)
        line = next(x for x in log.read_bytes().splitlines() if MARKER[:24] in x)
        print(f"  {by_id[mid]['name']} serial console: {line.decode(errors='replace').strip()}")
    timings["claim -> image on disk, booted from it"] = time.monotonic() - t

    step("The orchestrator releases the claim: tokens revoked, disks wiped, machines back to ready")
    t = time.monotonic()
    show(ctl, "claims", "release", claim["id"][:8], "--yes", env=as_orch)
    deadline = time.monotonic() + 600
    while True:
        states = [
            json.loads(ctl("--json", "machines", "show", m["id"])[1])["state"]
            for m in claim["machines"]
        ]
        if all(st == "ready" for st in states):
            break
        if time.monotonic() > deadline or any(st == "wipe-failed" for st in states):
            raise SystemExit(f"demo: wipe did not finish: {states}\n{rack.diagnostics()}")
        time.sleep(2)
    timings["release -> wiped and ready"] = time.monotonic() - t
    show(ctl, "machines", "list")


def run_local(workdir: Path) -> tuple[Ctl, Callable[[], None], dict[str, float]]:
    port = free_port()
    conf = workdir / "metald.toml"
    conf.write_text(
        f'state_dir = "{workdir}"\ninstance = "demo"\n[api]\nlisten = "127.0.0.1:{port}"\n[bmc]\npower_sync_interval_s = 0\n'
        'networks = ["127.0.0.0/8", "0.0.0.0/0", "::/0"]\n'
    )
    step(f"Start metald (SQLite in {workdir})")
    log = open(workdir / "metald.log", "w")  # noqa: SIM115 - lives as long as the daemon
    proc = subprocess.Popen([BIN / "metald", "serve", "--config", conf], stderr=log)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        try:
            urllib.request.urlopen(url + "/healthz", timeout=1).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() - t0 > 30:
                print((workdir / "metald.log").read_text())
                raise SystemExit("demo: metald did not start") from None
            time.sleep(0.1)
    print(f"metald up in {time.monotonic() - t0:.1f}s at {url}")
    ctl = local_ctl(url, (workdir / "admin.token").read_text().strip())
    step(
        "A technician registers three machines by MAC (with a virtual rack they enroll themselves)"
    )
    for i in range(3):
        show(
            ctl,
            "machines",
            "register",
            "--mac",
            f"52:54:00:de:00:0{i + 1}",
            "--name",
            f"gpu-0{i + 1}",
            "--label",
            "pool=demo",
        )

    def stop() -> None:
        if os.environ.get("KEEP") == "1":
            print(f"KEEP=1: metald stays up (pid {proc.pid}) at {url}")
            return
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)

    return ctl, stop, {"metald start": time.monotonic() - t0}


def operate(ctl: Ctl) -> None:
    items = json.loads(ctl("--json", "machines", "list")[1])["items"]
    # Names, as a technician types them (every command takes a name where it takes an id).
    ids = [x["name"] or x["id"] for x in sorted(items, key=lambda x: x["nics"][0]["mac"])]

    step("Operate the fleet: maintenance, labels, broken, repair")
    show(ctl, "machines", "maintenance-on", ids[0], "--reason", "reseat GPU 3")
    show(ctl, "machines", "label", ids[1], "rack=r07")
    show(ctl, "machines", "mark-broken", ids[2], "--reason", "PSU fault")
    show(ctl, "machines", "repair", ids[2])
    show(ctl, "machines", "list")

    step("The lifecycle refuses what it must (exit 1 and a problem+json sentence)")
    show(ctl, "machines", "repair", ids[1], ok=False)
    show(ctl, "machines", "show", "no-such-machine", ok=False)

    step(
        "Scoped tokens: an orchestrator of tenant globex sees only globex's machines, and no tokens"
    )
    quiet_json(ctl, "tenants", "create", "globex")
    orch = show(
        ctl,
        "tokens",
        "create",
        "--name",
        "globex-orch",
        "--role",
        "orchestrator",
        "--scope",
        "globex",
    ).splitlines()[-1]
    show(ctl, "machines", "list", env={"METALD_TOKEN": orch})
    show(ctl, "tokens", "list", env={"METALD_TOKEN": orch}, ok=False)

    step("The audit trail: every change with who, why, from and to")
    show(ctl, "events", "--limit", "40")


def main() -> int:
    workdir = REPO_ROOT / "var" / "demo"
    if workdir.exists():
        if (workdir / "lab").exists():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "vmlab",
                    "--home",
                    str(workdir / "lab"),
                    "down",
                    # Only the demo's own lab: --all would also remove every other lab
                    # namespace on the host (another user's lab, a test run's).
                    "--name",
                    "demo",
                ],
                capture_output=True,
            )
        shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    why_not = can_run_rack()
    started = time.monotonic()
    if why_not:
        print(f"demo: no virtual rack: {why_not}; running the API walk-through on a local metald")
        ctl, stop, timings = run_local(workdir)
    else:
        ctl, stop, timings = run_rack(workdir)
    try:
        operate(ctl)
    finally:
        step("Summary")
        width = max(len(k) for k in timings)
        for k, v in timings.items():
            print(f"  {k:<{width}}  {v:7.1f} s")
        print(f"  {'demo total':<{width}}  {time.monotonic() - started:7.1f} s")
        stop()
        if os.environ.get("KEEP") == "1":
            print(
                f"KEEP=1: everything is still up; take it down with: vm-lab --home {workdir / 'lab'} down --name demo"
            )
        else:
            print("Everything was taken down. KEEP=1 make demo leaves it up.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
