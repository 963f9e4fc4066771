"""TPM2 MakeCredential in software (TPM 2.0 Part 1 §24, "Credential Protection"; KDFa per
Part 1 §11.4.10.2): a secret wrapped so that only the TPM holding this EK, with an object of
this name loaded, can recover it (``TPM2_ActivateCredential``, ``tpm2_activatecredential``).
That binds the attestation key to the EK: the TPM checks the credential's HMAC over the AK's
name before it decrypts it.

Only an RSA EK is supported (the TCG default EK template L-1: RSA 2048, SHA-256 name, AES-128
CFB): the seed is encrypted with RSA-OAEP (SHA-256, label ``"IDENTITY\\0"``). swtpm_setup's
default EK and ``tpm2_createek -G rsa`` (what the agent makes) are this key. An ECC EK (ECDH +
KDFe) is refused with a sentence saying so.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
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
    """The EK cannot receive a credential (not an RSA key of a supported size)."""


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


def _tpm2b(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def make_credential(
    ek: rsa.RSAPublicKey, object_name: bytes, secret: bytes, *, seed: bytes | None = None
) -> Credential:
    """Wrap ``secret`` (at most 32 bytes) for the TPM holding ``ek`` and an object named
    ``object_name`` (the AK's name: nameAlg || digest of its TPMT_PUBLIC)."""
    if not isinstance(ek, rsa.RSAPublicKey):
        raise CredentialError(
            "the EK is not an RSA key: metald binds the attestation key only to an RSA EK "
            "(make it with tpm2_createek -G rsa)"
        )
    if ek.key_size < 2048:
        raise CredentialError("the EK is an RSA key under 2048 bits: not a TPM's EK")
    if not 1 <= len(secret) <= 32:
        raise CredentialError("a credential's secret is 1 to 32 bytes")
    seed = os.urandom(SEED_BYTES) if seed is None else seed
    encrypted = ek.encrypt(
        seed,
        padding.OAEP(
            mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=b"IDENTITY\0"
        ),
    )
    sym = kdfa(seed, b"STORAGE", object_name, b"", SYM_KEY_BITS)
    enc = Cipher(algorithms.AES(sym), CFB(b"\0" * 16)).encryptor()
    enc_identity = enc.update(_tpm2b(secret)) + enc.finalize()
    hmac_key = kdfa(seed, b"INTEGRITY", b"", b"", 256)
    integrity = hmac.new(hmac_key, enc_identity + object_name, hashlib.sha256).digest()
    return Credential(
        blob=_tpm2b(_tpm2b(integrity) + enc_identity), encrypted_seed=_tpm2b(encrypted)
    )
