"""metald's TFTP server against a third-party Python client, tftpy (a dev dependency only: the
product does not use it). Complements tests/boot/test_tftp.py's atftp and tftp-hpa runs."""

from __future__ import annotations

import asyncio
import filecmp
import logging
import shutil
from pathlib import Path

import pytest
import tftpy

from metald.boot.tftp.server import TftpServer

IPXE = Path("/usr/lib/ipxe")


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    d = tmp_path / "assets"
    d.mkdir()
    for name in ("ipxe.efi", "undionly.kpxe"):
        if not (IPXE / name).exists():
            pytest.skip(f"{IPXE / name} is missing (Debian package ipxe; run scripts/bootstrap)")
        shutil.copy(IPXE / name, d / name)
    return d


@pytest.fixture
async def server(assets: Path):  # type: ignore[no-untyped-def]
    s = TftpServer(assets, host="127.0.0.1", port=0)
    await s.start()
    yield s
    await s.stop()


def _fetch(port: int, name: str, out: Path, options: dict[str, int]) -> None:
    logging.getLogger("tftpy").setLevel(logging.WARNING)
    tftpy.TftpClient("127.0.0.1", port, options=options).download(name, str(out), timeout=5)


@pytest.mark.parametrize(
    "options",
    [{}, {"blksize": 1428, "tsize": 0}, {"blksize": 512}, {"blksize": 8}],
    ids=["plain", "blksize-1428-tsize", "blksize-512", "blksize-8"],
)
async def test_tftpy_downloads_with_options(
    server: TftpServer, assets: Path, tmp_path: Path, options: dict[str, int]
) -> None:
    out = tmp_path / "got"
    await asyncio.to_thread(_fetch, server.bound_port, "undionly.kpxe", out, options)
    assert filecmp.cmp(out, assets / "undionly.kpxe", shallow=False)


async def test_tftpy_is_told_why_a_file_is_refused(server: TftpServer, tmp_path: Path) -> None:
    for name in ("nope.efi", "../etc/passwd"):
        with pytest.raises(tftpy.TftpException):
            await asyncio.to_thread(_fetch, server.bound_port, name, tmp_path / "x", {})
