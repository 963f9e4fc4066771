"""kill -9 the instance that owns the BMCs while a claim is provisioning: a survivor takes the
BMCs over, resumes the cut-off network boots from the store's journal, the claim completes, and
no BMC was sent a command twice.

Real parts: PostgreSQL, two metald processes, OpenIPMI ``ipmi_sim`` BMCs whose chassis script
logs every command it receives. The machines are simulated by API calls as their agent makes
them (the agent token is the one the armed boot's script carries, minted as the boot hook does).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from metald.fleet import forward_auth
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Bmc, Machine
from tests.bmc.peers import IpmiSim, start_ipmi_sim, stop_peer
from tests.claims.helpers import add_image, add_ready, add_tenant, boot_token
from tests.conftest import LAB_BMC_TOML
from tests.test_daemon import BIN, share_secrets_key, wait_http
from tests.waiting import wait_for
from vmlab.labnet import free_port

pytestmark = pytest.mark.postgres

HEARTBEAT_S, DEAD_AFTER_S = 0.5, 3.0
N = 3  # machines (and BMCs)


def _conf(tmp: Path, name: str, port: int, url: str) -> Path:
    conf = tmp / f"{name}.toml"
    conf.write_text(
        f'state_dir = "{tmp / name}"\ninstance = "{name}"\n[store]\nurl = "{url}"\n'
        f'[api]\nlisten = "127.0.0.1:{port}"\npublic_url = "http://127.0.0.1:{port}"\n'
        f"[fleet]\nheartbeat_s = {HEARTBEAT_S}\ndead_after_s = {DEAD_AFTER_S}\n"
        "[bmc]\n"
        + LAB_BMC_TOML
        + "power_sync_interval_s = 1\nmin_interval_ms = 0\ntimeout_s = 2\nretries = 1\n"
        "[provision]\nwatchdog_interval_s = 1\n"
    )
    return conf


def _http(port: int, method: str, path: str, token: str, body: Any = None) -> Any:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{method} {path}: {e.code} {e.read().decode()}") from None


def _sets(sim: IpmiSim) -> list[str]:
    """The state-changing commands the BMC received (reads left out)."""
    return [c for c in sim.calls() if c.startswith("set ")]


@pytest.mark.skipif(shutil.which("ipmi_sim") is None, reason="ipmi_sim (openipmi) not installed")
def test_kill_9_the_bmc_owner_mid_claim_the_claim_completes_no_command_twice(
    tmp_path: Path,
    pg_server,  # type: ignore[no-untyped-def]
) -> None:
    url = pg_server.new_database()
    names = ["rack0", "rack1"]
    share_secrets_key(tmp_path, names)
    ports = {n: free_port() for n in names}
    procs: dict[str, subprocess.Popen] = {}
    peers: list[subprocess.Popen] = []
    try:
        for n in names:
            procs[n] = subprocess.Popen(
                [BIN / "metald", "serve", "--config", _conf(tmp_path, n, ports[n], url)],
                stderr=open(tmp_path / f"{n}.log", "w"),  # noqa: SIM115 - closed with the process
            )
        for n in names:
            wait_http(ports[n], procs[n])
        admin = next(
            (tmp_path / n / "admin.token").read_text().strip()
            for n in names
            if (tmp_path / n / "admin.token").exists()
        )

        store = Store(url)
        try:
            mids = add_ready(store, N)
            tenant = add_tenant(store, "acme")
            image = add_image(store)
        finally:
            store.close()

        # Each machine's BMC, on; a power-off is held (not applied) until the test lets go.
        sims: list[IpmiSim] = []
        for i in range(N):
            sim, proc = start_ipmi_sim(tmp_path / f"bmc{i}", power_on=True)
            peers.append(proc)
            sims.append(sim)
            (tmp_path / f"bmc{i}" / "hold-off").touch()
        bmc_ids = []
        for i, sim in enumerate(sims):
            b = _http(
                ports["rack0"],
                "POST",
                "/api/v1/bmcs",
                admin,
                {
                    "address": "127.0.0.1",
                    "port": sim.port,
                    "protocol": "ipmi",
                    "username": sim.username,
                    "password": sim.password,
                    "machine_id": mids[i],
                },
            )
            bmc_ids.append(b["id"])
        # Every instance must see the same fleet before the owners mean anything (under load
        # an instance may not have read a peer's first heartbeat yet).
        deadline = time.monotonic() + 30
        while True:
            views = [
                {
                    b["id"]: b["owner_instance"]
                    for b in _http(ports[n], "GET", "/api/v1/bmcs", admin)["items"]
                }
                for n in names
            ]
            if all(v == views[0] for v in views) and None not in views[0].values():
                break
            assert time.monotonic() < deadline, views
            time.sleep(0.1)
        owners = views[0]
        assert set(owners.values()) <= set(names) and None not in owners.values()
        victim = Counter(owners.values()).most_common(1)[0][0]
        survivor = next(n for n in names if n != victim)

        # A technician's command reaches either instance; it runs on the BMC's owner (a
        # non-owner forwards it: run there, it would be refused with 503).
        vm = mids[next(i for i, b in enumerate(bmc_ids) if owners[b] == victim)]
        got = _http(ports[survivor], "GET", f"/api/v1/machines/{vm}/power", admin)
        assert got["power_state"] == "on"
        path = f"/api/v1/machines/{vm}/power"
        box = SecretBox.from_file(tmp_path / victim / "secrets.key")
        for mark, code in (
            ({forward_auth.FORWARDED: "loop"}, 403),  # a client's unsigned mark: refused
            (forward_auth.sign(box, "GET", path, victim), 503),  # never forwarded again
        ):
            req = urllib.request.Request(
                f"http://127.0.0.1:{ports[survivor]}{path}",
                headers={"Authorization": f"Bearer {admin}", **mark},
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=30)
            assert refused.value.code == code
        assert victim in json.loads(refused.value.read())["detail"]

        orch = _http(
            ports[survivor],
            "POST",
            "/api/v1/tokens",
            admin,
            {"name": "orch", "role": "orchestrator", "scope": [tenant]},
        )["token"]
        # The claim reaches the instance that will die: it starts the steps of its own BMCs
        # and hands the others to their owner through the store.
        claim = _http(
            ports[victim],
            "POST",
            "/api/v1/claims",
            orch,
            {"tenant_id": tenant, "count": N, "image_id": image},
        )
        assert sorted(m["id"] for m in claim["machines"]) == sorted(mids)

        # Every BMC was asked to power off (by its owner) and the machines are slow to go off:
        # the owners wait, mid-step. Kill the one that owns most of them.
        wait_for("every BMC asked to power off", lambda: all(_sets(s) for s in sims))
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        killed = time.monotonic()

        victims_bmcs = [b for b, o in owners.items() if o == victim]
        store = Store(url)
        try:

            def taken_over() -> bool:
                with store.session() as s:
                    rows = s.exec(select(Bmc).where(Bmc.id.in_(victims_bmcs))).all()  # type: ignore[attr-defined]
                    return all(r.owner == survivor for r in rows)

            wait_for("the survivor holds the dead instance's BMCs", taken_over, timeout=30)
            takeover_s = time.monotonic() - killed
            shown = _http(ports[survivor], "GET", "/api/v1/bmcs", admin)["items"]
            assert {b["owner_instance"] for b in shown} == {survivor}

            # The survivor resumes the cut-off steps while the machines are still going off:
            # it must read the power state, not send the power-off again.
            seen = [len(s.calls()) for s in sims]
            wait_for(
                "the survivor reads every BMC again",
                lambda: all(len(s.calls()) > n + 1 for s, n in zip(sims, seen, strict=True)),
                timeout=30,
            )
            for i in range(N):  # the machines now go off
                (tmp_path / f"bmc{i}" / "hold-off").unlink()
                (tmp_path / f"bmc{i}" / "power").write_text("0\n")

            # Each machine is booted by the survivor: one-time PXE, then on.
            wait_for(
                "every BMC asked to power on",
                lambda: all("set power 1" in _sets(s) for s in sims),
                timeout=30,
            )
            booted_s = time.monotonic() - killed

            # Each machine's agent: the armed boot's token, the provision instruction, done.
            for mid in mids:
                token = boot_token(store, mid)
                assert token, f"machine {mid}: no boot armed"
                todo = _http(ports[survivor], "GET", "/api/v1/agent/provision", token)
                assert todo["action"] == "provision"
                _http(ports[survivor], "POST", "/api/v1/agent/progress", token, {"phase": "write"})
                out = _http(
                    ports[survivor],
                    "POST",
                    "/api/v1/agent/progress",
                    token,
                    {"phase": "verify", "done": True},
                )
                assert out["state"] == "provisioned"
            got = _http(ports[survivor], "GET", f"/api/v1/claims/{claim['id']}", orch)
            assert {m["state"] for m in got["machines"]} == {"provisioned"}
            with store.session() as s:
                states = {m.id: m.state for m in s.exec(select(Machine)).all()}
            assert all(states[m] == "provisioned" for m in mids)
        finally:
            store.close()

        # No BMC received any state-changing command twice across the failover: one power-off
        # (the dead owner's, never resent: the survivor read the power state instead), one
        # boot-device set and one power-on (the survivor's).
        for i, sim in enumerate(sims):
            sets = _sets(sim)
            assert sets.count("set power 0") == 1, (i, sets)
            assert sets.count("set power 1") == 1, (i, sets)
            assert all(n == 1 for n in Counter(sets).values()), (i, sets)
        print(
            f"\nfailover: {len(victims_bmcs)}/{N} BMCs taken over {takeover_s:.2f} s after the "
            f"kill (dead_after_s {DEAD_AFTER_S}, heartbeat_s {HEARTBEAT_S}); every machine "
            f"powered on {booted_s:.2f} s after it"
        )
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
        for p in peers:
            stop_peer(p)
