"""metald's own boot CA: HTTPS on the provisioning listener without an operator's PKI.

With ``[boot] tls_auto = true`` and no ``[boot] tls_cert``, metald makes a CA once in the state
folder (``boot-ca.pem``, its key ``boot-ca.key`` 0600) and issues the provisioning listener's
certificate from it (``boot-tls.pem``, ``boot-tls.key`` 0600) for ``boot.server_address``. The
CA is what metald's iPXE is built with (``python -m bootassets ipxe --ca <state>/boot-ca.pem``)
and what the agents pin by its SHA-256 fingerprint (``metald.ca=sha256:<hex>`` on their kernel
command line). The listener certificate is issued again when the server address changes, the
CA changes, or it is within 30 days of expiring; the CA itself is never replaced (every iPXE
built with it would stop trusting metald). Instances of one fleet must share these files like
they share ``secrets.key``. Each file is written to a temporary name and renamed into place,
so a crash never leaves half a key.

RSA keys (2048-bit listener, 3072-bit CA): iPXE's TLS verifies RSA signatures.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from metald.config import Config

CA_CERT = "boot-ca.pem"
CA_KEY = "boot-ca.key"
TLS_CERT = "boot-tls.pem"
TLS_KEY = "boot-tls.key"
#: Private files among them (mode 0600; metald.daemon.STATE_FILES narrows them at start).
PRIVATE_FILES = (CA_KEY, TLS_KEY, "boot-sign.key")

log = logging.getLogger(__name__)

_CA_YEARS = 20
_LEAF_DAYS = 397
_RENEW_BEFORE = dt.timedelta(days=30)


class PkiError(Exception):
    pass


@dataclass(frozen=True)
class BootTls:
    """What the provisioning listener serves with, and the CA agents pin."""

    cert: Path
    key: Path
    ca_pem: bytes

    @property
    def fingerprint(self) -> str:
        return ca_fingerprint(self.ca_pem)


def ca_fingerprint(pem: bytes) -> str:
    """``sha256:<hex>`` of the first certificate's DER in ``pem``: what ``metald.ca=`` carries
    and what ``openssl x509 -fingerprint -sha256`` prints (without the colons)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise PkiError(f"not a PEM certificate: {e}") from None
    der = cert.public_bytes(serialization.Encoding.DER)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(path: Path) -> rsa.RSAPrivateKey:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PkiError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise PkiError(f"{path} is not an RSA key")
    return key


def ensure_ca(state_dir: Path, *, now: dt.datetime | None = None) -> tuple[x509.Certificate, Path]:
    """The boot CA in ``state_dir``, made on first call. Returns the certificate and its key's
    path. A key without its certificate (or the reverse) is an error, not a reason to make a
    new CA: machines built with the old one would stop trusting metald."""
    state_dir = Path(state_dir)
    cert_path, key_path = state_dir / CA_CERT, state_dir / CA_KEY
    if cert_path.exists() != key_path.exists():
        have, lacks = (cert_path, key_path) if cert_path.exists() else (key_path, cert_path)
        raise PkiError(
            f"{have} is there but {lacks} is not: restore it from the backup of the state "
            f"folder, or remove both to make a new boot CA (then rebuild metald's iPXE with it)"
        )
    if not cert_path.exists():
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        now = now or dt.datetime.now(dt.UTC)
        key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "metald"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"metald boot CA {now:%Y-%m-%d}"),
            ]
        )
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=365 * _CA_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        # The key first: a crash between the two leaves a key without a certificate, which the
        # next start reports rather than silently making a second CA.
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _load_key(key_path)  # mode check
    return x509.load_pem_x509_certificate(cert_path.read_bytes()), key_path


def _san_for(address: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        return x509.DNSName(address)


def _leaf_ok(path: Path, ca: x509.Certificate, san: x509.GeneralName, now: dt.datetime) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return False
    if cert.issuer != ca.subject or cert.not_valid_after_utc - _RENEW_BEFORE < now:
        return False
    try:
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, x509.InvalidSignature, x509.ExtensionNotFound):
        return False
    return san in names


def leaf_builder(
    ca: x509.Certificate, common_name: str, key: rsa.RSAPrivateKey, now: dt.datetime
) -> x509.CertificateBuilder:
    """An end-entity certificate under the boot CA, before its purpose's extensions: named
    ``common_name``, for ``key``, valid from an hour ago for the leaf lifetime, not a CA."""
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=_LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )


