"""UEFI Secure Boot signing (bootassets/secureboot.py) with sbsigntool, and the lab proof with
OVMF's Secure Boot build and Debian's snakeoil db (ovmf): an unsigned iPXE is refused by the
firmware, the same iPXE signed with the db's key runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from bootassets.secureboot import SignError, new_key, sign, verify

IPXE_EFI = Path("/usr/lib/ipxe/snponly.efi")  # Debian's iPXE (unsigned)
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.snakeoil.fd")
SNAKEOIL = Path("/usr/share/ovmf/PkKek-1-snakeoil")
pytestmark = pytest.mark.skipif(
    shutil.which("sbsign") is None or not IPXE_EFI.exists(), reason="needs sbsigntool, ipxe"
)


def test_signed_verifies_with_its_certificate_only(tmp_path: Path) -> None:
    key, cert = new_key(tmp_path / "ours")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    efi = tmp_path / "ipxe.efi"
    shutil.copyfile(IPXE_EFI, efi)
    assert not verify(efi, cert)
    sign(efi, key, cert)
    assert verify(efi, cert)
    _other_key, other = new_key(tmp_path / "other")
    assert not verify(efi, other)
    # Signing again with another key replaces the signature (Debian's kernels come signed).
    sign(efi, _other_key, other)
    assert verify(efi, other) and not verify(efi, cert)


def test_a_file_that_is_not_pe_is_refused(tmp_path: Path) -> None:
    key, cert = new_key(tmp_path / "ours")
    junk = tmp_path / "junk.efi"
    junk.write_bytes(b"not a PE file" * 100)
    with pytest.raises(SignError):
        sign(junk, key, cert)
    assert junk.read_bytes() == b"not a PE file" * 100  # untouched


def _boot(tmp_path: Path, efi: Path, name: str, deadline_s: float = 120.0) -> str:
    """Boot OVMF (Secure Boot, snakeoil db) with ``efi`` as the removable-media loader of a
    FAT disk; the console until iPXE speaks or the firmware gives up on the disk."""
    esp = tmp_path / name / "esp"
    (esp / "EFI" / "BOOT").mkdir(parents=True)
    shutil.copyfile(efi, esp / "EFI" / "BOOT" / "BOOTX64.EFI")
    vars_copy = tmp_path / name / "vars.fd"
    shutil.copyfile(OVMF_VARS, vars_copy)
    console = tmp_path / name / "console.log"
    qemu = subprocess.Popen(
        ["qemu-system-x86_64", "-machine", "q35,smm=on", "-m", "256", "-nographic",
         "-global", "driver=cfi.pflash01,property=secure,value=on",
         "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
         "-drive", f"if=pflash,format=raw,unit=1,file={vars_copy}",
         "-drive", f"format=raw,file=fat:rw:{esp}", "-net", "none", "-no-reboot"],
        stdout=console.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and qemu.poll() is None:
            text = console.read_bytes().decode(errors="replace")
            if "iPXE" in text or "Access Denied" in text or "Security Violation" in text:
                break
            time.sleep(0.2)  # polling the console with a deadline (the VM's pace decides)
        return console.read_bytes().decode(errors="replace")
    finally:
        qemu.kill()
        qemu.wait(10)


@pytest.mark.skipif(
    not (OVMF_CODE.exists() and OVMF_VARS.exists() and SNAKEOIL.with_suffix(".key").exists()),
    reason="needs ovmf (Secure Boot build and snakeoil keys)",
)
@pytest.mark.skipif(
    os.environ.get("METALD_LAB_LONG") != "1",
    reason="two OVMF boots under TCG (~30 s): METALD_LAB_LONG=1",
)
def test_secure_boot_firmware_refuses_unsigned_ipxe_and_runs_signed(tmp_path: Path) -> None:
    unsigned = _boot(tmp_path, IPXE_EFI, "unsigned")
    assert "Access Denied" in unsigned or "Security Violation" in unsigned, unsigned[-2000:]
    assert "iPXE" not in unsigned

    # The db's key as Debian ships it is encrypted with the passphrase "snakeoil".
    key = serialization.load_pem_private_key(
        SNAKEOIL.with_suffix(".key").read_bytes(), password=b"snakeoil"
    )
    plain = tmp_path / "db.key"
    plain.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    signed = tmp_path / "signed.efi"
    shutil.copyfile(IPXE_EFI, signed)
    sign(signed, plain, SNAKEOIL.with_suffix(".pem"))
    out = _boot(tmp_path, signed, "signed")
    assert "iPXE" in out, out[-2000:]
