"""``metalctl machines repairs`` against a real metald: open by hand, list with the part and
who took it, show the evidence, take, note; "repaired" without a commissioning profile says
what to do and changes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.metalctl.main import main
from tests.api_helpers import LoopbackApi


@pytest.fixture
def live(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        assert api.tokens is not None
        monkeypatch.setenv("METALD_URL", api.base)
        monkeypatch.setenv("METALD_TOKEN", api.tokens.technician)
        yield api


def test_repairs_from_the_command_line(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(
        ["machines", "repairs", "open", "node2", "--summary", "PSU2 smells burnt", "--part", "psu"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "(node2): open, machine broken" in out
    assert main(["machines", "repairs", "list", "-o", "json"]) == 0
    rid = json.loads(capsys.readouterr().out)["items"][0]["id"]
    assert main(["machines", "repairs", "take", rid[:8]]) == 0
    assert "taken, machine repairing" in capsys.readouterr().out
    assert main(["machines", "repairs", "note", rid, "swapped PSU2 for a spare"]) == 0
    capsys.readouterr()
    assert main(["machines", "repairs", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "MACHINE", "RACK", "STATUS", "FAULT", "PART", "TAKEN_BY", "FAILS", "ID",
    ]  # fmt: skip
    assert "node2" in table[1] and "technician:technician" in table[1] and "psu" in table[1]
    assert main(["machines", "repairs", "list", "--status", "closed"]) == 0
    assert "(0 of 0)" in capsys.readouterr().out
    assert main(["machines", "repairs", "show", rid]) == 0
    shown = capsys.readouterr().out
    assert "fault:     fatal technician on psu: PSU2 smells burnt" in shown
    assert "technician:technician: swapped PSU2 for a spare" in shown
    assert "actions:   note, repaired" in shown
    rc = main(["machines", "repairs", "repaired", rid])
    assert rc != 0 and "commissioning profile" in capsys.readouterr().err
    assert main(["machines", "repairs", "show", rid, "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "taken"  # nothing half-done


async def test_the_async_client_has_the_same_calls(live: LoopbackApi) -> None:
    from metald.client import ApiError
    from metald.client.aio import AsyncClient

    assert live.tokens is not None
    async with AsyncClient(live.base, live.tokens.technician) as c:
        r = await c.open_repair("node2", "fan 3 grinds", part="fan")
        assert (r["status"], r["parts"][0]["part"]) == ("open", "fan")
        assert [x["id"] async for x in c.repairs(rack="none")] == []
        assert [x["id"] async for x in c.repairs(status="all")] == [r["id"]]
        assert (await c.take_repair(r["id"][:8]))["status"] == "taken"
        assert (await c.note_repair(r["id"], "new fan"))["notes"][0]["text"] == "new fan"
        assert (await c.repair(r["id"]))["machine"]["state"] == "repairing"
        try:
            await c.repaired(r["id"], "fan swapped")
        except ApiError as e:
            assert e.status == 422
        else:
            raise AssertionError("repaired without a commissioning profile")
    async with AsyncClient(live.base, live.tokens.orchestrator) as o:
        try:
            await o.repair(r["id"])
        except ApiError as e:
            assert e.status == 403
        else:
            raise AssertionError("an orchestrator read a repair")
