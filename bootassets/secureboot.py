"""UEFI Secure Boot signing of the EFI binaries metald serves (its iPXE, the boot kernels):
metald's own signing key, or an operator's, and ``sbsign`` (Debian's ``sbsigntool``).

``python -m bootassets sign --key KEY --cert CERT FILE...`` signs each PE/COFF file in place
(Authenticode, SHA-256) and checks the signature with ``sbverify``; ``--new-key DIR`` makes a
signing key and certificate first (RSA 2048, self-signed: the certificate to enroll in the
firmware's ``db``, by Redfish ``SecureBootDatabases`` or ``efitools``). docs/attestation.md.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID


class SignError(Exception):
    """A binary could not be signed or its signature does not verify."""


def new_key(into: Path, common_name: str = "metald Secure Boot signing key") -> tuple[Path, Path]:
    """A signing key (0600) and its self-signed certificate (PEM) in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.ObjectIdentifier("1.3.6.1.5.5.7.3.3")]),  # codeSigning
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = into / "db.key", into / "db.crt"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SignError(f"{name} is not installed (Debian: apt-get install sbsigntool)")
    return path


def sign(path: Path, key: Path, cert: Path) -> None:
    """Sign the PE/COFF binary at ``path`` in place, then verify it against ``cert``. An
    existing signature (Debian signs its kernels) is replaced: the firmware trusts ``cert``."""
    with tempfile.TemporaryDirectory() as tmp:
        unsigned, signed = Path(tmp) / "in.efi", Path(tmp) / "out.efi"
        shutil.copyfile(path, unsigned)
        # sbattach --remove fails on an unsigned binary: that is fine, there is none to drop.
        subprocess.run(
            [_tool("sbattach"), "--remove", str(unsigned)], capture_output=True, check=False
        )
        done = subprocess.run(
            [_tool("sbsign"), "--key", str(key), "--cert", str(cert), "--output", str(signed),
             str(unsigned)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SignError(f"sbsign {path}: {done.stderr.strip() or done.stdout.strip()}")
        if not verify(signed, cert):
            raise SignError(f"{path}: the signature sbsign made does not verify")
        shutil.copyfile(signed, path)


def verify(path: Path, cert: Path) -> bool:
    """Whether ``path`` carries a valid signature by ``cert``."""
    done = subprocess.run(
        [_tool("sbverify"), "--cert", str(cert), str(path)], capture_output=True, check=False
    )
    return done.returncode == 0