def ensure_boot_tls(
    state_dir: Path, server_address: str, *, now: dt.datetime | None = None
) -> BootTls:
    """The boot CA and a listener certificate from it for ``server_address`` (an IP address or
    a DNS name), issuing the certificate when missing, for another address, from another CA or
    near its end."""
    state_dir = Path(state_dir)
    if not server_address:
        raise PkiError("boot.server_address is empty: the listener certificate names it")
    now = now or dt.datetime.now(dt.UTC)
    ca, ca_key_path = ensure_ca(state_dir, now=now)
    cert_path, key_path = state_dir / TLS_CERT, state_dir / TLS_KEY
    san = _san_for(server_address)
    if not (key_path.exists() and _leaf_ok(cert_path, ca, san, now)):
        ca_key = _load_key(ca_key_path)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        cert = (
            leaf_builder(ca, server_address, key, now)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    else:
        _load_key(key_path)  # mode check
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    return BootTls(cert=cert_path, key=key_path, ca_pem=ca_pem)


def operator_tls(cert: str, key: str, ca: str) -> BootTls:
    """The operator's listener certificate; ``ca`` is the PEM of the root it chains to (what
    the agents pin), or empty to take the chain's last certificate."""
    if ca:
        ca_pem = Path(ca).read_bytes()
    else:
        chain = x509.load_pem_x509_certificates(Path(cert).read_bytes())
        ca_pem = chain[-1].public_bytes(serialization.Encoding.PEM)
        if chain[-1].issuer != chain[-1].subject:
            log.warning(
                "%s does not end with the root CA it chains to (its last certificate is issued "
                "by %s): agents pin that last certificate and cannot verify the listener "
                "against it; set boot.tls_ca to the root's PEM",
                cert,
                chain[-1].issuer.rfc4514_string(),
            )
    ca_fingerprint(ca_pem)  # a PkiError now rather than a bad pin later
    return BootTls(cert=Path(cert), key=Path(key), ca_pem=ca_pem)


def _same_certificate(a: Path, b: Path) -> bool:
    try:
        return ca_fingerprint(a.read_bytes()) == ca_fingerprint(b.read_bytes())
    except (OSError, PkiError):
        return False


def resolve_tls_auto(cfg: Config) -> tuple[Config, str | None]:
    """``boot.tls_auto`` resolved when unset: on when the provisioning listener has no
    operator certificate and metald's own iPXE, built with this state folder's CA (its
    ``ipxe/ca.pem`` is ``boot-ca.pem``), is installed for BIOS, x86-64 and arm64 UEFI; a
    machine on Debian's iPXE, or on a build trusting another CA, could not fetch its script
    from a listener with metald's CA. Returns the config with it set, and when it stays off
    for want of that iPXE, the sentence saying why (None when on, set, or not applicable)."""
    from metald.boot.plane import BUILT_IPXE_DIR, choose_boot_files

    b = cfg.boot
    if b.tls_auto is not None:
        return cfg, None
    on, why = False, None
    if b.enabled and b.http_listen and not b.tls_cert and b.ipxe != "debian" and b.assets_dir:
        built_ca = Path(b.assets_dir) / BUILT_IPXE_DIR / "ca.pem"
        ours = Path(cfg.state_dir) / CA_CERT
        try:
            _, reasons = choose_boot_files(cfg)
        except Exception:  # boot.ipxe = "built" without a build: the boot plane says so
            reasons = ["metald's iPXE is not installed"]
        if reasons:
            why = (
                "boot.tls_auto stays off (plain HTTP on the provisioning listener, tokens in "
                "clear): metald's own iPXE is not installed for every architecture; build it with "
                f"python -m bootassets ipxe --ca {ours} --install {b.assets_dir} (docs/boot.md)"
            )
        elif not ours.exists() or not _same_certificate(built_ca, ours):
            why = (
                f"boot.tls_auto stays off (plain HTTP on the provisioning listener, tokens in "
                f"clear): the iPXE in {built_ca.parent} trusts {built_ca}, not this metald's CA "
                f"{ours}{'' if ours.exists() else ' (not made yet: metald boot-ca makes it)'}; "
                f"rebuild it with python -m bootassets ipxe --ca {ours} --install {b.assets_dir}"
            )
        else:
            on = True
    boot = b.model_copy(update={"tls_auto": on})
    return cfg.model_copy(update={"boot": boot}), why


def machines_tls(cfg: Config) -> BootTls | None:
    """The certificate of the listener machines use, and the CA they pin: metald's own
    (boot.tls_auto, made or renewed here), the operator's (boot.tls_cert, else api.tls_cert
    when one listener serves everything), or None over plain HTTP."""
    b = cfg.boot
    if b.http_listen:
        if b.tls_auto:
            return ensure_boot_tls(Path(cfg.state_dir), str(b.server_address or ""))
        if b.tls_cert:
            return operator_tls(b.tls_cert, b.tls_key, b.tls_ca)
        return None
    if cfg.api.tls_cert:
        return operator_tls(cfg.api.tls_cert, cfg.api.tls_key, "")
    return None
