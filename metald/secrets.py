"""Encryption at rest for secrets metald must store (BMC passwords, tenant keys).

A Fernet key (AES-128-CBC + HMAC-SHA256, from ``cryptography``) lives in a file created 0600 on
first start. Losing the file makes stored secrets unreadable, so it belongs in backups of the
state folder; it must never be logged.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF


class SecretError(Exception):
    pass


class SecretBox:
    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)
        self._key = key

    @classmethod
    def from_file(cls, path: Path) -> SecretBox:
        """Load the key, creating it (mode 0600) if it does not exist."""
        path = Path(path)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(Fernet.generate_key())
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise SecretError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
        return cls(path.read_bytes().strip())

    def encrypt(self, plaintext: str | bytes) -> bytes:
        data = plaintext.encode() if isinstance(plaintext, str) else plaintext
        return self._fernet.encrypt(data)

    def decrypt(self, token: bytes) -> str:
        try:
            return self._fernet.decrypt(token).decode()
        except InvalidToken:
            raise SecretError("stored secret cannot be decrypted with this key file") from None

    def derive_key(self, purpose: str) -> bytes:
        """A 32-byte key for ``purpose`` (HKDF-SHA256 of the secrets key): every instance that
        shares the key file derives the same one, and it reveals nothing of the key or of any
        other purpose's key. Used for what instances prove to each other
        (``metald.fleet.forward_auth``)."""
        return HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"metald/" + purpose.encode()
        ).derive(self._key)

    def __repr__(self) -> str:  # never show key material
        return "SecretBox(<redacted>)"
