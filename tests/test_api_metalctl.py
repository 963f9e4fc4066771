"""metalctl against a real metald on loopback: -o anywhere (json, yaml, wide), names in paths,
confirmation of destructive steps, the token hint, usage errors exit 2, events newest first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.app import CTX_KEY
from metald.metalctl.main import hoist_output, main
from tests.api_helpers import LoopbackApi
from tests.claims.fakes import FakeBmc


@pytest.fixture
def live(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        assert api.tokens is not None
        monkeypatch.setenv("METALD_URL", api.base)
        monkeypatch.setenv("METALD_TOKEN", api.tokens.technician)
        yield api


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_hoist_output_finds_the_option_anywhere() -> None:
    assert hoist_output(["machines", "list", "-o", "yaml"]) == ["-o", "yaml", "machines", "list"]
    assert hoist_output(["machines", "--json", "list"]) == ["-o", "json", "machines", "list"]
    assert hoist_output(["machines", "list", "-owide", "--yes"]) == [
        "-owide",
        "--yes",
        "machines",
        "list",
    ]


def test_output_formats_anywhere_on_the_line(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out, _ = _run(capsys, "machines", "list", "-o", "json")
    assert rc == 0 and json.loads(out)["total"] == 3
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "yaml")
    assert rc == 0 and yaml.safe_load(out)["name"] == "node2"
    rc, out, _ = _run(capsys, "machines", "list", "--json")
    assert json.loads(out)["total"] == 3
    rc, out, _ = _run(capsys, "tenants", "list", "-o", "wide")
    assert rc == 0 and "CREATED_AT" in out.splitlines()[0]


def test_destructive_steps_ask_and_retire_needs_a_reason(
    live: LoopbackApi, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    with pytest.raises(SystemExit) as e:
        main(["machines", "retire", "node2"])  # argparse: --reason is required
    assert e.value.code == 2
    rc, _, err = _run(capsys, "machines", "retire", "node2", "--reason", "dead psu")
    assert rc == 2 and "--yes" in err
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "json")
    assert json.loads(out)["state"] == "ready"
    rc, out, _ = _run(capsys, "machines", "retire", "node2", "--reason", "dead psu", "--yes")
    assert rc == 0 and "retired" in out


def test_rename_then_use_the_name(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, _, _ = _run(capsys, "machines", "rename", "node2", "r07-u12")
    assert rc == 0
    rc, out, _ = _run(capsys, "machines", "show", "r07-u12", "-o", "json")
    assert json.loads(out)["name"] == "r07-u12"


def test_missing_or_bad_token_says_how_to_set_it(live: LoopbackApi, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("METALD_TOKEN")
    rc, _, err = _run(capsys, "machines", "list")
    assert rc == 1 and "no METALD_TOKEN is set" in err and "export METALD_TOKEN" in err
    monkeypatch.setenv("METALD_TOKEN", "mtd_wrong")
    rc, _, err = _run(capsys, "machines", "list")
    assert rc == 1 and "the token was refused" in err


def test_local_usage_errors_exit_2(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, _, err = _run(capsys, "machines", "label", "node2", "no-equals-sign")
    assert rc == 2 and "key=value" in err
    rc, _, err = _run(capsys, "events", "--tail", "0")
    assert rc == 2


def test_events_newest_first_with_tail_and_kind(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    _run(capsys, "machines", "maintenance-on", "node2")
    rc, out, _ = _run(capsys, "events", "--tail", "3", "-o", "json")
    ids = [e["id"] for e in json.loads(out)["items"]]
    assert rc == 0 and len(ids) == 3 and ids == sorted(ids, reverse=True)
    rc, out, _ = _run(
        capsys, "events", "--kind", "machine.state", "--machine", "node2", "-o", "json"
    )
    items = json.loads(out)["items"]
    assert items and all(e["kind"] == "machine.state" for e in items)
    assert items[0]["to_state"] == "maintenance"


class _LaggingBmc(FakeBmc):
    """Reports the new power state only on the second status read after a command."""

    def __init__(self) -> None:
        super().__init__(power_state="on")
        self.reads = 0

    async def owner_url(self, **_kw: Any) -> str | None:
        return None  # one instance: every command runs here

    async def power(self, machine_id: str, action: str, actor: str = "") -> dict[str, Any]:
        if action == "status":
            self.reads += 1
            state = "on" if self.reads < 2 else "off"
        else:
            self.calls.append((machine_id, "power", action))
            state = "on"
        return {"machine_id": machine_id, "bmc_id": "b1", "power_state": state}


def test_power_off_waits_until_the_bmc_reports_it(live: LoopbackApi, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bmc = _LaggingBmc()
    live.runner.app[CTX_KEY].services["bmc"] = bmc
    monkeypatch.setattr("metald.metalctl.bmc.WAIT_INTERVAL_S", 0)
    rc, _, err = _run(capsys, "power", "node2", "off")  # no terminal, no --yes: refused
    assert rc == 2 and "--yes" in err and bmc.calls == []
    rc, out, err = _run(capsys, "power", "node2", "off", "--wait", "--yes")
    assert rc == 0 and "power off" in out and bmc.reads == 2, (out, err, bmc.calls)


def test_join_token_reaches_the_api(live: LoopbackApi, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The seeded tenant has no hub, so the API's 409 (with its sentence) is what comes back."""
    assert live.tokens is not None
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    rc, _, err = _run(capsys, "machines", "join-token", "node0", "--ttl", "600")
    assert rc == 1 and "no WireGuard hub" in err and "HTTP 409" in err
