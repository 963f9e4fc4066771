"""TPM 2.0 structures for quotes (TPM 2.0 Library, Part 2): parsed from the bytes tpm2-tools
writes (``tpm2_createak -f tpmt``, ``tpm2_quote -m/-s``) and checked with ``cryptography``.

Pure: bytes in, values or ``TpmFormatError`` out. Only what a quote needs is parsed; anything
else is refused rather than guessed at.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

TPM_GENERATED_VALUE = 0xFF544347
TPM_ST_ATTEST_QUOTE = 0x8018

ALG_RSA = 0x0001
ALG_SHA1 = 0x0004
ALG_SHA256 = 0x000B
ALG_SHA384 = 0x000C
ALG_SHA512 = 0x000D
ALG_NULL = 0x0010
ALG_RSASSA = 0x0014
ALG_RSAPSS = 0x0016
ALG_ECDSA = 0x0018
ALG_ECC = 0x0023

#: TPM hash algorithm id -> (hashlib name, cryptography hash class).
HASHES: dict[int, tuple[str, type[hashes.HashAlgorithm]]] = {
    ALG_SHA1: ("sha1", hashes.SHA1),
    ALG_SHA256: ("sha256", hashes.SHA256),
    ALG_SHA384: ("sha384", hashes.SHA384),
    ALG_SHA512: ("sha512", hashes.SHA512),
}
HASH_IDS = {name: alg for alg, (name, _) in HASHES.items()}
_CURVES: dict[int, ec.EllipticCurve] = {
    0x0003: ec.SECP256R1(),
    0x0004: ec.SECP384R1(),
    0x0005: ec.SECP521R1(),
}

# TPMA_OBJECT bits an attestation key must have: the TPM made it and never lets it out
# (fixedTPM, fixedParent, sensitiveDataOrigin), and it is a restricted signing key, so the TPM
# refuses to sign outside data that starts with TPM_GENERATED_VALUE: a quote cannot be forged
# by asking the key to sign arbitrary bytes.
FIXED_TPM = 1 << 1
FIXED_PARENT = 1 << 4
SENSITIVE_DATA_ORIGIN = 1 << 5
RESTRICTED = 1 << 16
SIGN = 1 << 18
AK_ATTRIBUTES = FIXED_TPM | FIXED_PARENT | SENSITIVE_DATA_ORIGIN | RESTRICTED | SIGN


class TpmFormatError(ValueError):
    """The bytes are not the TPM structure they claim to be."""


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise TpmFormatError(f"structure ends early (wanted {n} bytes at {self.pos})")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack(">H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack(">Q", self.take(8))[0])

    def sized(self) -> bytes:  # a TPM2B_*: UINT16 size, then the bytes
        return self.take(self.u16())

    def end(self, what: str) -> None:
        if self.pos != len(self.data):
            raise TpmFormatError(f"{len(self.data) - self.pos} bytes after the {what}")


@dataclass(frozen=True)
class PublicKey:
    """A TPMT_PUBLIC: the attestation key as the TPM describes it."""

    raw: bytes
    type: int
    name_alg: int
    attributes: int
    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey

    @property
    def name(self) -> bytes:
        """The TPM name of the key: nameAlg || H_nameAlg(TPMT_PUBLIC)."""
        return (
            struct.pack(">H", self.name_alg)
            + hashlib.new(HASHES[self.name_alg][0], self.raw).digest()
        )

    @property
    def is_attestation_key(self) -> bool:
        return self.attributes & AK_ATTRIBUTES == AK_ATTRIBUTES


def parse_public(data: bytes) -> PublicKey:
    """A TPMT_PUBLIC (``tpm2_createak -f tpmt``), or a TPM2B_PUBLIC around one."""
    if len(data) >= 2 and struct.unpack(">H", data[:2])[0] == len(data) - 2:
        data = data[2:]
    r = _Reader(data)
    kind, name_alg, attributes = r.u16(), r.u16(), r.u32()
    if name_alg not in HASHES:
        raise TpmFormatError(f"unknown name algorithm 0x{name_alg:04x}")
    r.sized()  # authPolicy
    if r.u16() != ALG_NULL:  # symmetric: a signing key has none
        r.u16()
        r.u16()
    scheme = r.u16()
    if scheme != ALG_NULL:
        r.u16()
    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey
    if kind == ALG_RSA:
        bits, exponent = r.u16(), r.u32()
        modulus = r.sized()
        if len(modulus) * 8 != bits:
            raise TpmFormatError("RSA modulus does not match its key size")
        key = rsa.RSAPublicNumbers(exponent or 65537, int.from_bytes(modulus, "big")).public_key()
    elif kind == ALG_ECC:
        curve_id = r.u16()
        if r.u16() != ALG_NULL:  # kdf
            r.u16()
        x, y = r.sized(), r.sized()
        curve = _CURVES.get(curve_id)
        if curve is None:
            raise TpmFormatError(f"unsupported ECC curve 0x{curve_id:04x}")
        try:
            key = ec.EllipticCurvePublicNumbers(
                int.from_bytes(x, "big"), int.from_bytes(y, "big"), curve
            ).public_key()
        except ValueError as e:
            raise TpmFormatError(f"ECC point is not on its curve: {e}") from None
    else:
        raise TpmFormatError(f"unsupported key type 0x{kind:04x}")
    r.end("TPMT_PUBLIC")
    return PublicKey(bytes(data), kind, name_alg, attributes, key)


@dataclass(frozen=True)
class PcrSelection:
    hash_alg: int
    pcrs: tuple[int, ...]


@dataclass(frozen=True)
class Quote:
    """A TPMS_ATTEST of type quote: what the TPM signed."""

    raw: bytes
    signer: bytes
    extra_data: bytes  # the nonce
    clock: int
    reset_count: int
    restart_count: int
    safe: bool
    firmware_version: int
    selections: tuple[PcrSelection, ...]
    pcr_digest: bytes


def parse_quote(data: bytes) -> Quote:
    """A TPMS_ATTEST (``tpm2_quote -m``); refuses anything that is not a TPM-made quote."""
    r = _Reader(data)
    if r.u32() != TPM_GENERATED_VALUE:
        raise TpmFormatError("not a TPM-generated structure (magic)")
    if r.u16() != TPM_ST_ATTEST_QUOTE:
        raise TpmFormatError("not a quote (attestation type)")
    signer, extra = r.sized(), r.sized()
    clock, resets, restarts, safe = r.u64(), r.u32(), r.u32(), r.u8()
    firmware = r.u64()
    selections = []
    for _ in range(r.u32()):
        alg, size = r.u16(), r.u8()
        bitmap = r.take(size)
        pcrs = tuple(i for i in range(size * 8) if bitmap[i // 8] >> (i % 8) & 1)
        selections.append(PcrSelection(alg, pcrs))
    digest = r.sized()
    r.end("TPMS_ATTEST")
    return Quote(
        bytes(data),
        signer,
        extra,
        clock,
        resets,
        restarts,
        bool(safe),
        firmware,
        tuple(selections),
        digest,
    )


def verify_signature(key: PublicKey, message: bytes, signature: bytes) -> bool:
    """Pure: whether ``signature`` (a TPMT_SIGNATURE, ``tpm2_quote -s``) over ``message`` was
    made by ``key``. Malformed signatures are False, never an exception."""
    try:
        r = _Reader(signature)
        sig_alg, hash_alg = r.u16(), r.u16()
        if hash_alg not in HASHES:
            return False
        h = HASHES[hash_alg][1]()
        if sig_alg == ALG_ECDSA and isinstance(key.key, ec.EllipticCurvePublicKey):
            rr, ss = r.sized(), r.sized()
            r.end("TPMT_SIGNATURE")
            der = encode_dss_signature(int.from_bytes(rr, "big"), int.from_bytes(ss, "big"))
            key.key.verify(der, message, ec.ECDSA(h))
            return True
        if sig_alg in (ALG_RSASSA, ALG_RSAPSS) and isinstance(key.key, rsa.RSAPublicKey):
            sig = r.sized()
            r.end("TPMT_SIGNATURE")
            pad: padding.AsymmetricPadding = (
                padding.PKCS1v15()
                if sig_alg == ALG_RSASSA
                else padding.PSS(padding.MGF1(h), padding.PSS.AUTO)
            )
            key.key.verify(sig, message, pad, h)
            return True
    except (TpmFormatError, InvalidSignature, ValueError):
        return False
    return False


def pcr_composite_digest(hash_alg: int, values: list[bytes]) -> bytes:
    """The quote's pcrDigest over ``values`` (in selection order)."""
    return hashlib.new(HASHES[hash_alg][0], b"".join(values)).digest()
