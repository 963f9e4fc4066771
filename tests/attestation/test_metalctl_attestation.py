"""metalctl against a real metald: a machine held by a failed attestation shows the changed
PCR and events, and ``accept-golden`` (reason required) puts it back in the pool."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from metald.lifecycle import State
from metald.machines import get_machine
from metald.metalctl.main import main
from metald.provision import attestation as att
from metald.store import Store
from metald.store.models import AttestationNonce, Machine, utcnow
from tests.api_helpers import LoopbackApi, Tokens
from tests.attestation.test_verify import read


def _held(_cfg: Any, store: Store, _tokens: Tokens) -> None:
    """A machine that learned its golden values in one discovery boot and failed in the next
    (its BootOrder changed): held, through the same functions the API calls."""
    with store.session() as s:
        m = Machine(name="held1", state=State.INSPECTING.value, product="lab board")
        s.add(m)
        s.commit()
        # The credential activation answered in the fixture TPM's stead (it is not running
        # here): the secret metald wraps is fixed, so the test knows it.
        for answer in (None, bytes(32)):
            with patch.object(att.secrets, "token_bytes", lambda n: bytes(n)):
                att.enroll_key(
                    s, m.id, ak_public=read("a-ak.tpmt"), ek_public=read("a-ek.pem").decode(),
                    ek_certificate=None, activation_secret=answer, boot="b1", roots_pem=b"",
                    ttl_s=60, actor="test", instance=None,
                )  # fmt: skip
        for boot, fixture in (("b1", "boot1"), ("b2", "boot2")):
            nonce = read(f"a-{fixture}.nonce").decode()
            s.add(
                AttestationNonce(
                    nonce=nonce, machine_id=m.id, boot=boot,
                    expires_at=utcnow() + timedelta(minutes=5),
                )
            )  # fmt: skip
            att.submit(
                s, m.id, nonce=nonce, quote=read(f"a-{fixture}.quote.msg"),
                signature=read(f"a-{fixture}.quote.sig"), event_log=read(f"a-{fixture}.eventlog"),
                boot=boot, pcrs=(0, 1, 2, 3, 5, 6, 7), actor="test", instance=None,
            )  # fmt: skip
            s.commit()
        assert get_machine(s, m.id).state == State.ATTESTATION_FAILED.value


@pytest.fixture
def live(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    with LoopbackApi(db_url, tmp_path, prepare=_held) as api:
        assert api.tokens is not None
        monkeypatch.setenv("METALD_URL", api.base)
        monkeypatch.setenv("METALD_TOKEN", api.tokens.technician)
        yield api


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the CLI, not the store
def test_show_then_accept_golden(live: LoopbackApi, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["machines", "attestation", "held1"]) == 0
    out = capsys.readouterr().out
    assert "failed" in out and "PCR 1" in out and "BootOrder" in out and "Boot0001" in out
    assert main(["machines", "list"]) == 0
    assert "attestation-failed" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # --reason is required
        main(["machines", "accept-golden", "held1"])
    capsys.readouterr()
    assert main(["machines", "accept-golden", "held1", "--reason", "firmware 1.2 rollout"]) == 0
    assert "held1: ready" in capsys.readouterr().out
    assert main(["machines", "attestation", "held1"]) == 0
    assert "accepted by" in capsys.readouterr().out


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_skus_golden_values_from_a_reference_machine(
    live: LoopbackApi, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The firmware rollout accepted once for the SKU: held1's measured boot becomes the
    "lab board" SKU's golden values, and held1 (measuring exactly them) is ready again."""
    args = ["attestation", "set-sku", "lab board", "--from-machine", "held1"]
    with pytest.raises(SystemExit):  # --reason is required
        main(args)
    capsys.readouterr()
    assert main([*args, "--reason", "BIOS 1.1"]) != 0  # technicians may not: admins only
    capsys.readouterr()
    assert live.tokens is not None
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    assert main([*args, "--reason", "BIOS 1.1 rolled out"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lab board: operator by") and "PCR 1: " in out
    assert "back to ready: " in out
    assert main(["machines", "show", "held1"]) == 0
    assert "ready" in capsys.readouterr().out
    assert main(["attestation", "skus"]) == 0
    assert "BIOS 1.1 rolled out" in capsys.readouterr().out
    assert main(["attestation", "remove-sku", "lab board", "--reason", "gone"]) == 0
    capsys.readouterr()
    assert main(["attestation", "sku", "lab board"]) != 0
