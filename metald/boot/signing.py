"""Boot images over plain HTTP, verified by iPXE: detached CMS signatures by a key metald's
boot CA certifies.

iPXE's software AES makes HTTPS expensive for the 28 MB of a kernel and initrd under slow
firmware or emulation (bench/BOOT.md: BIOS power-on -> ready 122 s over HTTPS, 36 s over
HTTP). With ``[boot] assets_http_listen``, metald's iPXE script (still fetched over HTTPS,
pinned to the boot CA: it carries the agent token) loads the kernel and initrd from a plain
HTTP listener and checks each with ``imgverify`` against a signature it fetches over the same
pinned HTTPS before it boots anything (metald.boot.ipxe). A changed byte on the plain path, or
an older signed file put in its place, fails the check: the signature comes from metald over
the authenticated channel and covers exactly the bytes metald serves now.

The signing key (``boot-sign.key``, 0600, RSA 2048) and its certificate (``boot-sign.pem``:
issued by the boot CA, key usage digitalSignature, extended key usage codeSigning, common name
``SIGNER_NAME``, 397 days, issued again like the listener's) live in the state folder next to
the CA (metald.boot.pki); iPXE trusts the certificate because the CA built into it issued it,
and its script names the signer (``imgverify --signer``). Only metald's own CA can do this
(``tls_auto``): with an operator's certificate metald holds no CA key.

A signature is CMS SignedData, DER, detached, without signed attributes (iPXE's cms.c checks
the signature over the content's digest itself), made when first asked for and kept per file
while its size, mtime and inode stay the same.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed
from cryptography.hazmat.primitives.serialization import pkcs7
from cryptography.x509.oid import ExtendedKeyUsageOID

from metald.boot import pki

log = logging.getLogger(__name__)

SIGN_CERT = "boot-sign.pem"
SIGN_KEY = "boot-sign.key"
#: The signer's common name; iPXE's ``imgverify --signer`` requires it (no spaces: the script
#: is split on them).
SIGNER_NAME = "metald-boot-image-signer"
_RENEW_BEFORE = dt.timedelta(days=30)
#: At most this many signatures are kept (kernel and initrd per architecture and image).
_CACHE_MAX = 64


@dataclass(frozen=True)
class Signer:
    cert: x509.Certificate
    key: rsa.RSAPrivateKey


def _current(path: Path, ca: x509.Certificate, now: dt.datetime) -> x509.Certificate | None:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (OSError, ValueError, TypeError, x509.InvalidSignature, x509.ExtensionNotFound):
        return None
    if ExtendedKeyUsageOID.CODE_SIGNING not in eku:
        return None
    if cert.not_valid_after_utc - _RENEW_BEFORE < now:
        return None
    return cert


def ensure_signer(state_dir: Path, *, now: dt.datetime | None = None) -> Signer:
    """The image-signing key and certificate in ``state_dir``, issued from the boot CA there
    (``pki.ensure_ca``: made on first call) when missing, from another CA or near their end."""
    state_dir = Path(state_dir)
    now = now or dt.datetime.now(dt.UTC)
    ca, ca_key_path = pki.ensure_ca(state_dir, now=now)
    cert_path, key_path = state_dir / SIGN_CERT, state_dir / SIGN_KEY
    cert = _current(cert_path, ca, now) if key_path.exists() else None
    if cert is None:
        ca_key = pki._load_key(ca_key_path)
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        cert = (
            pki.leaf_builder(ca, SIGNER_NAME, key, now)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        # Key first: a crash between the two leaves a key whose certificate is missing, which
        # the next start issues again.
        pki._write(key_path, pki._key_pem(key), 0o600)
        pki._write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        log.info("boot: issued the image-signing certificate %s from the boot CA", cert_path)
        return Signer(cert, key)
    return Signer(cert, pki._load_key(key_path))


def sign(signer: Signer, data: bytes) -> bytes:
    """A detached CMS signature of ``data`` (DER) that iPXE's ``imgverify`` accepts."""
    return (
        pkcs7.PKCS7SignatureBuilder()
        .set_data(data)
        .add_signer(signer.cert, signer.key, hashes.SHA256())
        .sign(
            serialization.Encoding.DER,
            [
                pkcs7.PKCS7Options.DetachedSignature,
                pkcs7.PKCS7Options.Binary,
                pkcs7.PKCS7Options.NoAttributes,
            ],
        )
    )


def sign_file(signer: Signer, path: Path) -> bytes:
    """``sign`` of a file's content, read in chunks (an initrd can be large; never all in
    memory). Without signed attributes the CMS structure does not depend on the content: only
    its signature value does (RSA PKCS#1 v1.5 over the content's SHA-256, deterministic, 256
    bytes for every content). So the structure is made once over no content and that value
    replaced by the one over this file's digest."""
    h = hashes.Hash(hashes.SHA256())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    template = sign(signer, b"")
    empty = signer.key.sign(b"", padding.PKCS1v15(), hashes.SHA256())
    if template.count(empty) != 1:  # cannot happen for RSA: a signature is not a DER header
        raise ValueError("the CMS template does not hold its signature exactly once")
    value = signer.key.sign(h.finalize(), padding.PKCS1v15(), Prehashed(hashes.SHA256()))
    assert len(value) == len(empty)
    return template.replace(empty, value)


class AssetSigner:
    """Signatures of files under the assets folder, made on first request and kept while a
    file's (inode, size, mtime) stays the same. A file replaced between signing and serving
    only makes iPXE refuse it: the signature is over the bytes read here."""

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self._cache: dict[Path, tuple[tuple[int, int, int, int], bytes]] = {}
        self._lock = asyncio.Lock()

    async def signature(self, path: Path) -> bytes:
        st = os.stat(path)
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        async with self._lock:  # one file hashed and signed at a time, not one per machine
            hit = self._cache.get(path)
            if hit is not None and hit[0] == stamp:
                return hit[1]
            sig = await asyncio.get_running_loop().run_in_executor(None, self._sign, path)
            if len(self._cache) >= _CACHE_MAX:
                self._cache.pop(next(iter(self._cache)))
            self._cache[path] = (stamp, sig)
            return sig

    def _sign(self, path: Path) -> bytes:
        return sign_file(self.signer, path)
