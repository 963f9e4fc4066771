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


def test_an_ecc_ek_activates_the_same_way(tmp_path: Path) -> None:
    """An ECC EK (tpm2_createek -G ecc: the TCG template L-2, NIST P-256): the seed reaches the
    TPM by one-pass ECDH and KDFe. The right TPM recovers the secret; a credential for another
    TPM's ECC EK, or over a fabricated AK name, is refused. Fails on the old code (an ECC EK
    was refused outright)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    ecc_ek = "0x81010003"
    secret = os.urandom(32)

    def ecc(tcti: str, d: Path) -> tuple[ec.EllipticCurvePublicKey, bytes]:
        _tpm2(tcti, "createek", "-G", "ecc", "-c", str(d / "eccek.ctx"))
        _tpm2(tcti, "evictcontrol", "-C", "o", "-c", str(d / "eccek.ctx"), ecc_ek)
        _tpm2(tcti, "flushcontext", "-t")
        _tpm2(tcti, "readpublic", "-c", ecc_ek, "-f", "pem", "-o", str(d / "eccek.pem"))
        key = serialization.load_pem_public_key((d / "eccek.pem").read_bytes())
        assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
        _tpm2(tcti, "createak", "-C", ecc_ek, "-c", str(d / "ak.ctx"), "-G", "ecc",
              "-g", "sha256", "-s", "ecdsa", "-u", str(d / "ak.pub"),
              "-n", str(d / "ak.name"))  # fmt: skip
        _tpm2(tcti, "flushcontext", "-t")
        _tpm2(tcti, "evictcontrol", "-C", "o", "-c", str(d / "ak.ctx"), AK)
        return key, (d / "ak.name").read_bytes()

    def activate(tcti: str, d: Path, credential: bytes) -> bytes | None:
        (d / "cred").write_bytes(credential)
        (d / "secret").unlink(missing_ok=True)
        session = str(d / "session.ctx")
        _tpm2(tcti, "startauthsession", "--policy-session", "-S", session)
        _tpm2(tcti, "policysecret", "-S", session, "-c", "e")
        done = _tpm2(tcti, "activatecredential", "-c", AK, "-C", ecc_ek, "-i", str(d / "cred"),
                     "-o", str(d / "secret"), "-P", f"session:{session}", check=False)  # fmt: skip
        _tpm2(tcti, "flushcontext", session)
        return (d / "secret").read_bytes() if done.returncode == 0 else None

    with _swtpm(tmp_path / "a") as a, _swtpm(tmp_path / "b") as b:
        ek_a, name = ecc(a, tmp_path / "a")
        ek_b, _ = ecc(b, tmp_path / "b")
        cred = make_credential(ek_a, name, secret).tpm2_tools_file()
        assert activate(a, tmp_path / "a", cred) == secret
        assert activate(a, tmp_path / "a", make_credential(ek_b, name, secret).tpm2_tools_file()) is None  # fmt: skip
        fake = b"\x00\x0b" + bytes(32)
        assert activate(a, tmp_path / "a", make_credential(ek_a, fake, secret).tpm2_tools_file()) is None  # fmt: skip


def test_an_ecc_ek_on_another_curve_is_refused_with_a_sentence() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    from metald.attestation.credential import CredentialError

    key = ec.generate_private_key(ec.SECP384R1()).public_key()
    with pytest.raises(CredentialError, match="P-256"):
        make_credential(key, b"\x00\x0b" + bytes(32), b"x")


async def test_enrollment_with_a_real_ecc_ek_through_the_api(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """metald's enrollment with a TPM whose EK is ECC (NIST P-256): the challenge metald
    answers is activated by that TPM and the AK enrolls; a wrong secret is still refused.
    Fails on the old code (422: an ECC EK was refused)."""
    import base64

    from metald.lifecycle import State
    from tests.attestation.test_api_attestation import _machine

    client, _tokens, store = api
    mid, token = _machine(store, State.INSPECTING, "boot-1")
    agent = {"Authorization": f"Bearer {token}"}
    ecc_ek = "0x81010003"
    d = tmp_path / "t"
    with _swtpm(d) as t:
        _tpm2(t, "createek", "-G", "ecc", "-c", str(d / "eccek.ctx"))
        _tpm2(t, "evictcontrol", "-C", "o", "-c", str(d / "eccek.ctx"), ecc_ek)
        _tpm2(t, "flushcontext", "-t")
        _tpm2(t, "readpublic", "-c", ecc_ek, "-f", "pem", "-o", str(d / "eccek.pem"))
        _tpm2(t, "createak", "-C", ecc_ek, "-c", str(d / "ak.ctx"), "-G", "ecc", "-g", "sha256",
              "-s", "ecdsa", "-u", str(d / "ak.tpmt"), "-f", "tpmt", "-n", str(d / "ak.name"))  # fmt: skip
        _tpm2(t, "flushcontext", "-t")
        _tpm2(t, "evictcontrol", "-C", "o", "-c", str(d / "ak.ctx"), AK)
        body = {
            "ak_public": base64.b64encode((d / "ak.tpmt").read_bytes()).decode(),
            "ek_public": (d / "eccek.pem").read_text(),
        }
        r = await client.post("/api/v1/agent/attestation/key", json=body, headers=agent)
        assert r.status == 200, await r.text()
        challenge = await r.json()
        assert challenge["status"] == "challenge"
        cred = base64.b64decode(challenge["credential"])
        r = await client.post(
            "/api/v1/agent/attestation/key",
            json={**body, "activation_secret": "00" * 32},
            headers=agent,
        )
        assert r.status == 422, await r.text()
        (d / "cred").write_bytes(cred)
        session = str(d / "session.ctx")
        _tpm2(t, "startauthsession", "--policy-session", "-S", session)
        _tpm2(t, "policysecret", "-S", session, "-c", "e")
        _tpm2(t, "activatecredential", "-c", AK, "-C", ecc_ek, "-i", str(d / "cred"),
              "-o", str(d / "secret"), "-P", f"session:{session}")  # fmt: skip
        _tpm2(t, "flushcontext", session)
        # The wrong secret spent that challenge: a fresh one, activated by the TPM.
        r = await client.post("/api/v1/agent/attestation/key", json=body, headers=agent)
        (d / "cred").write_bytes(base64.b64decode((await r.json())["credential"]))
        _tpm2(t, "startauthsession", "--policy-session", "-S", session)
        _tpm2(t, "policysecret", "-S", session, "-c", "e")
        _tpm2(t, "activatecredential", "-c", AK, "-C", ecc_ek, "-i", str(d / "cred"),
              "-o", str(d / "secret"), "-P", f"session:{session}")  # fmt: skip
        r = await client.post(
            "/api/v1/agent/attestation/key",
            json={**body, "activation_secret": (d / "secret").read_bytes().hex()},
            headers=agent,
        )
        assert r.status == 200, await r.text()
        out = await r.json()
        assert out["status"] == "enrolled" and out["ak_name"] == (d / "ak.name").read_bytes().hex()
