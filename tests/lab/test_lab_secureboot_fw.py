"""A Secure Boot lab machine (``Lab(secure_boot=True)``): what a Redfish client sets on its BMC
(a certificate in db, SecureBootEnable) reaches the firmware at the next power-on through the
BMC. QEMU is restarted on a variable store that holds the BMC's PK, KEK and db (read back with
virt-fw-vars) and OVMF's Secure Boot build with SMM; a power-on with nothing changed restarts
nothing. The boots themselves (an unsigned iPXE refused, the signed chain to ready through
metald) are the LONG lab test tests/e2e/test_secure_boot_lab.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bootassets.secureboot import new_key
from vmlab.secureboot_fw import virt_fw_vars

from .conftest import lab_prerequisites
from .labtools import qemu, redfish, system_path, vlab

pytestmark = pytest.mark.skipif(
    not Path(virt_fw_vars()).exists() or not qemu.OVMF_CODE_SECBOOT.exists(),
    reason="needs virt-firmware (pip) and ovmf",
)


def _qemu_pid(machine: dict) -> int:
    """The machine's QEMU: the one process whose command line names its BMC's QMP socket."""
    out = subprocess.run(
        ["pgrep", "-f", f"unix:{machine['qmp_bmc']},"], capture_output=True, text=True
    ).stdout.split()
    (pid,) = map(int, out)
    return pid


def _certs_in(vars_file: str, tmp: Path) -> str:
    copy = tmp / "vars-copy.fd"
    shutil.copyfile(vars_file, copy)
    r = subprocess.run(
        [virt_fw_vars(), "-i", str(copy), "-p", "-v"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_bmcs_secure_boot_state_reaches_the_firmware_at_power_on(tmp_path: Path) -> None:
    reason = lab_prerequisites()
    if reason:
        pytest.skip(reason)
    lab = vlab.Lab(f"sbf{os.getpid() % 10000}", machines=1, uefi=1, workdir=tmp_path / "lab",
                   secure_boot=True, cpus=1)  # fmt: skip
    state = lab.up()
    try:
        (m,) = state["machines"]
        cmdline = Path(f"/proc/{_qemu_pid(m)}/cmdline").read_bytes()
        assert str(qemu.OVMF_CODE_SECBOOT).encode() in cmdline and b"smm=on" in cmdline
        assert "vm-lab platform key" not in _certs_in(m["uefi_vars"], tmp_path)  # setup mode
        sb = system_path(m) + "/SecureBoot"
        _key, cert = new_key(tmp_path / "ours")
        st, _ = redfish(state, m, "POST", sb + "/SecureBootDatabases/db/Certificates",
                        {"CertificateString": cert.read_text(), "CertificateType": "PEM"})  # fmt: skip
        assert st == 201
        st, _ = redfish(state, m, "PATCH", sb, {"SecureBootEnable": True})
        assert st == 200
        # As metald boots a machine: a one-time network boot, then power on.
        st, _ = redfish(state, m, "PATCH", system_path(m), {"Boot": {
            "BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}})  # fmt: skip
        assert st == 200
        before = _qemu_pid(m)
        t0 = time.monotonic()
        st, _ = redfish(state, m, "POST", system_path(m) + "/Actions/ComputerSystem.Reset",
                        {"ResetType": "On"})  # fmt: skip
        assert st == 204
        restart_s = time.monotonic() - t0
        after = _qemu_pid(m)
        assert after != before  # a new QEMU, on the new variables
        st, body = redfish(state, m, "GET", sb)
        assert (body["SecureBootCurrentBoot"], body["SecureBootMode"]) == ("Enabled", "UserMode")
        st, body = redfish(state, m, "GET", system_path(m))
        assert body["PowerState"] == "On"
        printed = _certs_in(m["uefi_vars"], tmp_path)
        assert "vm-lab platform key" in printed and "metald" in printed.lower(), printed
        # Nothing changed since: the next power cycle keeps the same QEMU.
        st, _ = redfish(state, m, "POST", system_path(m) + "/Actions/ComputerSystem.Reset",
                        {"ResetType": "PowerCycle"})  # fmt: skip
        assert st == 204 and _qemu_pid(m) == after
        # Disabled again: restarted on a store without keys.
        assert redfish(state, m, "PATCH", sb, {"SecureBootEnable": False})[0] == 200
        redfish(state, m, "POST", system_path(m) + "/Actions/ComputerSystem.Reset",
                {"ResetType": "ForceRestart"})  # fmt: skip
        assert _qemu_pid(m) != after
        assert "vm-lab platform key" not in _certs_in(m["uefi_vars"], tmp_path)
        print(f"\npower-on with new Secure Boot variables (QEMU restarted): {restart_s:.2f} s")
    finally:
        lab.down()
