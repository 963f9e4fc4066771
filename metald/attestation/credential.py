"""TPM2 MakeCredential in software (TPM 2.0 Part 1 §24, "Credential Protection"; KDFa per
Part 1 §11.4.10.2, KDFe per §11.4.10.3): a secret wrapped so that only the TPM holding this
EK, with an object of this name loaded, can recover it (``TPM2_ActivateCredential``,
``tpm2_activatecredential``). That binds the attestation key to the EK: the TPM checks the
credential's HMAC over the AK's name before it decrypts it.

The seed that keys the credential reaches the TPM one of two ways, by the EK's type:

- **RSA EK** (the TCG default EK template L-1: RSA 2048, SHA-256 name, AES-128 CFB; swtpm's
  default EK, ``tpm2_createek -G rsa``): the seed is encrypted with RSA-OAEP (SHA-256, label
  ``"IDENTITY\\0"``).
- **ECC EK** (template L-2: NIST P-256, SHA-256 name, AES-128 CFB; ``tpm2_createek -G ecc``):
  one-pass ECDH (Part 1 Annex C.6.4). An ephemeral P-256 key is made; the seed is
  KDFe(SHA-256, Z, ``"IDENTITY\\0"``, the ephemeral key's x, the EK's x), Z being the x
  coordinate of the shared point; the TPM receives the ephemeral public point
  (TPMS_ECC_POINT) and derives the same seed with the EK's private key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

try:  # CFB moved in cryptography 47
    from cryptography.hazmat.decrepit.ciphers.modes import CFB
except ImportError:  # pragma: no cover
    from cryptography.hazmat.primitives.ciphers.modes import CFB  # type: ignore[assignment]

#: tpm2-tools' credential file (tpm2_makecredential -o, tpm2_activatecredential -i): magic,
#: version, then TPM2B_ID_OBJECT and TPM2B_ENCRYPTED_SECRET.
FILE_MAGIC = 0xBADCC0DE
FILE_VERSION = 1
SEED_BYTES = 32  # the EK's nameAlg (SHA-256) digest size
SYM_KEY_BITS = 128  # the EK template's AES-128


class CredentialError(ValueError):
    """The EK cannot receive a credential (not an RSA 2048+ or NIST P-256 key)."""


@dataclass(frozen=True)
class Credential:
    #: TPM2B_ID_OBJECT: integrity HMAC and the encrypted secret.
    blob: bytes
    #: TPM2B_ENCRYPTED_SECRET: the seed, encrypted to the EK.
    encrypted_seed: bytes

    def tpm2_tools_file(self) -> bytes:
        """The bytes ``tpm2_activatecredential -i`` reads."""
        return struct.pack(">II", FILE_MAGIC, FILE_VERSION) + self.blob + self.encrypted_seed


def kdfa(key: bytes, label: bytes, context_u: bytes, context_v: bytes, bits: int) -> bytes:
    """KDFa with HMAC-SHA-256 (Part 1 §11.4.10.2): counter mode, the label NUL-terminated."""
    out = b""
    counter = 0
    while len(out) * 8 < bits:
        counter += 1
        out += hmac.new(
            key,
            struct.pack(">I", counter)
            + label
            + b"\0"
            + context_u
            + context_v
            + struct.pack(">I", bits),
            hashlib.sha256,
        ).digest()
    return out[: (bits + 7) // 8]


def kdfe(z: bytes, label: bytes, party_u: bytes, party_v: bytes, bits: int) -> bytes:
    """KDFe with SHA-256 (Part 1 §11.4.10.3): hash of counter, Z, the NUL-terminated label,
    then the two parties' x coordinates, per block."""
    out = b""
    counter = 0
    while len(out) * 8 < bits:
        counter += 1
        out += hashlib.sha256(
            struct.pack(">I", counter) + z + label + b"\0" + party_u + party_v
        ).digest()
    return out[: (bits + 7) // 8]


def _ecc_seed(ek: ec.EllipticCurvePublicKey) -> tuple[bytes, bytes]:
    """A fresh seed shared with the EK by one-pass ECDH: (seed, TPM2B_ENCRYPTED_SECRET body:
    the ephemeral TPMS_ECC_POINT)."""
    size = (ek.curve.key_size + 7) // 8
    ephemeral = ec.generate_private_key(ek.curve)
    z = ephemeral.exchange(ec.ECDH(), ek)  # the shared point's x coordinate, ``size`` bytes
    point = ephemeral.public_key().public_numbers()
    qe_x, qe_y = point.x.to_bytes(size, "big"), point.y.to_bytes(size, "big")
    ek_x = ek.public_numbers().x.to_bytes(size, "big")
    seed = kdfe(z, b"IDENTITY", qe_x, ek_x, SEED_BYTES * 8)
    return seed, _tpm2b(qe_x) + _tpm2b(qe_y)


def _tpm2b(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def make_credential(
    ek: rsa.RSAPublicKey | ec.EllipticCurvePublicKey,
    object_name: bytes,
    secret: bytes,
    *,
    seed: bytes | None = None,
) -> Credential:
    """Wrap ``secret`` (at most 32 bytes) for the TPM holding ``ek`` and an object named
    ``object_name`` (the AK's name: nameAlg || digest of its TPMT_PUBLIC). ``seed`` (RSA
    only) fixes the seed, for tests; an ECC seed comes from a fresh ephemeral key."""
    if not 1 <= len(secret) <= 32:
        raise CredentialError("a credential's secret is 1 to 32 bytes")
    if isinstance(ek, ec.EllipticCurvePublicKey):
        if not isinstance(ek.curve, ec.SECP256R1):
            raise CredentialError(
                f"the EK is an ECC key on {ek.curve.name}: metald binds the attestation key "
                "to an RSA 2048 or NIST P-256 EK (the TCG default templates)"
            )
        seed, encrypted = _ecc_seed(ek)
    elif isinstance(ek, rsa.RSAPublicKey):
        if ek.key_size < 2048:
            raise CredentialError("the EK is an RSA key under 2048 bits: not a TPM's EK")
        seed = os.urandom(SEED_BYTES) if seed is None else seed
        encrypted = ek.encrypt(
            seed,
            padding.OAEP(
                mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=b"IDENTITY\0"
            ),
        )
    else:
        raise CredentialError(
            "the EK is neither an RSA nor an ECC key: metald binds the attestation key only "
            "to a TPM's EK (tpm2_createek -G rsa or -G ecc)"
        )
    sym = kdfa(seed, b"STORAGE", object_name, b"", SYM_KEY_BITS)
    enc = Cipher(algorithms.AES(sym), CFB(b"\0" * 16)).encryptor()
    enc_identity = enc.update(_tpm2b(secret)) + enc.finalize()
    hmac_key = kdfa(seed, b"INTEGRITY", b"", b"", 256)
    integrity = hmac.new(hmac_key, enc_identity + object_name, hashlib.sha256).digest()
    return Credential(
        blob=_tpm2b(_tpm2b(integrity) + enc_identity), encrypted_seed=_tpm2b(encrypted)
    )
