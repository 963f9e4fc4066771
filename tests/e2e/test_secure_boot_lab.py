"""Secure Boot required, through metald and the lab's Redfish BMC, for real (METALD_LAB_LONG=1).

A lab machine booting OVMF's Secure Boot build (SMM) enrolls with Secure Boot off (its
variables in setup mode) and reaches ready through metald's unsigned chain (Debian's iPXE
over OVMF's own PXE, the discovery kernel). A claim asking ``secure_boot: true`` is refused.
An admin has metald enroll its signing certificate in db and enable Secure Boot through
Redfish; a re-inspection powers the machine on through its BMC, which writes PK, KEK, db and
SecureBootEnable into the firmware's variables (``vmlab.secureboot_fw``). The firmware now
refuses the unsigned iPXE metald serves and the machine never reaches the agent. Once the iPXE
and the discovery kernel are signed with metald's key (``bootassets.secureboot``), the next
power cycle boots the signed chain to the agent and ready, with the BMC reporting the current
boot verified, and the ``secure_boot: true`` claim takes the machine. Prints the times.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bootassets.secureboot import new_key, sign, verify
from tests import waiting
from tests.e2e.conftest import RULES, lab_skip_reason

pytestmark = [pytest.mark.lab, pytest.mark.root]

READY_TIMEOUT_S = 900
REFUSED_TIMEOUT_S = 600
#: After the firmware refused the unsigned iPXE: how long the machine must stay away from the
#: agent (the discovery boot takes well over a minute here, so an accepted chain would show).
NEVER_S = 90
REFUSAL = ("Access Denied", "Security Violation")


def _skip_reason() -> str | None:
    if os.environ.get("METALD_LAB_LONG") != "1":
        return "OVMF Secure Boot boots under TCG take minutes: set METALD_LAB_LONG=1"
    from vmlab.qemu import OVMF_CODE_SECBOOT
    from vmlab.secureboot_fw import virt_fw_vars

    if shutil.which("sbsign") is None or not OVMF_CODE_SECBOOT.exists():
        return "needs sbsigntool and ovmf"
    if not Path(virt_fw_vars()).exists():
        return "needs virt-firmware (pip)"
    return lab_skip_reason()


@pytest.fixture(scope="module")
def sb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from bootassets.build import ensure_built
    from vmlab.rack import LabRack

    work = Path(tmp_path_factory.mktemp("secureboot"))
    key, cert = new_key(work / "signing")
    assets = work / "assets"  # a copy: the shared cache is never signed in place
    shutil.copytree(ensure_built(), assets)
    rack = LabRack(
        f"sb{os.getpid() % 10000}",
        work,
        machines=1,
        uefi=1,
        secure_boot=True,
        nic_rom=False,  # QEMU's iPXE option ROM is unsigned: OVMF's own PXE boots
        assets=assets,
        bmc_config=f'secure_boot_cert = "{cert}"\n',
        extra_config=RULES,
    )
    try:
        yield {"rack": rack, "key": key, "cert": cert, "assets": assets}
    finally:
        rack.down()


def _wait(what: str, fn: Any, timeout: float, rack: Any) -> float:
    t0 = time.monotonic()
    waiting.wait_for(what, fn, timeout, every=2, explain=rack.diagnostics)
    return time.monotonic() - t0


def test_secure_boot_required_unsigned_refused_signed_reaches_ready(sb: dict[str, Any]) -> None:
    rack = sb["rack"]
    (m,) = rack.machines
    serial = Path(m["serial_log"])
    times: dict[str, float] = {}
    bmc = rack.register_bmcs(["redfish"])[m["name"]]
    t0 = time.monotonic()
    rack.ctl("bmcs", "power", bmc["id"], "on")
    ready = rack.wait_state([m["mac"]], "ready", READY_TIMEOUT_S)
    times["power-on to ready (Secure Boot off, unsigned chain)"] = ready[m["mac"]] - t0
    mid = rack.machine_by_mac(m["mac"])["id"]
    st, state = rack.api("GET", f"/api/v1/machines/{mid}/secure-boot")
    assert st == 200 and state["current_boot"] is False, state

    tenant = rack.json("tenants", "create", "sb-tenant")["id"]
    image = rack.json("images", "create", "test-disk", *rack.publish_test_image(rack.workdir))
    claim = ["claims", "create", "--tenant", tenant, "--count", "1", "--image", image["id"],
             "--secure-boot"]  # fmt: skip
    rc, _ = rack.ctl(*claim, check=False)
    assert rc != 0  # nothing enforces Secure Boot yet: refused, nothing allocated

    # metald enrolls its certificate in db and enables Secure Boot through Redfish.
    st, out = rack.api("POST", f"/api/v1/machines/{mid}/secure-boot", {"enable": True, "enroll": True})  # fmt: skip
    assert st == 200, out
    assert out["enabled"] is True and out["current_boot"] is False, out

    # The next boot (a re-inspection through the BMC): the firmware refuses the unsigned iPXE.
    mark = serial.stat().st_size
    t1 = time.monotonic()
    rack.ctl("-y", "machines", "inspect", mid)  # the discovery image at the next boot
    rack.ctl("bmcs", "power", bmc["id"], "on")  # through the BMC: the firmware rereads its keys

    def after_mark() -> str:
        return serial.read_bytes()[mark:].decode(errors="replace")

    times["inspect to the firmware's refusal"] = _wait(
        "the firmware to refuse the unsigned iPXE",
        lambda: any(r in after_mark() for r in REFUSAL),
        REFUSED_TIMEOUT_S,
        rack,
    )
    del t1
    time.sleep(NEVER_S)  # the machine is given time to reach the agent, and must not
    seen = after_mark()
    assert "metald-agent" not in seen and "iPXE" not in seen, seen[-3000:]
    assert rack.json("machines", "show", mid)["state"] == "inspecting"
    st, state = rack.api("GET", f"/api/v1/machines/{mid}/secure-boot")
    assert state["enabled"] is True, state
    print(f"\nrefused: {[li for li in seen.splitlines() if any(r in li for r in REFUSAL)][:3]}")

    # metald's iPXE and discovery kernel signed with its key: the next power cycle boots the
    # signed chain to the agent and ready.
    assets = sb["assets"]
    signed = [assets / "snponly.efi", assets / "ipxe.efi", assets / "discovery" / "vmlinuz"]
    for f in signed:
        sign(f, sb["key"], sb["cert"])
        assert verify(f, sb["cert"])
    mark = serial.stat().st_size
    t2 = time.monotonic()
    rack.ctl("-y", "bmcs", "power", bmc["id"], "cycle")
    times["power cycle to ready (signed chain, Secure Boot enforced)"] = _wait(
        "ready through the signed chain",
        lambda: rack.json("machines", "show", mid)["state"] == "ready",
        READY_TIMEOUT_S,
        rack,
    )
    del t2
    seen = after_mark()
    assert "metald-agent" in seen and not any(r in seen for r in REFUSAL), seen[-3000:]
    st, state = rack.api("GET", f"/api/v1/machines/{mid}/secure-boot")
    assert (state["enabled"], state["current_boot"]) == (True, True), state
    cl = rack.json(*claim)
    assert [x["id"] for x in cl["machines"]] == [mid]
    print("\n".join(f"{what}: {s:.1f} s" for what, s in times.items()))
    print(f"load average: {os.getloadavg()}")
