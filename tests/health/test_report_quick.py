"""A node report that says what the machine's last clean one said is recorded without being
parsed again (``metald.healthwatch.reports.quick``), on both backends: the same answer, the
heartbeat moved, and every guard of the full path kept (401, 403, 429, a changed or new finding
read in full and recorded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from metald.commissioning.parsers import nvidia_smi
from metald.health.config import HealthConfig
from metald.healthwatch.reports import gpu_digest
from metald.lifecycle import State
from metald.store.models import HealthFault, Machine, NodeHeartbeat, WgPeer
from tests.health.test_api_report import ECC, XID79, _health, _node, _report

XML = (
    Path(__file__).parents[1] / "fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
).read_text()
TABLE = HealthConfig().table()


def _later(xml: str, n: int) -> str:
    """The same GPU a moment later: another timestamp, temperature, power draw and clock."""
    return (
        xml.replace("Fri Aug  4 11:44:30 2023", f"Fri Aug  4 11:{n:02d}:31 2023")
        .replace("<gpu_temp>27 C</gpu_temp>", f"<gpu_temp>{30 + n} C</gpu_temp>")
        .replace("<power_draw>67.03 W</power_draw>", f"<power_draw>{70 + n}.5 W</power_draw>")
    )


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = nvidia_smi.parse

    def counted(text: str) -> Any:
        calls.append(len(text))
        return real(text)

    monkeypatch.setattr(nvidia_smi, "parse", counted)
    return calls


async def _one_gpu_node(client: Any, tokens: Any, store: Any) -> tuple[str, str]:
    _, mid, token = await _node(client, tokens, store)
    with store.session() as s:  # the capture describes one GPU
        m = s.get(Machine, mid)
        m.gpu_count = 1
        s.add(m)
        s.commit()
    return mid, token


def test_the_digest_leaves_out_what_changes_and_keeps_what_is_judged() -> None:
    d = gpu_digest(XML, 1, TABLE)
    assert d is not None and gpu_digest(_later(XML, 7), 1, TABLE) == d
    assert gpu_digest(ECC.read_text(), 1, TABLE) != d  # an uncorrectable ECC count
    at = XML.index("<ecc_errors>")  # the GPU's own (the MIG devices' counts are not judged)
    bumped = XML[:at] + XML[at:].replace("<sram_uncorrectable>0<", "<sram_uncorrectable>1<", 1)
    assert bumped != XML and gpu_digest(bumped, 1, TABLE) != d
    slowed = XML.replace("<clocks_event_reason_hw_slowdown>Not Active<",
                         "<clocks_event_reason_hw_slowdown>Active<")  # fmt: skip
    assert slowed != XML and gpu_digest(slowed, 1, TABLE) != d
    assert gpu_digest(XML, 2, TABLE) != d  # the inventory's count is part of it
    assert gpu_digest(None, 1, TABLE) != d
    # Text that is not plain nvidia-smi output is always read in full.
    assert gpu_digest(XML.replace("<ecc_errors>", "<!-- x --><ecc_errors>", 1), 1, TABLE) is None


def test_the_digest_of_a_hostile_document_costs_linear_time() -> None:
    """Start tags without end tags (a node's 1 MiB body): each scan stops at the next one."""
    import time

    for body in ("<clocks>" * 130_000, "<clocks><a>1</a>" * 65_000,
                 "".join(f"<{n}>" for n in ("temperature", "clocks", "voltage")) * 40_000):  # fmt: skip
        t = time.process_time()
        assert gpu_digest("<nvidia_smi_log>" + body, 8, TABLE) is not None
        assert time.process_time() - t < 2.0  # quadratic: minutes


async def test_an_unchanged_clean_report_is_not_parsed_again(api, parses) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _health(client, report_min_interval_s=0)
    mid, token = await _one_gpu_node(client, tokens, store)
    first = await _report(client, token, {"kernel_log": "", "nvidia_smi_xml": XML})
    assert first.status == 200, await first.text()
    out = await first.json()
    assert out["new_faults"] == 0 and out["unreadable"] == [] and len(parses) == 1
    with store.session() as s:
        hb = s.get(NodeHeartbeat, mid)
        at0 = hb.last_at
        assert hb.digests == {"gpu": gpu_digest(XML, 1, TABLE), "signals": out["signals"]}
    for n in range(1, 4):  # kernel lines without an Xid are read, not a reason to parse again
        r = await _report(client, token, {"kernel_log": "[1.0] eth0: link up\n",
                                          "nvidia_smi_xml": _later(XML, n)})  # fmt: skip
        assert r.status == 200 and await r.json() == out
    assert len(parses) == 1
    with store.session() as s:
        hb = s.get(NodeHeartbeat, mid)
        assert hb.reports == 4 and hb.last_at > at0 and hb.unreadable == []
        assert not s.exec(select(HealthFault).where(HealthFault.machine_id == mid)).all()


async def test_a_changed_or_new_finding_is_read_in_full_and_recorded(api, parses) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _health(client, report_min_interval_s=0)
    mid, token = await _one_gpu_node(client, tokens, store)
    assert (await _report(client, token, {"nvidia_smi_xml": XML})).status == 200
    # An Xid in the kernel lines beside the same GPU document: recorded.
    r = await _report(client, token, {"kernel_log": XID79, "nvidia_smi_xml": _later(XML, 1)})
    assert (await r.json())["new_faults"] == 1
    with store.session() as s:  # a report with a finding leaves no digest to skip by
        assert s.get(NodeHeartbeat, mid).digests is None
    assert (await _report(client, token, {"nvidia_smi_xml": XML})).status == 200
    # The GPU's uncorrectable ECC count changed: read in full, recorded.
    r = await _report(client, token, {"nvidia_smi_xml": ECC.read_text()})
    assert (await r.json())["new_faults"] >= 1
    assert len(parses) == 4
    with store.session() as s:
        kinds = {f.kind for f in s.exec(select(HealthFault).where(HealthFault.machine_id == mid))}
        assert {"xid", "gpu-ecc"} <= kinds


async def test_the_quick_path_keeps_every_refusal(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    _health(client, report_min_interval_s=0)
    mid, token = await _one_gpu_node(client, tokens, store)
    body = {"nvidia_smi_xml": XML}
    assert (await _report(client, token, body)).status == 200
    # Too soon (the limit holds for a report that says nothing new).
    _health(client, report_min_interval_s=30)
    r = await _report(client, token, body)
    assert r.status == 429 and "report at most every 30 s" in (await r.json())["detail"]
    _health(client, report_min_interval_s=0)
    # The machine is no longer in use: 403.
    with store.session() as s:
        m = s.get(Machine, mid)
        state = m.state
        m.state = State.RELEASING.value
        s.add(m)
        s.commit()
    r = await _report(client, token, body)
    assert r.status == 403 and r.content_type == "application/problem+json"
    with store.session() as s:
        m = s.get(Machine, mid)
        m.state = state
        s.add(m)
        s.commit()
    assert (await _report(client, token, body)).status == 200
    # The token revoked (the node joined again with a new key): 401.
    with store.session() as s:
        peer = s.exec(select(WgPeer).where(WgPeer.machine_id == mid)).one()
        peer.node_token_hash = "revoked"
        s.add(peer)
        s.commit()
    r = await _report(client, token, body)
    assert r.status == 401 and "unknown or revoked" in (await r.json())["detail"]
    with store.session() as s:
        assert s.get(NodeHeartbeat, mid).reports == 2


async def test_the_memo_takes_unchanged_reports_and_the_round_writes_and_validates(
    api, parses
) -> None:  # type: ignore[no-untyped-def]
    """The health watch's memory (``ReportMemo``): unchanged reports cost no database call,
    the round writes their heartbeat in one statement and forgets a revoked node, whose next
    report is refused; a finding still goes the full path and is recorded."""
    from datetime import datetime

    from metald.errors import Unauthorized
    from metald.healthwatch.watch import HealthWatch
    from metald.limits import TooMany
    from metald.usecases.health import node_report
    from tests.healthwatch.helpers import FakeScheduler, workflow

    client, tokens, store = api
    mid, token = await _one_gpu_node(client, tokens, store)
    cfg = HealthConfig(report_min_interval_s=0)
    watch = HealthWatch(store, cfg, "i1", remediations=workflow(store, FakeScheduler(), cfg),
                        table=cfg.table())  # fmt: skip
    memo = watch.memo

    async def report(body: dict[str, Any], c: HealthConfig = cfg) -> dict[str, Any]:
        return await node_report(store, token, body, cfg=c, instance="i1", memo=memo)

    first = await report({"nvidia_smi_xml": XML})
    assert len(memo.by_token) == 1 and len(parses) == 1
    for n in range(1, 3):
        assert await report({"nvidia_smi_xml": _later(XML, n)}) == first
    assert len(parses) == 1
    with store.session() as s:  # not written yet
        assert s.get(NodeHeartbeat, mid).reports == 1
    t = datetime.now().astimezone()
    await watch.flush_reports()
    with store.session() as s:
        hb = s.get(NodeHeartbeat, mid)
        assert hb.reports == 3 and hb.last_at.timestamp() <= t.timestamp()
    await watch.flush_reports()  # nothing pending: nothing written
    with store.session() as s:
        assert s.get(NodeHeartbeat, mid).reports == 3
    # The limit on how often holds in memory too.
    with pytest.raises(TooMany):
        await report({"nvidia_smi_xml": XML}, HealthConfig(report_min_interval_s=30))
    # A finding: the full path, recorded, and nothing left to skip by.
    got = await report({"kernel_log": XID79, "nvidia_smi_xml": XML})
    assert got["new_faults"] == 1 and not memo.by_token and len(parses) == 2
    await report({"nvidia_smi_xml": XML})  # clean again: remembered
    assert len(memo.by_token) == 1
    # The token revoked: the next round forgets the node, its next report is refused.
    with store.session() as s:
        peer = s.exec(select(WgPeer).where(WgPeer.machine_id == mid)).one()
        peer.node_token_hash = "revoked"
        s.add(peer)
        s.commit()
    await watch.flush_reports()
    assert not memo.by_token
    with pytest.raises(Unauthorized):
        await report({"nvidia_smi_xml": XML})
