"""``make demo``: run metald on the embedded default (SQLite) and walk through operating it.

Starts a real ``metald serve`` process in ./var/demo, then uses ``metalctl`` and the HTTP API as
a technician and an orchestrator would, printing each step and its output. ``KEEP=1`` leaves
the daemon running afterwards (its URL and admin token are printed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def sh(args: list[str], env: dict[str, str], ok: bool = True) -> str:
    print(
        "$ " + " ".join(a if " " not in a else repr(a) for a in ["metalctl", *args[1:]] if a),
        flush=True,
    )
    r = subprocess.run(args, env=env, capture_output=True, text=True)
    out = (r.stdout + r.stderr).rstrip()
    if out:
        print(out, flush=True)
    if ok and r.returncode != 0:
        raise SystemExit(f"demo: step failed ({r.returncode})")
    return r.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    state = ROOT / "var" / "demo"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    port = free_port()
    conf = state / "metald.toml"
    conf.write_text(
        f'state_dir = "{state}"\ninstance = "demo"\n[api]\nlisten = "127.0.0.1:{port}"\n'
        "[bmc]\npower_sync_interval_s = 0\n"
    )
    step(f"Start metald (SQLite in {state})")
    log = open(state / "metald.log", "w")  # noqa: SIM115 - lives as long as the daemon
    proc = subprocess.Popen([BIN / "metald", "serve", "--config", conf], stderr=log)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        try:
            health = json.loads(urllib.request.urlopen(url + "/healthz", timeout=1).read())
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() - t0 > 30:
                print((state / "metald.log").read_text())
                raise SystemExit("demo: metald did not start") from None
            time.sleep(0.1)
    print(
        f"metald {health['version']} up in {time.monotonic() - t0:.1f}s at {url}; database {health['database']}"
    )
    admin = (state / "admin.token").read_text().strip()
    print(f"first-start admin token written to {state / 'admin.token'} (mode 0600)")
    env = {**os.environ, "METALD_URL": url, "METALD_TOKEN": admin}
    ctl = str(BIN / "metalctl")
    try:
        step("A technician registers three machines by MAC")
        ids = []
        for i, labels in enumerate(["pool=train", "pool=train", "pool=infer"]):
            out = sh(
                [
                    ctl,
                    "--json",
                    "machines",
                    "register",
                    "--mac",
                    f"52:54:00:de:00:0{i + 1}",
                    "--name",
                    f"gpu-0{i + 1}",
                    "--label",
                    labels,
                ],
                env,
            )
            ids.append(json.loads(out)["id"])
        sh([ctl, "machines", "list"], env)

        step("Operate: maintenance, labels, broken, repair")
        sh([ctl, "machines", "maintenance-on", ids[0], "--reason", "reseat GPU 3"], env)
        sh([ctl, "machines", "label", ids[1], "rack=r07", "pool-"], env)
        sh([ctl, "machines", "mark-broken", ids[2], "--reason", "PSU fault"], env)
        sh([ctl, "machines", "repair", ids[2]], env)
        sh([ctl, "machines", "list", "--state", "maintenance"], env)

        step("The lifecycle refuses what it must (exit 1, a problem+json sentence)")
        sh([ctl, "machines", "maintenance-off", ids[0]], env, ok=False)
        sh([ctl, "machines", "repair", ids[1]], env, ok=False)

        step("Tokens: an orchestrator scoped to one tenant sees only that tenant's machines")
        tenant = json.loads(sh([ctl, "--json", "tenants", "create", "acme"], env))["id"]
        orch = sh(
            [
                ctl,
                "tokens",
                "create",
                "--name",
                "acme-orch",
                "--role",
                "orchestrator",
                "--scope",
                tenant,
            ],
            env,
        ).splitlines()[-1]
        sh([ctl, "tokens", "list"], env)
        sh([ctl, "machines", "list"], {**env, "METALD_TOKEN": orch})
        sh([ctl, "tokens", "list"], {**env, "METALD_TOKEN": orch}, ok=False)

        step("Bad input gets RFC 9457 problem+json")
        req = urllib.request.Request(
            url + "/api/v1/machines",
            data=b'{"macs": "nope", "colour": 1}',
            method="POST",
            headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req)
        except urllib.error.HTTPError as e:
            print(
                f"HTTP {e.code} {e.headers['Content-Type']}\n{json.dumps(json.loads(e.read()), indent=2)}"
            )

        step("The audit trail (every transition with who, why, from, to)")
        sh([ctl, "events"], env)
        print(f"\nOpenAPI: {url}/api/v1/openapi.json   metrics: {url}/metrics")
    finally:
        if os.environ.get("KEEP") == "1":
            print(
                f"\nKEEP=1: metald stays up (pid {proc.pid}). export METALD_URL={url} METALD_TOKEN=$(cat {state / 'admin.token'})"
            )
        else:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
            print("\nmetald stopped (SIGTERM). Re-run with KEEP=1 to leave it running.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
