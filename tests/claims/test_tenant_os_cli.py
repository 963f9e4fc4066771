"""``metalctl claims create --user-data/--network/--storage`` against a real metald: the files
go into the claim body as they are (YAML read for the requests), and the claim shows the
user-data's digest, never its content."""

from __future__ import annotations

import hashlib
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
        monkeypatch.setenv("METALD_TOKEN", api.tokens.admin)
        yield api


def test_claim_with_user_data_and_storage_files(live: LoopbackApi, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    ud = tmp_path / "user-data"
    ud.write_text("#cloud-config\npackages: [htop]\n")
    storage = tmp_path / "storage.yaml"
    storage.write_text("root:\n  hints:\n    name: vda\n")
    sha = "ab" * 32
    assert main(["images", "create", "deb", "--url", "http://x.test/d.raw", "--sha256", sha]) == 0
    capsys.readouterr()
    argv = ["claims", "create", "--tenant", "globex", "--count", "1", "--image", "deb",
            "--user-data", str(ud), "--storage", str(storage), "-o", "json"]  # fmt: skip
    rc = main(argv)
    out, err = capsys.readouterr()
    # The seeded machines inventoried no disks: the layout does not fit, and says so.
    assert rc != 0 and "the machine's inventory has no disks" in err, (out, err)
    assert main(argv[: argv.index("--storage")] + ["-o", "json"]) == 0
    claim = json.loads(capsys.readouterr().out)
    assert claim["user_data"]["sha256"] == hashlib.sha256(ud.read_bytes()).hexdigest()
    assert "htop" not in json.dumps(claim)
