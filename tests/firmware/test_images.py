"""The verified image store (metald.firmware.images): an image is kept only once its SHA-256
matches, a download too large or answered with an error keeps nothing, an image altered on
disk is found out before it is offered, and the route serves kept images only."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from metald.firmware.images import FirmwareImages, ImageRefused


@pytest.fixture
async def origin() -> AsyncIterator[tuple[str, dict[str, bytes]]]:
    files: dict[str, bytes] = {}

    async def get(request: web.Request) -> web.Response:
        data = files.get(request.match_info["name"])
        return web.Response(body=data) if data is not None else web.Response(status=404)

    runner = web.AppRunner(web.Application(), access_log=None)
    runner.app.router.add_get("/{name}", get)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://user:secret@127.0.0.1:{runner.addresses[0][1]}", files
    finally:
        await runner.cleanup()


async def test_download_verify_and_serve(tmp_path: Path, origin: Any, aiohttp_client: Any) -> None:
    base, files = origin
    data = b"firmware" * 1000
    sha = hashlib.sha256(data).hexdigest()
    files["ok.bin"] = data
    store = FirmwareImages(tmp_path / "fw", max_bytes=1 << 20, timeout_s=5)
    path = await store.ensure(f"{base}/ok.bin", sha)
    assert path.read_bytes() == data and path.name == f"{sha}.bin"
    # Kept: the origin is not asked again.
    del files["ok.bin"]
    assert await store.ensure(f"{base}/ok.bin", sha) == path
    app = web.Application()
    app.router.add_routes(store.routes())
    client = await aiohttp_client(app)
    r = await client.get(f"/boot/firmware/{sha}.bin?update=u1")
    assert r.status == 200 and await r.read() == data
    for bad in ("0" * 64, "../../etc/passwd", sha.upper()):
        r = await client.get(f"/boot/firmware/{bad}.bin")
        assert r.status == 404, bad
    # Altered on disk: found before it is offered, removed, fetched again next time.
    path.write_bytes(b"evil")
    with pytest.raises(ImageRefused, match="altered on disk"):
        await store.ensure(f"{base}/ok.bin", sha)
    assert not path.exists()


async def test_refusals_keep_nothing(tmp_path: Path, origin: Any) -> None:
    base, files = origin
    store = FirmwareImages(tmp_path / "fw", max_bytes=1000, timeout_s=5)
    files["big.bin"] = b"x" * 2000
    files["other.bin"] = b"not what the baseline says"
    with pytest.raises(ImageRefused, match="larger than"):
        await store.ensure(f"{base}/big.bin", hashlib.sha256(b"x" * 2000).hexdigest())
    with pytest.raises(ImageRefused, match="not the baseline's") as e:
        await store.ensure(f"{base}/other.bin", "a" * 64)
    assert "secret" not in str(e.value.detail)  # URL credentials never shown
    with pytest.raises(ImageRefused, match="HTTP 404"):
        await store.ensure(f"{base}/missing.bin", "a" * 64)
    with pytest.raises(ImageRefused, match="cannot read"):
        await store.ensure(f"file://{tmp_path}/nope.bin", "a" * 64)
    assert list((tmp_path / "fw").iterdir()) == []  # no partial download left behind
