"""Measured-boot attestation through the whole lifecycle, for real (METALD_LAB_LONG=1).

A lab machine with OVMF's measured boot and a TPM (swtpm with an EK certificate) is powered
on through its Redfish BMC by metald. Its discovery boot enrolls the agent's attestation key
(credential activation against the EK) and metald learns its golden values (trust on first
use). A tenant claims it with the node image; with root on the node (a Slurm job: the tenant's
control plane runs jobs as root) the tenant reorders the UEFI boot order with efibootmgr,
through efivarfs. The claim is released: the wipe boot's quote and event log show the change,
the wipe still finishes, and the machine is held in ``attestation-failed`` with the evidence
(PCR 1, the BootOrder event) in its events, its ``last_error`` and its attestation API. A
technician accepts the new boot as golden with a reason and the machine is ready again.
The test prints how long each step took.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metald.provision.metadata import hostname
from metald.tenants import controlplane
from tests import waiting
from tests.e2e.conftest import RULES, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 900
ACTIVE_TIMEOUT_S = 600
HELD_TIMEOUT_S = 900


def _skip_reason() -> str | None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        return "three OVMF boots under TCG take minutes: set METALD_LAB_LONG=1 (make test-long)"
    if shutil.which("swtpm") is None or shutil.which("swtpm_setup") is None:
        return "needs swtpm and swtpm-tools"
    from vmlab.qemu import OVMF_CODE_4M

    if not OVMF_CODE_4M.exists():
        return "needs ovmf (the 4 MB measured-boot build)"
    return lab_skip_reason()


@pytest.fixture(scope="module")
def rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from vmlab.rack import LabRack, tenants_config

    lab = LabRack(
        f"att{os.getpid() % 10000}",
        Path(tmp_path_factory.mktemp("attest")),
        machines=1,
        uefi=1,
        tpm=True,
        extra_config=lambda state: RULES + tenants_config(state),
    )
    try:
        yield lab
    finally:
        lab.down()


def _wait(what: str, fn: Any, timeout: float, rack: Any) -> float:
    t0 = time.monotonic()
    waiting.wait_for(what, fn, timeout, every=2, explain=rack.diagnostics)
    return time.monotonic() - t0


def _attest_costs(serial: str) -> list[float]:
    """Per boot, what the agent's attestation took: from its "measured boot: attesting" line
    to its verdict line ("attestation: passed", ...), by the uptime stamps it prints."""
    costs, start = [], None
    for line in serial.splitlines():
        m = re.search(r"metald-agent: \[([0-9.]+)\] (.*)", line)
        if not m:
            continue
        if m.group(2).startswith("measured boot: attesting"):
            start = float(m.group(1))
        elif m.group(2).startswith("attestation: ") and start is not None:
            costs.append(float(m.group(1)) - start)
            start = None
    return costs


def _bmc_boot_pxe_once(rack: Any, m: dict[str, Any]) -> None:
    b = m["bmc"]
    r = subprocess.run(
        rack.lab.exec_argv([
            "curl", "-sS", "-m", "30", "-u", f"{b['username']}:{b['password']}", "-X", "PATCH",
            "-H", "Content-Type: application/json", "-o", "/dev/null", "-w", "%{http_code}",
            "-d", '{"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}',
            f"{b['redfish_url']}/redfish/v1/Systems/{m['name']}",
        ]),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.stdout == "200", (r.stdout, r.stderr)


def _on_node(rack: Any, tenant_id: str, node: str, script: str) -> subprocess.CompletedProcess[str]:
    """The tenant runs ``script`` as root on its node (a Slurm job from its control plane)."""
    argv = ["srun", "-w", node, "sh", "-c", script]
    return controlplane.exec_in(rack.state_dir, tenant_id, argv, timeout=120)


def test_a_tenants_boot_order_change_holds_the_machine_until_accepted(rack: Any) -> None:
    (m,) = rack.machines
    assert m["tpm"] is not None
    times: dict[str, float] = {}

    # 1. Enrollment: metald powers it on; the discovery boot enrolls the AK and learns.
    bmcs = rack.register_bmcs(["redfish"])
    # The first power-on network-boots the way metald's own discovery and wipe boots do: a
    # one-time PXE override. PCR 1 measures BootOrder, and QEMU (like BMCs that implement an
    # override by rewriting BootOrder) puts the overridden device first in it: a first boot
    # from the standing order (disk first) would learn another BootOrder than every later
    # metald-driven boot measures.
    _bmc_boot_pxe_once(rack, m)
    t0 = time.monotonic()
    rack.ctl("bmcs", "power", bmcs[m["name"]]["id"], "on")
    ready = rack.wait_state([m["mac"]], "ready", READY_TIMEOUT_S)
    times["power-on to ready (enrolled, golden values learned)"] = ready[m["mac"]] - t0
    item = rack.machine_by_mac(m["mac"])
    mid = item["id"]
    att = rack.json("machines", "attestation", mid)
    assert att["key"] and att["key"]["ek_check"], att
    assert att["golden"]["source"] == "first-use", att["golden"]
    assert att["attestations"][-1]["status"] == "learned", att["attestations"]
    assert {a["status"] for a in att["attestations"]} <= {"learned", "passed"}, att
    assert "1" in att["golden"]["pcrs"] and "7" in att["golden"]["pcrs"]

    # 2. A tenant claims it with the node image and gets root on it.
    st, tenant = rack.api("POST", "/api/v1/tenants", {"name": "mallory", "cluster_kind": "slurm"})
    assert st == 201, tenant
    st, hub = rack.api("POST", f"/api/v1/tenants/{tenant['id']}/hub", {})
    assert st == 201, hub
    img = rack.json("images", "create", "tenant-node", *rack.publish_node_image())

    def tenancy(label: str) -> dict[str, Any]:
        claim = rack.json("claims", "create", "--tenant", tenant["id"], "--count", "1", "--image", img["id"])  # fmt: skip
        assert [x["id"] for x in claim["machines"]] == [mid]
        times[f"{label}: claim to active (node in the tenant's Slurm)"] = _wait(
            "the node active",
            lambda: rack.json("machines", "show", mid)["state"] == "active",
            ACTIVE_TIMEOUT_S,
            rack,
        )
        return claim

    def release(label: str, claim: dict[str, Any]) -> dict[str, Any]:
        rack.ctl("claims", "release", claim["id"], "--yes")
        times[f"{label}: release to the wipe's end"] = _wait(
            "the wipe's end",
            lambda: rack.json("machines", "show", mid)["state"] in ("attestation-failed", "ready"),
            HELD_TIMEOUT_S,
            rack,
        )
        return dict(rack.json("machines", "show", mid))

    # The control: a tenancy that changes nothing below the disk passes the wipe boot's
    # attestation and returns to ready (so what holds the machine below is the change alone,
    # not the lab's own boot-order overrides).
    claim = tenancy("tenancy 1 (no change)")
    shown = release("tenancy 1", claim)
    att = rack.json("machines", "attestation", mid)
    assert shown["state"] == "ready", (shown["last_error"], att["attestations"][0])
    assert (att["attestations"][0]["status"], att["attestations"][0]["machine_state"]) == (
        "passed", "wiping",
    ), att["attestations"][0]  # fmt: skip

    claim = tenancy("tenancy 2 (boot order changed)")
    node = hostname(mid, rack.json("machines", "show", mid).get("name"))

    # 3. The tenant changes the firmware's boot order from inside its OS (efibootmgr on
    # efivarfs): the first two entries of BootOrder swap places.
    before = _on_node(rack, tenant["id"], node, "efibootmgr")
    assert before.returncode == 0, (before.stdout, before.stderr)
    order_line = next(li for li in before.stdout.splitlines() if li.startswith("BootOrder:"))
    order = order_line.split(":", 1)[1].strip().split(",")
    assert len(order) >= 2, before.stdout
    new_order = [order[1], order[0], *order[2:]]
    changed = _on_node(rack, tenant["id"], node, f"efibootmgr -o {','.join(new_order)}")
    assert changed.returncode == 0, (changed.stdout, changed.stderr)
    assert f"BootOrder: {','.join(new_order)}" in changed.stdout, changed.stdout
    print(f"\ntenant: BootOrder {','.join(order)} -> {','.join(new_order)}\n{before.stdout}")

    # 4. Release: the wipe boot attests, the wipe finishes, the machine is held.
    release("tenancy 2", claim)
    shown = rack.json("machines", "show", mid)
    assert shown["state"] == "attestation-failed", shown
    assert "PCR 1" in shown["last_error"] and "BootOrder" in shown["last_error"], shown
    att = rack.json("machines", "attestation", mid)
    last = att["attestations"][0]
    assert last["status"] == "failed" and last["machine_state"] == "wiping", last
    assert [c["pcr"] for c in last["changes"]] == [1], last["changes"]  # the change, only
    pcr1 = last["changes"]
    assert any(e["label"] == "BootOrder" and e["change"] == "changed" for e in pcr1[0]["events"]), (
        pcr1
    )
    events = rack.json("events", "--machine", mid, "--limit", "200")["items"]
    failed = [e for e in events if e["kind"] == "attestation.failed"]
    assert failed and "BootOrder" in failed[0]["reason"], failed
    print(f"held: {shown['last_error']}")

    # 5. A technician accepts the new boot as golden, with a reason: ready again.
    rack.ctl("machines", "accept-golden", mid, "--reason", "lab: the tenant's boot order, kept")
    times["accept-golden to ready"] = _wait(
        "ready after accept-golden",
        lambda: rack.json("machines", "show", mid)["state"] == "ready",
        60,
        rack,
    )
    att = rack.json("machines", "attestation", mid)
    assert att["golden"]["source"] == "accepted", att["golden"]
    assert att["golden"]["reason"] == "lab: the tenant's boot order, kept"
    print("\n".join(f"{what}: {s:.1f} s" for what, s in times.items()))
    print("attestation in each discovery or wipe boot (the agent's uptime stamps): " + ", ".join(
        f"{cost:.2f} s" for cost in _attest_costs(Path(m["serial_log"]).read_text(errors="replace"))
    ))  # fmt: skip
    print(f"load average: {os.getloadavg()}")
