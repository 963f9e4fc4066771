"""WireGuard keys: X25519, raw 32 bytes, standard base64 (the form `wg genkey`/`wg pubkey` use)."""

from __future__ import annotations

import base64
import binascii

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)


class BadKey(ValueError):
    pass


def _raw(key: str) -> bytes:
    try:
        raw = base64.b64decode(key.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise BadKey("a WireGuard key is 32 bytes in standard base64 (44 characters)") from None
    if len(raw) != 32:
        raise BadKey(f"a WireGuard key is 32 bytes; this one decodes to {len(raw)}")
    return raw


def generate_private_key() -> str:
    raw = X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return base64.b64encode(raw).decode()


def public_key(private_key: str) -> str:
    priv = X25519PrivateKey.from_private_bytes(_raw(private_key))
    return base64.b64encode(priv.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def validate_public_key(key: str) -> str:
    """The key in canonical form, or BadKey. Refuses the all-zero key."""
    raw = _raw(key)
    if raw == bytes(32):
        raise BadKey("the all-zero key is not a WireGuard public key")
    X25519PublicKey.from_public_bytes(raw)
    return base64.b64encode(raw).decode()


def to_hex(key: str) -> str:
    """The hex form WireGuard's control protocol (UAPI) uses."""
    return _raw(key).hex()


def from_hex(key: str) -> str:
    return base64.b64encode(bytes.fromhex(key)).decode()
