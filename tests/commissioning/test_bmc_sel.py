"""The bmc-sel check: metald reads the machine's BMC event log itself when the agent asks for
its plan and again when the last check is in; new critical entries fail the run, an unreadable
BMC is an error, and the agent can never report the check itself.

The end-to-end case runs against OpenIPMI's ipmi_sim through metald's real BMC service (pyghmi):
between the two readings the simulated BMC logs a real SEL record, captured on a production
server (``fixtures/SOURCES.md``: a processor's uncorrectable machine check, sensor-specific event
data ab0700), added with the IPMI Add SEL Entry command as a BMC's own event logger would.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from api.app import CTX_KEY
from metald.bmc.service import BmcService
from metald.commissioning.parsers import bmc_sel
from metald.commissioning.profile import CheckSpec, CommissioningProfile
from metald.config import BmcConfig
from metald.secrets import SecretBox
from metald.store.models import CommissioningResult, CommissioningRun
from tests.api_helpers import use_services
from tests.bmc.peers import IpmiSim
from tests.commissioning.test_api import SMART_OK, _inventoried, report
from tests.conftest import LAB_BMC_NETWORKS

FIX = Path(__file__).parent / "fixtures"


def _elist_v(path: Path) -> list[dict[str, str]]:
    """``ipmitool sel elist -v`` / ``sel get`` records: one dict per record."""
    out: list[dict[str, str]] = []
    for block in path.read_text().split("SEL Record ID")[1:]:
        rec = {"Record ID": block.split(":", 1)[1].splitlines()[0].strip()}
        for line in block.splitlines()[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                rec[k.strip()] = v.strip()
        out.append(rec)
    return out


def _as_entry(rec: dict[str, str], severity: str = "ok") -> dict[str, Any]:
    """What metald's IPMI driver makes of a record (component type, event), with a severity the
    classifier must not need: a BMC that logs everything as OK is still read right."""
    return {
        "id": str(int(rec["Record ID"], 16)),
        "at": None,
        "severity": severity,
        "message": f"{rec['Sensor Type']} {rec['Description']}",
    }


def test_real_records_are_classified_by_their_event() -> None:
    recs = _elist_v(FIX / "ipmitool-sel-elist-v_processor-mce_moxspec.txt")
    assert len(recs) == 1 and recs[0]["Event Data"] == "ab0700"
    mce = _as_entry(recs[0])
    assert bmc_sel.is_critical(mce)
    assert not bmc_sel.is_critical(
        {**mce, "message": "Processor Correctable machine check exception"}
    )
    assert not bmc_sel.is_critical({**mce, "message": "Memory Uncorrectable error deasserted"})
    assert bmc_sel.is_critical(
        {"id": "9", "severity": "critical", "message": "CPU Temp Upper critical"}
    )
    assert bmc_sel.is_critical(
        {"id": "9", "severity": "Critical", "message": "Temperature threshold exceeded"}
    )
    assert not bmc_sel.is_critical({"id": "9", "severity": "warning", "message": "Correctable ECC"})


def _before(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return bmc_sel.reading(entries, at="2026-12-03T00:00:00+00:00")


def test_only_new_critical_entries_fail_and_are_named() -> None:
    old = [{"id": "1", "severity": "critical", "message": "CPU Temp Upper critical"}]
    boot = {"id": "2", "severity": "ok", "message": "System Boot Initiated"}
    mce = {
        "id": "3",
        "severity": "critical",
        "message": "Processor Uncorrectable machine check exception",
    }
    v, _ = bmc_sel.judge_sel(_before(old), [*old, boot])
    assert v.status.value == "passed" and v.values["new"] == 1, v.sentence
    v, raw = bmc_sel.judge_sel(_before(old), [*old, boot, mce])
    assert v.status.value == "failed"
    assert (
        v.sentence
        == "1 new critical BMC event(s): #3 Processor Uncorrectable machine check exception"
    )
    assert "CRITICAL critical #3" in raw and v.values["critical"] == [v.sentence.split(": ", 1)[1]]


def test_unreadable_or_cleared_log_is_never_a_pass() -> None:
    old = [{"id": "1", "severity": "ok", "message": "System Boot Initiated"}]
    v, _ = bmc_sel.judge_sel(None, old)
    assert v.status.value == "error"
    v, _ = bmc_sel.judge_sel(bmc_sel.reading(None, at="t", error_text="login refused"), old)
    assert v.status.value == "error" and "login refused" in v.sentence
    v, _ = bmc_sel.judge_sel(_before(old), None, after_error="no reply")
    assert v.status.value == "error" and "after the checks: no reply" in v.sentence
    # cleared during the run (record ids restart): what happened before the clear is unknown
    v, _ = bmc_sel.judge_sel(
        _before(old), [{"id": "1", "severity": "ok", "message": "Log area reset/cleared"}]
    )
    assert v.status.value == "error" and "cleared" in v.sentence
    v, _ = bmc_sel.judge_sel(
        _before(old), [{"id": "1", "severity": "critical", "message": "Memory Uncorrectable error"}]
    )
    assert v.status.value == "failed" and "also cleared" in v.sentence


def _profile() -> CommissioningProfile:
    return CommissioningProfile(
        name="sel",
        checks=[CheckSpec(name="smart", timeout_s=60), CheckSpec(name="bmc-sel")],
    )


def _mce_record() -> list[str]:
    """The captured record as the 16 bytes of IPMI Add SEL Entry (netfn 0x0a, cmd 0x44):
    record id (the BMC assigns it), type 02, timestamp, generator 0001, EvM 04, sensor type 07
    (processor), sensor 40, event dir/type 6f, event data ab 07 00."""
    ts = int(datetime(2019, 8, 8, 10, 37, 17, tzinfo=UTC).timestamp()).to_bytes(4, "little")
    body = [0, 0, 0x02, *ts, 0x01, 0x00, 0x04, 0x07, 0x40, 0x6F, 0xAB, 0x07, 0x00]
    return [f"0x{b:02x}" for b in body]


async def _results(store: Any, run_id: str) -> dict[str, CommissioningResult]:
    def do(s):  # type: ignore[no-untyped-def]
        q = select(CommissioningResult).where(CommissioningResult.run_id == run_id)
        return {r.check: r for r in s.exec(q)}

    return await store.run(do)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the BMC read is the cost here
async def test_a_critical_event_logged_during_the_run_fails_it(  # type: ignore[no-untyped-def]
    api,
    ipmi_sim: IpmiSim,
    tmp_path: Path,
) -> None:
    client, _tokens, store = api
    ctx = client.server.app[CTX_KEY]
    svc = BmcService(
        store,
        SecretBox.from_file(tmp_path / "k"),
        BmcConfig(
            networks=LAB_BMC_NETWORKS,
            min_interval_ms=0,
            timeout_s=3,
            retries=1,
            power_sync_interval_s=0,
        ),
        instance="t",
    )
    use_services(ctx, bmc=svc)
    try:
        target, agent = await _inventoried(client, store, _profile())
        mid = target.machine_id
        await svc.register(
            "127.0.0.1", ipmi_sim.port, "ipmi", ipmi_sim.username, ipmi_sim.password,
            machine_id=mid,
        )  # fmt: skip
        r = await client.get("/api/v1/agent/commissioning", headers=agent)
        assert r.status == 200, await r.text()
        plan = await r.json()
        assert [c["name"] for c in plan["checks"]] == ["smart"]  # bmc-sel is metald's own
        run = await store.run(lambda s: s.get(CommissioningRun, plan["run_id"]))
        assert run.sel_before["error"] is None and run.sel_before["count"] == 1
        # the agent cannot vouch for the BMC's log
        r = await client.post(
            "/api/v1/agent/commissioning",
            json={"results": [report("bmc-sel", "all good")]},
            headers=agent,
        )
        assert r.status == 422
        ipmi_sim.ipmitool("raw", "0x0a", "0x44", *_mce_record())
        r = await client.post(
            "/api/v1/agent/commissioning",
            json={"done": True, "results": [report("smart", SMART_OK)]},
            headers=agent,
        )
        body = await r.json()
        assert (body["status"], body["state"]) == ("failed", "commission-failed"), body
        res = await _results(store, plan["run_id"])
        sel = res["bmc-sel"]
        assert (res["smart"].status, sel.status) == ("passed", "failed")
        assert "Uncorrectable machine check exception" in sel.sentence, sel.sentence
        assert sel.values["entries_before"] == 1 and sel.values["new_critical"] == 1
        run = await store.run(lambda s: s.get(CommissioningRun, plan["run_id"]))
        assert "bmc-sel: 1 new critical BMC event(s)" in run.summary
        # pyghmi rates it Failed (4): metald's driver calls that critical, not ok (the raw
        # output lists each new entry as "[CRITICAL ]<severity> #<id> <message>")
        [line] = [ln for ln in sel.raw.splitlines() if "machine check" in ln]
        assert line.startswith("CRITICAL critical #"), line
    finally:
        await svc.stop()


async def test_no_bmc_makes_the_check_an_error(api) -> None:  # type: ignore[no-untyped-def]
    client, _tokens, store = api
    _target, agent = await _inventoried(client, store, _profile())
    r = await client.get("/api/v1/agent/commissioning", headers=agent)
    plan = await r.json()
    run = await store.run(lambda s: s.get(CommissioningRun, plan["run_id"]))
    assert "BMC control is not running" in run.sel_before["error"]
    r = await client.post(
        "/api/v1/agent/commissioning",
        json={"done": True, "results": [report("smart", SMART_OK)]},
        headers=agent,
    )
    assert (await r.json())["state"] == "commission-failed"
    sel = (await _results(store, plan["run_id"]))["bmc-sel"]
    assert sel.status == "error" and "could not be read before the checks" in sel.sentence
