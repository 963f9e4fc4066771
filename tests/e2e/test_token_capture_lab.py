"""No token crosses the provisioning network in clear (issue 28, item 5), in a virtual rack.

One BIOS machine (SeaBIOS and the NIC's own iPXE ROM) in a lab whose metald has a
provisioning listener (``[boot] http_listen``), no ``tls_auto`` setting and metald's own iPXE
built with the lab's CA, which its state folder starts with (as a fleet's instances share
one): so ``tls_auto`` and ``require_https`` come on by themselves. Every frame on the lab's
network (the bridge and every port of it, where a tenant's machine would listen) is captured
from before the power-on (``vmlab.capture``) through:

- enrollment: the ROM's iPXE is chainloaded into metald's (TFTP), which fetches its script
  over HTTPS pinned to the CA, the discovery image comes over HTTPS, and the agent posts its
  inventory with its token over HTTPS;
- provisioning and a join: the machine, claimed by a tenant with the stateless node image,
  boots it (kernel and initrd from a plain image server: not secret) and joins the tenant's
  WireGuard hub and Slurm with its join and node tokens, over HTTPS.

The capture holds DHCP, TFTP and tens of MB of TLS, and not one of metald's secrets (agent
and API tokens ``mtd_``, join ``mjt_``, node ``mnt_``) nor an ``Authorization`` header.

Then a man in the middle: metald's HTTPS port on the bridge is redirected (nftables) to a
second server with a certificate from another CA under the same name (``vmlab.mitm``), and
the claim is released: the wipe's network boot gets no script (iPXE refuses the certificate:
the man in the middle sees only failed handshakes, never a request), and the watchdog stops
the wipe with an event saying its boot never fetched its script.

METALD_LAB_LONG=1 only: 5-10 minutes of TCG boots on 2 busy cores, and the first run on a
machine builds metald's iPXE (10-15 minutes; cached after).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests import waiting
from tests.e2e.conftest import lab_ipxe_assets, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 480
ACTIVE_TIMEOUT_S = 480
WIPE_TIMEOUT_S = 90  # the wipe the man in the middle stops: the watchdog's limit
PORT = 8443


def _config(state: dict) -> str:  # type: ignore[type-arg]
    from vmlab.rack import tenants_config

    return (
        "[provision]\nwatchdog_interval_s = 5\n"
        f"wiping_timeout_s = {WIPE_TIMEOUT_S}\n" + tenants_config(state)
    )


def test_no_token_in_clear_and_a_man_in_the_middle_gets_nothing(tmp_path: Path) -> None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        pytest.skip("5-10 minutes of TCG boots (and a first iPXE build): METALD_LAB_LONG=1")
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.capture import secrets_in
    from vmlab.labipxe import seed_state, server_cert
    from vmlab.rack import LabRack

    assets = lab_ipxe_assets(tmp_path / "assets")
    seed_state(tmp_path / "rack" / "metald")  # metald's tls_auto CA is the one iPXE trusts
    rack = LabRack(
        f"cap{os.getpid() % 10000}",
        tmp_path / "rack",
        machines=1,
        uefi=0,
        rng=True,
        assets=assets,
        boot_config=f'http_listen = "0.0.0.0:{PORT}"\n',
        extra_config=_config,
    )
    try:
        _run(rack, tmp_path, secrets_in, server_cert)
    finally:
        rack.down()


def _run(rack, tmp_path: Path, secrets_in, server_cert) -> None:  # type: ignore[no-untyped-def]
    addr, bridge = rack.state["boot_address"], rack.state["bridge"]
    log = rack.log.read_text()
    assert "tls_auto stays off" not in log, log[-3000:]
    pcap, ready = tmp_path / "lab.pcap", tmp_path / "capture.ready"
    cap = rack.lab.spawn(
        [sys.executable, "-m", "vmlab.capture", str(pcap), str(ready)],
        role="capture",
        log=tmp_path / "capture.log",
    )
    waiting.wait_for("the capture to start", ready.exists, 30, every=0.2)
    (m,) = rack.machines
    mac = m["mac"]

    # Enrollment
    t0 = time.monotonic()
    bmcs = rack.register_bmcs(["ipmi"])
    rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
    rack.wait_state([mac], "ready", READY_TIMEOUT_S)
    t_ready = time.monotonic() - t0
    log = rack.log.read_text()
    serial = Path(m["serial_log"]).read_text(errors="replace")
    assert "TFTP ipxe/undionly.kpxe to " in log, log[-3000:]  # the ROM chainloaded metald's
    assert f"metald: chaining to https://{addr}:{PORT}/boot/{mac}.ipxe" in serial, serial[-3000:]

    # Provisioning and a join (the stateless node image; its kernel and initrd from a plain
    # HTTP image server on the lab network: not secret)
    st, tenant = rack.api("POST", "/api/v1/tenants", {"name": "alpha", "cluster_kind": "slurm"})
    assert st == 201, tenant
    st, hub = rack.api("POST", f"/api/v1/tenants/{tenant['id']}/hub", {})
    assert st == 201, hub
    img = rack.json("images", "create", "tenant-node", *rack.publish_node_image())
    t1 = time.monotonic()
    claim = rack.json(
        "claims", "create", "--tenant", tenant["id"], "--count", "1", "--image", img["id"]
    )
    (mid,) = [x["id"] for x in claim["machines"]]
    waiting.wait_for(
        "the machine to join (active)",
        lambda: rack.json("machines", "show", mid)["state"] == "active",
        ACTIVE_TIMEOUT_S,
        every=2,
        explain=rack.diagnostics,
    )
    t_active = time.monotonic() - t1

    # The man in the middle: metald's HTTPS port on the bridge answered by another server
    mitm_log = tmp_path / "mitm.log"
    cert, key = server_cert(tmp_path / "mitm", addr, foreign=True)
    rack.lab.spawn(
        [sys.executable, "-m", "vmlab.mitm", "9443", str(cert), str(key), str(mitm_log)],
        role="mitm",
        log=tmp_path / "mitm.out",
    )
    waiting.wait_for("the man in the middle to listen", mitm_log.exists, 30, every=0.2)
    nft = (
        "table ip mitm {\n chain pre {\n  type nat hook prerouting priority -100;\n"
        f'  iifname "{bridge}" tcp dport {PORT} redirect to :9443\n }}\n}}\n'
    )
    r = rack.lab.run(["nft", "-f", "-"], input=nft, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    t2 = time.monotonic()
    rack.ctl("claims", "release", claim["id"], "--yes")
    waiting.wait_for(
        "the wipe to stop (watchdog)",
        lambda: rack.json("machines", "show", mid)["state"] == "wipe-failed",
        WIPE_TIMEOUT_S + 240,
        every=2,
        explain=rack.diagnostics,
    )
    t_stop = time.monotonic() - t2
    cap.send_signal(signal.SIGTERM)
    cap.wait(30)

    events = rack.json("events", "--limit", "1000")["items"]
    (timeout,) = [e for e in events if e["kind"] == "watchdog.timeout" and e["machine_id"] == mid]
    assert timeout["data"]["script_fetched"] is False, timeout
    assert "never fetched its iPXE script" in timeout["reason"], timeout
    mitm = mitm_log.read_text().splitlines()
    assert mitm and all(line.startswith("handshake-failed") for line in mitm), mitm
    serial = Path(m["serial_log"]).read_text(errors="replace")
    assert "metald: no boot script yet" in serial, serial[-2000:]

    found = secrets_in(pcap, also=(b"Authorization:", b"metald.token=", rack.token.encode()))
    print(
        f"\ncapture: {found.frames} frames, {found.connections} TCP connections, "
        f"{found.payload_bytes / 1e6:.1f} MB of payload; power-on -> ready {t_ready:.1f} s, "
        f"claim -> joined {t_active:.1f} s, release -> wipe stopped {t_stop:.1f} s; "
        f"man in the middle: {len(mitm)} refused handshakes"
    )
    assert found.hits == [], found.hits[:5]
    assert PORT in found.tcp_ports and 69 not in found.tcp_ports
    assert found.payload_bytes > 10_000_000  # the discovery image and the node image crossed
    # the capture saw the clear parts: DHCP and the TFTP of metald's iPXE
    raw = pcap.read_bytes()
    assert b"ipxe/undionly.kpxe" in raw and b"metald" in raw
