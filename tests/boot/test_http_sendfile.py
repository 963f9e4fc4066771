"""Boot assets sent from worker threads (metald.boot.sendfile) and checked on the loop
(metald.boot.http.AssetResponse): the same answers as aiohttp's FileResponse, every byte,
threads never held by a slow client, the socket handed back non-blocking."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from metald.boot import sendfile
from metald.boot.hooks import MemoryBootHooks
from metald.boot.http import AssetResponse, boot_routes

BIG = 6 << 20  # above sendfile.MIN_BYTES and SLICE: several slices


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    root = tmp_path / "assets"
    root.mkdir()
    (root / "initrd").write_bytes(os.urandom(BIG))
    (root / "small.ipxe").write_bytes(b"#!ipxe\n" * 100)
    (root / ".hidden").write_bytes(b"secret")
    return root


@pytest.fixture(autouse=True)
def _stats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sendfile, "stats", dict.fromkeys(sendfile.stats, 0))
    monkeypatch.setattr(sendfile, "_busy", 0)


async def _serve(root: Path) -> AsyncIterator[str]:
    app = web.Application()
    app.add_routes(boot_routes(MemoryBootHooks(), root, "http://127.0.0.1/"))

    async def plain(request: web.Request) -> web.StreamResponse:
        # aiohttp's own FileResponse on the same file: what AssetResponse must answer alike.
        return web.FileResponse(root / request.match_info["name"])

    async def flags(request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("socket")  # type: ignore[union-attr]
        nonblocking = bool(fcntl.fcntl(sock.fileno(), fcntl.F_GETFL) & os.O_NONBLOCK)
        return web.Response(text=f"{nonblocking}")

    app.add_routes([web.get("/plain/{name}", plain), web.get("/flags", flags)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def base(assets: Path) -> AsyncIterator[str]:
    async for url in _serve(assets):
        yield url


async def test_a_big_asset_goes_out_from_a_thread_whole_and_the_socket_is_nonblocking_again(
    base: str, assets: Path
) -> None:
    body = (assets / "initrd").read_bytes()
    conn = aiohttp.TCPConnector(limit=1)  # one connection: keep-alive after the thread
    async with aiohttp.ClientSession(connector=conn) as s:
        async with s.get(f"{base}/boot/assets/initrd") as r:
            assert r.status == 200 and await r.read() == body
        async with s.get(f"{base}/flags") as r:
            assert await r.text() == "True"  # the loop got its socket back non-blocking
        async with s.get(f"{base}/boot/assets/initrd", headers={"Range": "bytes=5-"}) as r:
            assert r.status == 206 and await r.read() == body[5:]
    assert sendfile.stats["threaded"] == 2  # both went to a thread (whole, unless it was slow)
    assert 0 < sendfile.stats["threaded_bytes"] <= 2 * BIG - 5
    assert sendfile._busy == 0


async def test_small_assets_and_no_threads_stay_on_the_loop(
    base: str, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/boot/assets/small.ipxe") as r:
            assert await r.read() == (assets / "small.ipxe").read_bytes()
        monkeypatch.setattr(sendfile, "THREADS", 0)  # boot.http_sendfile_threads = 0
        async with s.get(f"{base}/boot/assets/initrd") as r:
            assert await r.read() == (assets / "initrd").read_bytes()
    assert sendfile.stats["threaded"] == 0


REQUESTS: list[tuple[str, dict[str, str]]] = [
    ("GET", {}),
    ("HEAD", {}),
    ("GET", {"Range": "bytes=0-0"}),
    ("GET", {"Range": "bytes=1000-1999"}),
    ("GET", {"Range": "bytes=-4096"}),
    ("GET", {"Range": "bytes=99999999-"}),
    ("GET", {"Range": "bytes=oops"}),
    ("GET", {"If-None-Match": "*"}),
    ("GET", {"If-Match": '"nope"'}),
    ("GET", {"If-Modified-Since": "Wed, 01 Jan 2098 00:00:00 GMT"}),
    ("GET", {"If-Unmodified-Since": "Wed, 01 Jan 2000 00:00:00 GMT"}),
    ("GET", {"If-Range": "Wed, 01 Jan 2000 00:00:00 GMT", "Range": "bytes=0-9"}),
    ("GET", {"Accept-Encoding": "gzip, br"}),
]


@pytest.mark.parametrize("name", ["initrd", "small.ipxe"])
async def test_the_same_answers_as_aiohttps_file_response(
    base: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Status, body and the headers a client acts on, for each conditional and range case,
    with the thread path (initrd) and without (small file)."""
    keys = ("Content-Length", "Content-Range", "ETag", "Last-Modified", "Accept-Ranges")
    keys += ("Content-Type", "Content-Encoding")
    async with aiohttp.ClientSession() as s:
        for method, headers in REQUESTS:
            got = []
            for url in (f"{base}/boot/assets/{name}", f"{base}/plain/{name}"):
                async with s.request(method, url, headers=headers) as r:
                    got.append((r.status, await r.read(), [r.headers.get(k) for k in keys]))
            assert got[0] == got[1], (method, headers)
    if name == "initrd":
        assert sendfile.stats["threaded"] >= 2  # the plain GET and the open range went there


