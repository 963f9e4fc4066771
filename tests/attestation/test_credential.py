"""Credential activation (metald.attestation.credential) against real TPMs: two swtpm with
tpm2-tools. A credential metald makes for TPM A's EK over A's AK name is activated by A (the
secret comes back); one made for TPM B's EK, or over a fabricated AK name, is refused by the
TPM. Fails on the old code (no MakeCredential in metald)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from metald.attestation.credential import make_credential
from tests.attestation import test_agent_attest as agent_test

pytestmark = agent_test.pytestmark
EK, AK = "0x81010001", "0x81010002"


@contextmanager
def _swtpm(tmp_path: Path) -> Iterator[str]:
    tmp_path.mkdir()
    gen = agent_test.tpm.__wrapped__(tmp_path)  # type: ignore[attr-defined]
    try:
        yield next(gen)
    finally:
        next(gen, None)


def _tpm2(tcti: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["tpm2", *args], env={**os.environ, "TPM2TOOLS_TCTI": tcti},
        capture_output=True, check=check, timeout=60,
    )  # fmt: skip


def _ek(tcti: str, d: Path) -> rsa.RSAPublicKey:
    """The EK swtpm_setup made persistent (RSA 2048, the default template)."""
    _tpm2(tcti, "readpublic", "-c", EK, "-f", "pem", "-o", str(d / "ek.pem"))
    ek = serialization.load_pem_public_key((d / "ek.pem").read_bytes())
    assert isinstance(ek, rsa.RSAPublicKey)
    return ek


def _ak_name(tcti: str, d: Path) -> bytes:
    _tpm2(tcti, "createak", "-C", EK, "-c", str(d / "ak.ctx"), "-G", "ecc", "-g", "sha256",
          "-s", "ecdsa", "-u", str(d / "ak.pub"), "-n", str(d / "ak.name"))  # fmt: skip
    _tpm2(tcti, "flushcontext", "-t")
    _tpm2(tcti, "evictcontrol", "-C", "o", "-c", str(d / "ak.ctx"), AK)
    return (d / "ak.name").read_bytes()


def _activate(tcti: str, d: Path, credential: bytes) -> bytes | None:
    """What tpm2_activatecredential recovers (the agent's commands), or None if refused."""
    (d / "cred").write_bytes(credential)
    (d / "secret").unlink(missing_ok=True)
    session = str(d / "session.ctx")
    _tpm2(tcti, "startauthsession", "--policy-session", "-S", session)
    _tpm2(tcti, "policysecret", "-S", session, "-c", "e")
    done = _tpm2(tcti, "activatecredential", "-c", AK, "-C", EK, "-i", str(d / "cred"),
                 "-o", str(d / "secret"), "-P", f"session:{session}", check=False)  # fmt: skip
    _tpm2(tcti, "flushcontext", session)
    return (d / "secret").read_bytes() if done.returncode == 0 else None


def test_only_the_tpm_holding_the_ek_and_the_ak_activates(tmp_path: Path) -> None:
    secret = os.urandom(32)
    with _swtpm(tmp_path / "a") as a, _swtpm(tmp_path / "b") as b:
        ek_a, ek_b = _ek(a, tmp_path / "a"), _ek(b, tmp_path / "b")
        name = _ak_name(a, tmp_path / "a")
        assert name[:2] == b"\x00\x0b" and len(name) == 34  # SHA-256 name

        right = make_credential(ek_a, name, secret).tpm2_tools_file()
        assert _activate(a, tmp_path / "a", right) == secret

        # The same AK presented with another TPM's EK: A cannot decrypt the seed.
        other_ek = make_credential(ek_b, name, secret).tpm2_tools_file()
        assert _activate(a, tmp_path / "a", other_ek) is None

        # A fabricated AK name (a key not in this TPM): the integrity check fails.
        fake = b"\x00\x0b" + bytes(32)
        assert (
            _activate(a, tmp_path / "a", make_credential(ek_a, fake, secret).tpm2_tools_file())
            is None
        )


def test_an_ecc_ek_is_refused_with_a_sentence() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    from metald.attestation.credential import CredentialError

    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    with pytest.raises(CredentialError, match="RSA"):
        make_credential(key, b"\x00\x0b" + bytes(32), b"x")  # type: ignore[arg-type]
