"""metald's own iPXE (bootassets/ipxe.py) for labs, tests and benchmarks.

The build is cached by its inputs, the CA among them, so the lab's CA is made once per machine
and kept in the boot-asset cache (``<cache>/lab-ca/``): every lab, test and benchmark then
shares one build instead of paying 9-15 minutes each (2 busy cores). The CA is one metald's
``[boot] tls_auto`` would make (RSA, ``metald.boot.pki``), so a tls_auto lab is seeded with it.
"""

from __future__ import annotations

import datetime
import os
import shutil
from pathlib import Path

from bootassets import build
from bootassets.ipxe import ensure_ipxe_built, install


def lab_ca(cache_dir: Path | str | None = None) -> Path:
    """The lab's CA certificate (PEM), made once: ``<cache>/lab-ca/boot-ca.pem`` (its key
    ``boot-ca.key`` beside it, 0600). It is a CA as metald's ``[boot] tls_auto`` makes one
    (``metald.boot.pki``, RSA), so a lab running metald with tls_auto starts from a copy of it
    (``seed_state``) and the machines boot the one cached iPXE build. Labs only: a production
    metald's CA is its own."""
    from metald.boot import pki

    folder = Path(cache_dir or os.environ.get("BOOTASSETS_CACHE") or build.DEFAULT_CACHE)
    folder = folder / "lab-ca"
    cert_path = folder / pki.CA_CERT
    if not cert_path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with build._locked(folder):  # two labs starting at once make one CA
            pki.ensure_ca(folder)
    return cert_path


def seed_state(state_dir: Path, cache_dir: Path | str | None = None) -> Path:
    """Copy the lab's CA (certificate and key) into a metald state folder before its first
    start, as an operator copies a fleet's CA into each instance's (docs/boot.md): metald's
    ``[boot] tls_auto`` then issues its listener certificate from it, and the lab's iPXE build
    trusts that listener."""
    from metald.boot import pki

    ca = lab_ca(cache_dir)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copyfile(ca, state_dir / pki.CA_CERT)
    key = state_dir / pki.CA_KEY
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write((ca.parent / pki.CA_KEY).read_bytes())
    return state_dir


def server_cert(
    into: Path, address: str, *, cache_dir: Path | str | None = None, foreign: bool = False
) -> tuple[Path, Path]:
    """A TLS certificate and key for ``address`` (an IP), signed by the lab's CA, or with
    ``foreign`` by a CA of its own that nothing trusts (a man in the middle's), as
    ``into/server.pem`` and ``into/server.key``."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_pem = lab_ca(cache_dir)
    ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
    if foreign:  # another key under the same name: a man in the middle copies the name
        ca_key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
        ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ca_name = ca_cert.subject
    else:
        loaded = serialization.load_pem_private_key(
            (ca_pem.parent / "boot-ca.key").read_bytes(), None
        )
        assert isinstance(loaded, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey)
        ca_key, ca_name = loaded, ca_cert.subject
    # RSA, as metald's own listener certificate (metald.boot.pki): what every iPXE verifies
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    into.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = into / "server.pem", into / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


def built_ipxe(cache_dir: Path | str | None = None) -> Path:
    """The lab's iPXE build (built on first use, 9-15 minutes on 2 busy cores; cached)."""
    return ensure_ipxe_built(cache_dir, ca=lab_ca(cache_dir))


def assets_with_built_ipxe(src: Path, into: Path, cache_dir: Path | str | None = None) -> Path:
    """A copy of the assets folder ``src`` (hard links where the file system allows) with the
    lab's iPXE build installed in ``into/ipxe/``: metald then hands that iPXE out
    (``[boot] ipxe = "auto"``)."""
    into.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if rel.parts[0] == "ipxe" or any(part.startswith(".") for part in rel.parts):
            continue
        dest = into / rel
        if p.is_dir():
            dest.mkdir(exist_ok=True)
        elif p.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, dest)
            except OSError:
                shutil.copyfile(p, dest)
    install(built_ipxe(cache_dir), into)
    return into
