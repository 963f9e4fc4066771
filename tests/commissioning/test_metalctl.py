"""``metalctl machines commissioning`` and ``machines commission`` against a real metald."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from metald.metalctl.main import main
from metald.store.models import CommissioningResult, CommissioningRun, Machine
from tests.api_helpers import LoopbackApi


@pytest.fixture
def live(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        assert api.tokens is not None
        monkeypatch.setenv("METALD_URL", api.base)
        monkeypatch.setenv("METALD_TOKEN", api.tokens.technician)
        yield api


def _seed_failed_run(api: LoopbackApi) -> None:
    with api.store.session() as s:
        m = s.exec(Machine.__table__.select().where(Machine.name == "node2")).first()  # type: ignore[attr-defined]
        run = CommissioningRun(
            machine_id=m.id,
            profile="xe9680",
            status="failed",
            requested_by="t",
            summary="smart: /dev/nvme0 has 7 NVMe media errors",
        )
        s.add(run)
        s.flush()
        s.add(
            CommissioningResult(
                run_id=run.id,
                check="smart",
                status="failed",
                agent_status="ran",
                duration_s=2.0,
                sentence="/dev/nvme0 has 7 NVMe media errors",
                raw='{"media_errors": 7}',
            )
        )
        s.commit()


def test_commissioning_shows_last_run_and_raw(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["machines", "commissioning", "node2"]) == 0
    assert "never commissioned" in capsys.readouterr().out
    _seed_failed_run(live)
    assert main(["machines", "commissioning", "node2"]) == 0
    out = capsys.readouterr().out
    assert "xe9680  failed" in out
    assert "why: smart: /dev/nvme0 has 7 NVMe media errors" in out
    assert "smart       failed   2.0s  /dev/nvme0 has 7 NVMe media errors" in out
    assert main(["machines", "commissioning", "node2", "--raw", "smart"]) == 0
    assert capsys.readouterr().out.strip() == '{"media_errors": 7}'
    assert main(["machines", "commissioning", "node2", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["last"]["status"] == "failed"


def test_commission_without_a_profile_says_what_to_do(live: LoopbackApi, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = main(["machines", "commission", "node2"])
    err = capsys.readouterr().err
    assert rc != 0 and "commissioning profile" in err
