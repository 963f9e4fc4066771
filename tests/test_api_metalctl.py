"""metalctl against a real metald on loopback: -o anywhere (json, yaml, wide), names in paths,
confirmation of destructive steps, the token hint, usage errors exit 2, events newest first."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from api.app import CTX_KEY
from metald.lifecycle import State
from metald.metalctl.main import hoist_output, main
from tests.api_helpers import LoopbackApi, use_services
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


def _read_lines(proc: subprocess.Popen[bytes], want: Callable[[list[str]], bool]) -> list[str]:
    """The whole lines a running metalctl printed, once ``want`` holds of them (20 s at most)."""
    out = b""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not want(out.decode().split("\n")[:-1]):
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            out += os.read(proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
    return out.decode().split("\n")[:-1]


def test_events_follow_starts_at_the_tail_or_since(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    """--follow shows the newest --tail N (oldest first), not the history from event #1, then
    live events; --since starts at a time instead."""
    for i in range(4):
        _run(capsys, "machines", "label", "node2", f"step={i}")
    rc, out, _ = _run(capsys, "events", "--tail", "1000", "-o", "json")
    history = json.loads(out)["items"]
    assert len(history) > 6
    newest = [e["id"] for e in history[:2]][::-1]
    follower = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "metald.metalctl",
            "events",
            "--follow",
            "--tail",
            "2",
            "-o",
            "json",
        ],
        stdout=subprocess.PIPE,
        env=os.environ.copy(),
    )
    try:
        seen = _read_lines(follower, lambda lines: len(lines) >= 2)
        assert [json.loads(x)["id"] for x in seen] == newest, seen
        _run(capsys, "machines", "label", "node2", "step=live")
        seen = _read_lines(follower, lambda lines: any('"live"' in x for x in lines))
        assert any(json.loads(x)["data"] == {"patch": {"step": "live"}} for x in seen), seen
    finally:
        follower.kill()
        follower.wait()
    rc, out, _ = _run(capsys, "events", "--since", "1h", "--tail", "1000", "-o", "json")
    assert rc == 0 and len(json.loads(out)["items"]) == len(history) + 1
    rc, out, _ = _run(capsys, "events", "--since", "2999-01-01T00:00:00Z", "-o", "json")
    assert rc == 0 and json.loads(out)["items"] == []
    with pytest.raises(SystemExit):
        main(["events", "--since", "yesterday"])
    assert "neither a duration" in capsys.readouterr().err


class _LaggingBmc(FakeBmc):
    """Answers an action pending (202); its command is confirmed on the second read after."""

    def __init__(self) -> None:
        super().__init__(power_state="on")
        self.reads = 0
        self.command: dict[str, Any] | None = None

    async def owner_url(self, **_kw: Any) -> str | None:
        return None  # one instance: every command runs here

    async def power(
        self, machine_id: str, action: str, actor: str = "", wait_s: float | None = None
    ) -> dict[str, Any]:
        self.calls.append((machine_id, "power", action))
        self.command = {
            "command_id": "c1",
            "bmc_id": "b1",
            "machine_id": machine_id,
            "action": action,
            "target_state": "off",
            "status": "pending",
            "power_state": "on",
            "elapsed_s": 0.0,
            "detail": None,
        }
        return {"machine_id": machine_id, "bmc_id": "b1", **self.command}

    def power_command(self, command_id: str, **_kw: Any) -> dict[str, Any]:
        assert self.command is not None and command_id == self.command["command_id"]
        self.reads += 1
        if self.reads >= 2:
            self.command.update(status="confirmed", power_state="off")
        return dict(self.command)


def test_power_off_waits_until_the_bmc_reports_it(live: LoopbackApi, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bmc = _LaggingBmc()
    use_services(live.runner.app[CTX_KEY], bmc=bmc)
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


# ---- columns, names first -------------------------------------------------------------------


def test_tables_lead_with_names_and_custom_columns(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    assert live.tokens is not None
    rc, out, _ = _run(capsys, "machines", "list")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[0] == "NAME"
    assert {ln.split()[0] for ln in lines[1:4]} == {"node0", "node1", "node2"}
    assert live.tokens.machine_free not in out  # the full UUID only with -o wide/json
    tenant_of = {ln.split()[0]: ln.split()[-2] for ln in lines[1:4]}
    assert (tenant_of["node0"], tenant_of["node1"], tenant_of["node2"]) == ("acme", "globex", "-")
    rc, out, _ = _run(
        capsys, "machines", "list", "-o", "custom-columns=MACHINE:name,STATE:state,RACK:labels.rack"
    )
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["MACHINE", "STATE", "RACK"]
    assert any(ln.split()[:2] == ["node2", "ready"] for ln in lines[1:])
    rc, out, _ = _run(capsys, "-o", "custom-columns=id", "machines", "list")
    assert live.tokens.machine_free in out and out.splitlines()[0].strip() == "ID"
    with pytest.raises(SystemExit) as e:
        main(["machines", "list", "-o", "custom-columns=NAME:"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["machines", "list", "-o", "toml"])
    assert e.value.code == 2


# ---- shell completion -----------------------------------------------------------------------


def _complete(live: LoopbackApi, tmp_path: Path, line: str) -> list[str]:
    """What the shell gets from metalctl for ``line`` (the real entry point, as bash runs it)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "completions"
    env = {
        **os.environ,
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_IFS": "\n",
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
        "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
    }
    r = subprocess.run(
        [sys.executable, "-m", "metald.metalctl"], env=env, capture_output=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return [w.strip() for w in out.read_text().split("\n") if w.strip()]


def test_shell_completion_of_subcommands_and_machine_names(
    live: LoopbackApi, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    assert _complete(live, tmp_path, "metalctl mach") == ["machines"]
    assert "show" in _complete(live, tmp_path, "metalctl machines s")
    assert sorted(_complete(live, tmp_path, "metalctl machines show node")) == [
        "node0",
        "node1",
        "node2",
    ]
    assert _complete(live, tmp_path, "metalctl power node2 of") == ["off"]
    assert _complete(live, tmp_path, "metalctl machines retire node1") == ["node1"]
    rc, out, _ = _run(capsys, "completion", "bash")
    assert rc == 0 and "metalctl" in out and "complete " in out


# ---- bulk by selector -----------------------------------------------------------------------


class _RackBmc(FakeBmc):
    """Powers every machine but ``broken`` (its BMC does not answer)."""

    def __init__(self, broken: str) -> None:
        super().__init__(power_state="on")
        self.broken = broken

    async def owner_url(self, **_kw: Any) -> str | None:
        return None

    async def power(  # type: ignore[override]
        self, machine_id: str, action: str, actor: str = "", wait_s: float | None = None
    ) -> dict[str, Any]:
        from metald.errors import MetaldError

        if machine_id == self.broken:
            raise MetaldError("the BMC did not answer within 10 s")
        if action != "status":
            self.calls.append((machine_id, "power", action))
        return {"machine_id": machine_id, "bmc_id": "b1", "power_state": "on"}


def test_power_cycle_by_selector_confirms_reports_each_and_fails_if_any(
    live: LoopbackApi, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    assert live.tokens is not None
    from metald.client.sync import Client

    c = Client(live.base, live.tokens.technician)
    for ref in ("node1", "node2"):
        c.call("PATCH", f"/api/v1/machines/{ref}", {"rack": "r07"})
    bmc = _RackBmc(broken=live.tokens.machine_free)  # node2
    use_services(live.runner.app[CTX_KEY], bmc=bmc)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    rc, _, err = _run(capsys, "machines", "power", "cycle", "--selector", "rack=r07")
    assert (
        rc == 2
        and "--yes" in err
        and "2 machines (node1, node2)" in err.replace("node2, node1", "node1, node2")
    )
    assert bmc.calls == []  # unconfirmed: nothing was sent
    rc, out, err = _run(capsys, "machines", "power", "cycle", "--selector", "rack=r07", "--yes")
    rows = {ln.split()[0]: ln for ln in out.splitlines()[1:] if ln.startswith("node")}
    assert rc == 1 and "1 of 2 failed" in err
    assert "ok" in rows["node1"].split() and "failed" in rows["node2"].split()
    assert "did not answer" in rows["node2"] and "(1 ok, 1 failed)" in out
    assert [m for m, _, a in bmc.calls if a == "cycle"] == [live.tokens.machine_b]
    rc, _, err = _run(capsys, "machines", "power", "cycle", "--selector", "rack=r99", "--yes")
    assert rc == 2 and "no machine matches" in err
    rc, _, err = _run(capsys, "machines", "power", "cycle", "--selector", "rack", "--yes")
    assert rc == 2 and "key=value" in err
    # Actions take the same selection; a non-disruptive one is not asked about.
    rc, out, _ = _run(capsys, "machines", "maintenance-off", "--selector", "rack=r07")
    assert rc == 1 and "node1" in out and "node2" in out  # neither is in maintenance: 409s


# ---- BMC import from CSV --------------------------------------------------------------------


class _ImportBmc:
    """The BMC service's registry side, recording what the API asked of it."""

    def __init__(self, refuse: str | None = None) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.passwords: dict[str, str] = {}
        self.verify: dict[str, Any] = {}
        self.removed: list[str] = []
        self.refuse = refuse

    async def owner_url(self, **_kw: Any) -> str | None:
        return None

    async def register(
        self,
        address: str,
        port: Any,
        protocol: str,
        username: str,
        password: str,
        machine_id: str | None = None,
        **_kw: Any,
    ) -> dict[str, Any]:  # type: ignore[no-untyped-def]  # noqa: E501
        from metald.errors import Unprocessable

        if address == self.refuse:
            raise Unprocessable(f"BMC {address} did not answer; check its address and network")
        bmc_id = f"b{len(self.rows):07d}-0000-4000-8000-000000000000"
        self.passwords[address] = password
        self.verify[address] = _kw.get("verify")
        self.rows[bmc_id] = {
            "id": bmc_id, "machine_id": machine_id, "address": address, "port": port,
            "protocol": protocol if protocol != "auto" else "ipmi", "username": username,
            "verify_tls": True, "ca_pinned": False, "health": "ok", "health_detail": None,
            "power_state": None, "system_uuid": None, "serial": None, "macs": [],
            "last_seen_at": None, "created_at": None,
        }  # fmt: skip
        return self.rows[bmc_id]

    async def list(self) -> list[dict[str, Any]]:
        return list(self.rows.values())

    async def remove(self, bmc_id: str, actor: str = "") -> None:
        self.removed.append(bmc_id)
        self.rows.pop(bmc_id)


CSV_HEAD = "address,protocol,username,password-env,machine\n"


def _import(
    live: LoopbackApi, capsys, tmp_path: Path, text: str, *extra: str, allow: str = "R07_PW"
):  # type: ignore[no-untyped-def]  # noqa: E501
    f = tmp_path / "rack07.csv"
    f.write_text(text)
    allowed = ("--allow-env", allow) if allow else ()
    return _run(capsys, "bmcs", "import", str(f), *allowed, *extra)


def test_bmc_import_checks_every_row_first_and_imports_nothing_if_one_is_bad(
    live: LoopbackApi, capsys, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    svc = _ImportBmc()
    use_services(live.runner.app[CTX_KEY], bmc=svc)
    monkeypatch.setenv("R07_PW", "s3cret-from-env")
    monkeypatch.delenv("METALD_BMC_PASSWORD_R07_MISSING", raising=False)
    text = CSV_HEAD + (
        "10.0.7.1,ipmi,admin,R07_PW,node0\n"
        "10.0.7.2,telnet,admin,R07_PW,\n"  # line 3: protocol
        "10.0.7.3,redfish,admin,METALD_BMC_PASSWORD_R07_MISSING,node1\n"  # line 4: not set
        "10.0.7.1,ipmi,admin,R07_PW,\n"  # line 5: the address again
        "10.0.7.6,auto,admin,R07_PW,no-such-machine\n"  # line 6: the machine
        "10.0.7.7,auto,admin,R07_PW,node2\n"
    )
    rc, _, err = _import(live, capsys, tmp_path, text)
    assert rc == 2 and "nothing was imported" in err and svc.rows == {}
    bad = sorted(int(ln.split(":")[1]) for ln in err.splitlines() if "rack07.csv:" in ln)
    assert bad == [3, 4, 5, 6]
    assert (
        "telnet" in err
        and "$METALD_BMC_PASSWORD_R07_MISSING is not set" in err
        and "already on line 2" in err
    )
    # A password column is refused outright, whatever it holds.
    rc, _, err = _import(live, capsys, tmp_path, "address,username,password\n10.0.7.1,a,b\n")
    assert rc == 2 and "never read from the file" in err and svc.rows == {}
    # --partial: the good rows go in, the run still exits 1.
    rc, out, _ = _import(live, capsys, tmp_path, text, "--partial")
    assert rc == 1 and sorted(r["address"] for r in svc.rows.values()) == ["10.0.7.1", "10.0.7.7"]
    assert svc.passwords == {"10.0.7.1": "s3cret-from-env", "10.0.7.7": "s3cret-from-env"}
    assert {r["machine_id"] for r in svc.rows.values()} == {
        live.tokens.machine_a,  # type: ignore[union-attr]
        live.tokens.machine_free,  # type: ignore[union-attr]
    }
    # Importing the same file again: those addresses are already registered.
    rc, _, err = _import(live, capsys, tmp_path, CSV_HEAD + "10.0.7.1,ipmi,admin,R07_PW,\n")
    assert rc == 2 and "already registered" in err


def test_bmc_import_all_good_and_undone_when_the_api_refuses_a_row(
    live: LoopbackApi, capsys, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    svc = _ImportBmc(refuse="10.0.7.3")
    use_services(live.runner.app[CTX_KEY], bmc=svc)
    monkeypatch.setenv("R07_PW", "pw")
    rc, out, err = _import(
        live,
        capsys,
        tmp_path,
        CSV_HEAD
        + "10.0.7.1,ipmi,admin,R07_PW,\n10.0.7.2,,admin,R07_PW,\n10.0.7.3,,admin,R07_PW,\n",
    )
    assert rc == 1 and "did not answer" in out and svc.rows == {} and len(svc.removed) == 2
    assert out.count("undone") == 2
    # A failure before the last row: the rows after it are listed as not tried, and the
    # summary says nothing was imported and what to do.
    rc, out, err = _import(
        live,
        capsys,
        tmp_path,
        CSV_HEAD
        + "10.0.7.1,ipmi,admin,R07_PW,\n10.0.7.3,ipmi,admin,R07_PW,\n10.0.7.4,ipmi,admin,R07_PW,\n",
    )
    assert rc == 1 and svc.rows == {}
    (skipped,) = [ln for ln in out.splitlines() if "skipped" in ln]
    assert "10.0.7.4" in skipped and "not tried: line 3 failed" in skipped
    assert "nothing was imported (1 undone, 1 not tried)" in err and "--partial" in err
    rc, out, _ = _import(live, capsys, tmp_path, CSV_HEAD + "10.0.7.1,ipmi,admin,R07_PW,\n")
    assert rc == 0 and "registered" in out and len(svc.rows) == 1
    rc, out, _ = _import(
        live, capsys, tmp_path, CSV_HEAD + "10.0.7.9,ipmi,admin,R07_PW,\n", "--dry-run"
    )
    assert rc == 0 and "1 row(s) would be imported" in out and len(svc.rows) == 1


def test_bmc_import_reads_only_variables_the_operator_allowed(
    live: LoopbackApi, capsys, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A CSV's author picks the password-env names and the addresses the passwords go to: a
    row naming METALD_TOKEN would send the operator's API token to the author's host (HTTP
    Basic for Redfish, plain HTTPS with insecure=true included). Only METALD_BMC_PASSWORD_*
    and names given with --allow-env are read; METALD_* secrets never, even when allowed."""
    import os

    svc = _ImportBmc()
    use_services(live.runner.app[CTX_KEY], bmc=svc)
    token = os.environ["METALD_TOKEN"]
    monkeypatch.setenv("HOME_PW", "operator-secret")
    monkeypatch.setenv("METALD_BMC_PASSWORD_R07", "rack-pw")
    monkeypatch.setenv("metald_token", token)
    text = "address,protocol,username,password-env,insecure\n" + (
        "https://203.0.113.9:8443,redfish,admin,METALD_TOKEN,true\n"  # line 2
        "http://203.0.113.9,redfish,admin,HOME_PW,false\n"  # line 3: not allowed
        "203.0.113.10,ipmi,admin,metald_token,\n"  # line 4: any case
        "10.0.7.4,ipmi,admin,METALD_BMC_PASSWORD_R07,\n"
    )
    rc, out, err = _import(live, capsys, tmp_path, text, "--partial", allow="")
    assert rc == 1
    bad = sorted(int(ln.split(":")[1]) for ln in err.splitlines() if "rack07.csv:" in ln)
    assert bad == [2, 3, 4]
    assert "METALD_BMC_PASSWORD_" in err and "--allow-env HOME_PW" in err
    assert svc.passwords == {"10.0.7.4": "rack-pw"}
    assert token not in err and token not in out and "operator-secret" not in out + err
    # The operator allows HOME_PW by name: that row goes in. METALD_TOKEN cannot be allowed.
    rc, _, err = _import(live, capsys, tmp_path, text, "--partial", allow="HOME_PW")
    assert svc.passwords["http://203.0.113.9"] == "operator-secret"
    assert token not in svc.passwords.values()
    for name in ("METALD_TOKEN", "METALD_URL", "metald_token"):
        rc, _, err = _import(live, capsys, tmp_path, text, allow=name)
        assert rc == 2 and "METALD_* variables" in err
    assert token not in svc.passwords.values()
    # bmcs register --password-env: the operator names it, but never a METALD_* secret.
    rc, _, err = _run(
        capsys, "bmcs", "register", "https://203.0.113.9", "--insecure",
        "--protocol", "redfish", "--username", "admin", "--password-env", "METALD_TOKEN",
    )  # fmt: skip
    assert rc == 2 and "METALD_* variables" in err and token not in err
    assert "https://203.0.113.9" not in svc.passwords
    rc, out, _ = _run(
        capsys, "bmcs", "register", "https://203.0.113.9", "--insecure",
        "--protocol", "redfish", "--username", "admin", "--password-env", "METALD_BMC_PASSWORD_R07",
    )  # fmt: skip
    assert rc == 0 and svc.passwords["https://203.0.113.9"] == "rack-pw"
    assert svc.verify["https://203.0.113.9"] is True
    # --no-verify stages BMCs that do not answer yet (register and import alike).
    rc, out, _ = _run(
        capsys, "bmcs", "register", "10.0.9.1", "--protocol", "ipmi", "--username", "admin",
        "--password-env", "METALD_BMC_PASSWORD_R07", "--no-verify",
    )  # fmt: skip
    assert rc == 0 and svc.verify["10.0.9.1"] is False
    rc, _, _ = _import(
        live, capsys, tmp_path, CSV_HEAD + "10.0.9.2,ipmi,admin,METALD_BMC_PASSWORD_R07,\n",
        "--no-verify",
    )  # fmt: skip
    assert rc == 0 and svc.verify["10.0.9.2"] is False


# ---- --wait progress ------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_in_place_on_a_terminal_and_prints_changes_elsewhere() -> None:
    from metald.metalctl.progress import Progress

    tty = _Tty()
    p = Progress(tty)
    p.show("claim c1\nnode1 provisioning 10%")
    p.show("claim c1\nnode1 provisioning 55%")
    frames = tty.getvalue()
    assert frames.startswith("claim c1\n") and "\x1b[2F\x1b[J" in frames
    assert frames.rindex("\x1b[2F\x1b[J") < frames.index("55%")
    pipe = io.StringIO()
    p = Progress(pipe)
    for frame in ("node1: power on", "node1: power on", "node1: power off"):
        p.show(frame)
    assert pipe.getvalue() == "node1: power on\nnode1: power off\n"  # no escapes, no repeats


def test_commands_take_tenant_names_where_bodies_need_ids(
    live: LoopbackApi, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    assert live.tokens is not None
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    rc, out, _ = _run(
        capsys, "tokens", "create", "--name", "g-orch", "--role", "orchestrator",
        "--scope", "globex", "-o", "json",
    )  # fmt: skip
    assert rc == 0 and json.loads(out)["scope"] == [live.tokens.tenant_b]
    rc, _, err = _run(
        capsys, "tokens", "create", "--name", "x", "--role", "orchestrator", "--scope", "nope"
    )
    assert rc == 1 and "HTTP 404" in err


def test_action_wait_follows_the_machine_until_it_settles(
    live: LoopbackApi, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """``inspect --wait`` polls until the machine leaves inspecting; the world moves between
    polls (the watchdog fails the inspection), not by the clock."""
    from metald import machines as svc

    assert live.tokens is not None
    mid = live.tokens.machine_free
    polls: list[int] = []

    def world_moves(_s: float) -> None:
        polls.append(1)
        if len(polls) == 2:  # two polls see it inspecting, then it fails
            with live.store.session() as s:
                svc.transition(s, mid, "inspect-fail", actor="test", reason="watchdog")

    monkeypatch.setattr("metald.metalctl.machines.time.sleep", world_moves)
    rc, out, err = _run(capsys, "machines", "inspect", "node2", "--wait")
    row = next(ln for ln in out.splitlines() if ln.startswith("node2"))
    assert rc == 1 and "failed" in row.split() and "inspect-failed" in row, (out, err)
    assert len(polls) == 2 and "inspecting" in err  # progress went to stderr, plain lines
    assert "\x1b[" not in err


# ---- kubectl parity -------------------------------------------------------------------------


def test_wide_shows_each_column_once_with_the_whole_id(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    assert live.tokens is not None
    rc, out, _ = _run(capsys, "machines", "list", "-o", "wide")
    headers = out.splitlines()[0].split()
    assert rc == 0 and len(headers) == len(set(headers)), headers
    assert {"ID", "NAME", "RACK"} <= set(headers) and "NAME_S" not in headers
    assert live.tokens.machine_free in out  # wide: the whole id, in the one ID column


def test_custom_columns_index_lists_and_refuse_unknown_fields(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "json")
    first = json.loads(out)["allowed_actions"][0]
    rc, out, _ = _run(
        capsys, "machines", "list", "-o", "custom-columns=NAME:name,DO:allowed_actions[0]"
    )
    assert rc == 0 and any(ln.split() == ["node2", first] for ln in out.splitlines()), out
    rc, out, err = _run(capsys, "machines", "list", "-o", "custom-columns=NAME:name,X:nmae")
    assert rc == 2 and "no field 'nmae'" in err and "name" in err and out == ""


def test_output_name_and_jsonpath(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out, _ = _run(capsys, "machines", "list", "-o", "name")
    assert rc == 0 and sorted(out.split()) == ["machine/node0", "machine/node1", "machine/node2"]
    rc, out, _ = _run(capsys, "machines", "list", "-o", "jsonpath={.items[*].name}")
    assert rc == 0 and sorted(out.split()) == ["node0", "node1", "node2"]
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "jsonpath={.state}")
    assert rc == 0 and out.strip() == "ready"
    rc, _, err = _run(capsys, "machines", "show", "node2", "-o", "jsonpath={.nope}")
    assert rc == 2 and "reaches nothing" in err


def test_list_selector_instances_list_and_state_choices(
    live: LoopbackApi, capsys, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    _run(capsys, "machines", "label", "node2", "pool=train", "row=7")
    rc, out, _ = _run(capsys, "machines", "list", "-l", "pool=train,row=7", "-o", "name")
    assert rc == 0 and out.split() == ["machine/node2"]
    rc, out, err = _run(capsys, "instances", "list")
    assert rc == 0 and out.splitlines()[0].split()[0] == "NAME", err
    offered = _complete(live, tmp_path, "metalctl machines list --state re")
    assert "ready" in offered and "retired" in offered
    assert all(o in {s.value for s in State} for o in offered), offered  # no file names


def test_mistyped_flag_suggests_and_every_subcommand_has_help(capsys) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from metald.metalctl.main import build_parser

    with pytest.raises(SystemExit) as e:
        main(["machines", "list", "--sate", "ready"])
    assert e.value.code == 2 and "did you mean --state?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["machines", "lsit"])
    assert "did you mean 'list'?" in capsys.readouterr().err
    missing = []

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                helps = {c.dest: c.help for c in a._choices_actions}
                for name, sp in a.choices.items():
                    if not helps.get(name):
                        missing.append(" ".join([*path, name]))
                    walk(sp, [*path, name])

    walk(build_parser(), [])
    assert missing == []


def test_cannot_connect_says_to_set_metald_url(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vmlab.labnet import free_port

    monkeypatch.setenv("METALD_URL", f"http://127.0.0.1:{free_port()}")
    rc, _, err = _run(capsys, "machines", "list")
    assert rc == 2 and "cannot reach" in err and "export METALD_URL=" in err


def test_rack_has_one_meaning(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    """`machines label ID rack=r07` set a label the RACK column and `--selector rack=r07` never
    saw; rack is now the machine's field wherever it is written, and never a label."""
    rc, out, err = _run(capsys, "machines", "label", "node2", "rack=r07", "pool=train")
    assert rc == 0, err
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "json")
    m = json.loads(out)
    assert m["rack"] == "r07" and m["labels"] == {"pool": "train"}
    rc, out, _ = _run(capsys, "machines", "list", "-o", "custom-columns=NAME:name,RACK:rack")
    assert any(ln.split() == ["node2", "r07"] for ln in out.splitlines()), out
    rc, out, _ = _run(capsys, "machines", "list", "--rack", "r07", "-o", "name")
    assert out.split() == ["machine/node2"]
    rc, _, err = _run(capsys, "machines", "list", "--label", "rack=r07")
    assert rc == 1 and "machine field" in err
    rc, out, _ = _run(capsys, "machines", "label", "node2", "rack-")
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "json")
    assert json.loads(out)["rack"] is None
    # The API refuses a label named rack, with what to do instead.
    import urllib.request

    assert live.tokens is not None
    req = urllib.request.Request(
        f"{live.base}/api/v1/machines/node2/labels",
        data=json.dumps({"labels": {"rack": "r07"}}).encode(),
        method="PATCH",
        headers={
            "Authorization": f"Bearer {live.tokens.technician}",
            "Content-Type": "application/json",
        },
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 422 and "machine field, not a label" in e.value.read().decode()


def test_enrollment_rules_cannot_set_a_rack_label(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from metald.config import ConfigError, load_config

    conf = tmp_path / "c.toml"
    conf.write_text('[[enroll.rules]]\nlabels = { rack = "r07" }\n')
    with pytest.raises(ConfigError, match="machine field"):
        load_config(conf, environ={})


def test_why_a_machine_is_held_shows_in_the_list(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    """The maintenance reason (and a last error) were nowhere in `machines list`."""
    rc, _, err = _run(capsys, "machines", "maintenance-on", "node2", "--reason", "reseat GPU 3")
    assert rc == 0, err
    rc, out, _ = _run(capsys, "machines", "list")
    (line,) = [ln for ln in out.splitlines() if ln.startswith("node2")]
    assert line.split()[0:2] == ["node2", "maintenance"] and line.endswith("reseat GPU 3")
    assert out.splitlines()[0].split()[-1] == "WHY"
    rc, out, _ = _run(capsys, "machines", "show", "node2", "-o", "json")
    assert json.loads(out)["state_reason"] == "reseat GPU 3"


def test_token_scopes_and_claim_images_by_name(live: LoopbackApi, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert live.tokens is not None
    monkeypatch.setenv("METALD_TOKEN", live.tokens.admin)
    rc, out, err = _run(
        capsys, "tokens", "create", "--name", "ci", "--role", "orchestrator", "--scope", "acme"
    )
    assert rc == 0, err
    rc, out, _ = _run(capsys, "tokens", "list")
    (line,) = [ln for ln in out.splitlines() if " ci " in f" {ln} "]
    assert "acme" in line.split(), line
    rc, out, err = _run(
        capsys, "images", "create", "ram", "--kind", "stateless", "--kernel", "k", "--rootfs", "r"
    )
    assert rc == 0, err
    rc, out, err = _run(
        capsys, "claims", "create", "--tenant", "acme", "--count", "1", "--image", "ram"
    )
    assert rc == 0, err
    rc, out, _ = _run(capsys, "claims", "list")
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["ID", "TENANT", "IMAGE"]
    assert rows and rows[0].split()[1:3] == ["acme", "ram"], rows
