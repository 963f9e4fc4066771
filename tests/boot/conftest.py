from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from metald.store.db import Store

IPXE_DIR = Path("/usr/lib/ipxe")


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    """Copies (not symlinks: the servers refuse links out of the root) of iPXE's binaries."""
    d = tmp_path / "assets"
    d.mkdir()
    for name in ("undionly.kpxe", "ipxe.efi", "snponly.efi"):
        src = IPXE_DIR / name
        if src.exists():
            shutil.copy(src, d / name)
    return d


@pytest.fixture
def sqlite_store(tmp_path: Path):
    """SQLite only, for what is SQLite-specific (a busy database file). Everything else uses
    the suite-wide ``store`` fixture, which runs on SQLite and PostgreSQL."""
    s = Store(f"sqlite:///{tmp_path / 'metald.db'}")
    s.migrate()
    yield s
    s.close()
