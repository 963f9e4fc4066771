"""A lab machine with a TPM (``Lab(tpm=True)``): swtpm made as at the factory (an EK and its
certificate), recorded in the state file so ``down`` stops it, QEMU's ``tpm-tis`` on it, and
OVMF's 4 MB measured-boot build. The measured boots themselves are in the LONG lab tests
(tests/e2e/test_attestation_lab.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import lab_prerequisites
from .labtools import procs, qemu, qmp, vlab

pytestmark = pytest.mark.skipif(shutil.which("swtpm") is None, reason="needs swtpm")


def test_a_tpm_machine_has_swtpm_and_measured_boot_firmware(tmp_path: Path) -> None:
    reason = lab_prerequisites()
    if reason:
        pytest.skip(reason)
    lab = vlab.Lab(f"tpm{os.getpid() % 10000}", machines=2, uefi=1, workdir=tmp_path, tpm=True)
    state = lab.up()
    try:
        bios, uefi = state["machines"]
        assert bios["tpm"] is None  # a legacy-BIOS machine has none
        tpm = uefi["tpm"]
        assert Path(tpm["socket"]).exists()
        swtpm = [p for p in state["processes"] if p["role"] == "swtpm"]
        assert [p["machine"] for p in swtpm] == [uefi["name"]]
        # The TPM holds the EK certificate swtpm_setup made (the agent reads it from NV).
        assert (Path(tpm["state"]) / "tpm2-00.permall").stat().st_size > 0
        # QEMU has the TPM on the TIS interface, backed by that swtpm.
        (dev,) = asyncio.run(qmp(uefi, "query-tpm"))
        assert dev["model"] == "tpm-tis" and dev["options"]["type"] == "emulator", dev
        cmdline = Path(f"/proc/{next(p['pid'] for p in state['processes'] if p['role'] == 'qemu' and p['machine'] == uefi['name'])}/cmdline").read_bytes()  # fmt: skip
        assert str(qemu.OVMF_CODE_4M).encode() in cmdline
        assert Path(uefi["uefi_vars"]).stat().st_size == qemu.OVMF_VARS_4M.stat().st_size
        pid = swtpm[0]["pid"]
    finally:
        lab.down()
    assert not procs.is_running(pid)  # down stopped it
    assert subprocess.run(["pgrep", "-f", tpm["socket"]], capture_output=True).returncode == 1
