"""Keys made here are the keys `wg` makes: same encoding, same public key derivation."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from metald.tenants import keys

pytestmark = pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools missing")


def wg(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        ["wg", *args], input=stdin, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_our_private_key_gives_wg_pubkey() -> None:
    priv = keys.generate_private_key()
    assert keys.public_key(priv) == wg("pubkey", stdin=priv + "\n")


def test_wg_genkey_gives_our_public_key() -> None:
    priv = wg("genkey")
    assert keys.public_key(priv) == wg("pubkey", stdin=priv + "\n")


@pytest.mark.parametrize(
    "bad", ["", "not base64!", "AAAA", "A" * 43 + "=", "A" * 44, "=" * 44, "a" * 60]
)
def test_bad_public_keys_refused(bad: str) -> None:
    with pytest.raises(keys.BadKey):
        keys.validate_public_key(bad)


def test_hex_round_trip() -> None:
    pub = keys.public_key(keys.generate_private_key())
    assert keys.from_hex(keys.to_hex(pub)) == pub