async def test_missing_and_hidden_assets_are_still_problems(base: str) -> None:
    async with aiohttp.ClientSession() as s:
        for path, status in (("nothing", 404), (".hidden", 404), ("no/such", 404)):
            async with s.get(f"{base}/boot/assets/{path}") as r:
                assert r.status == status
                assert r.content_type == "application/problem+json"


async def test_a_stalled_client_hands_its_transfer_back_to_the_loop(
    base: str, assets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that stops reading holds a thread for at most SLICE_SECONDS: the rest of its
    transfer waits on the loop (at no cost), and it still gets every byte when it reads."""
    monkeypatch.setattr(sendfile, "SLICE_SECONDS", 0.2)
    body = (assets / "initrd").read_bytes()
    port = int(base.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # A small receive buffer, so the server's socket fills up while nobody reads.
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    writer.write(b"GET /boot/assets/initrd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    for _ in range(200):
        await asyncio.sleep(0.05)
        if sendfile.stats["handed_back"]:
            break
    assert sendfile.stats["handed_back"] == 1  # the thread gave up on the stalled client
    assert sendfile._busy == 0  # and is free for others while the client still waits
    data = await reader.read()
    writer.close()
    head, _, got = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and got == body


async def test_a_client_gone_mid_transfer_leaves_no_thread_or_descriptor(
    base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = len(os.listdir("/proc/self/fd"))
    port = int(base.rsplit(":", 1)[1])
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /boot/assets/initrd HTTP/1.1\r\nHost: x\r\n\r\n")
        await reader.readexactly(64 << 10)  # the transfer is under way
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )
        writer.close()  # a reset, with the server's send in flight
    for _ in range(100):
        await asyncio.sleep(0.05)
        if sendfile._busy == 0 and len(os.listdir("/proc/self/fd")) <= before:
            break
    assert sendfile._busy == 0
    assert len(os.listdir("/proc/self/fd")) <= before


def test_the_config_key_sets_the_threads(tmp_path: Path) -> None:
    from metald.config import load_config

    cfg = tmp_path / "m.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n[boot]\nhttp_sendfile_threads = 3\n')
    assert load_config(cfg, environ={}).boot.http_sendfile_threads == 3
    env = {"METALD_BOOT__HTTP_SENDFILE_THREADS": "0"}
    assert load_config(cfg, environ=env).boot.http_sendfile_threads == 0
    old = sendfile.THREADS
    try:
        sendfile.configure(3)
        assert sendfile.THREADS == 3
    finally:
        sendfile.configure(old)


def test_asset_response_is_a_file_response() -> None:
    # Anything that treats boot assets as aiohttp file responses (middlewares) still does.
    assert issubclass(AssetResponse, web.FileResponse)
    _: Any = AssetResponse


async def test_the_boot_plane_freezes_its_heap_and_sets_the_threads_without_dhcp(
    tmp_path: Path,
) -> None:
    """With DHCP off (HTTP and TFTP only) the boot plane still takes the start-up heap out of
    the cyclic GC (it cost HTTP boot ~10 % of its CPU in gc_collect_main), and applies
    boot.http_sendfile_threads."""
    import gc

    from metald.boot.plane import BootPlane
    from metald.config import load_config
    from metald.store.db import Store

    (tmp_path / "assets").mkdir()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    conf = tmp_path / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[boot]\nenabled = true\ndhcp_mode = "off"\n'
        f'interfaces = ["lo"]\nserver_address = "127.0.0.1"\ntftp_port = {port}\n'
        f'assets_dir = "{tmp_path / "assets"}"\nrouter_advertisements = false\n'
        "http_sendfile_threads = 5\n"
    )
    cfg = load_config(conf, environ={})
    store = Store(cfg.store_url)
    old = sendfile.THREADS
    gc.unfreeze()  # whatever an earlier test in this process froze
    plane = BootPlane(cfg, store, MemoryBootHooks())
    try:
        assert sendfile.THREADS == 5
        assert gc.get_freeze_count() == 0
        await plane.start()
        assert gc.get_freeze_count() > 0
    finally:
        await plane.stop()
        store.close()
        sendfile.configure(old)
