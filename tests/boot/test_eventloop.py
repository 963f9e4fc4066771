"""The event-loop choice, and boot assets served by the kernel's sendfile on uvloop too
(uvloop leaves ``loop.sendfile`` unimplemented: aiohttp would read every asset in a thread)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from metald.boot import eventloop
from metald.boot.hooks import MemoryBootHooks
from metald.boot.http import boot_routes
from metald.config import ConfigError, load_config

uvloop = pytest.importorskip("uvloop")


def test_choices_and_config_key(tmp_path: Path) -> None:
    assert eventloop.loop_factory("asyncio") == ("asyncio", asyncio.new_event_loop)
    name, factory = eventloop.loop_factory("uvloop")
    assert name == "uvloop" and issubclass(factory, uvloop.Loop)
    assert eventloop.loop_factory()[0] == "asyncio"  # the default
    with pytest.raises(ValueError, match="expected one of"):
        eventloop.loop_factory("trio")
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'state_dir = "{tmp_path}"\n')
    assert load_config(cfg, environ={}).event_loop == "asyncio"
    assert load_config(cfg, environ={"METALD_EVENT_LOOP": "uvloop"}).event_loop == "uvloop"
    with pytest.raises(ConfigError, match="event_loop"):
        load_config(cfg, environ={"METALD_EVENT_LOOP": "trio"})


def test_non_socket_transports_fall_back() -> None:
    """TLS and other transports: NotImplementedError, which aiohttp answers with its
    write-through fallback (the bytes must pass through the TLS layer)."""

    class Other(asyncio.Transport):
        pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(NotImplementedError):
            await loop.sendfile(Other(), open(os.devnull, "rb"))  # noqa: SIM115

    eventloop.run(main(), "uvloop")


def test_assets_over_uvloop_use_kernel_sendfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "assets"
    root.mkdir()
    # Bigger than loopback's socket buffers together, so sendfile meets a full socket and
    # waits for it to drain (the EAGAIN path) more than once.
    body = os.urandom(16 << 20)
    (root / "initrd").write_bytes(body)
    native: list[int] = []
    real = eventloop.sendfile_native

    async def counted(*a: Any) -> int:
        n = await real(*a)
        native.append(n)
        return n

    async def no_fallback(*a: Any) -> None:
        raise AssertionError("aiohttp fell back to reading the file through Python")

    waits: list[int] = []
    real_wait = eventloop._Writable.wait

    async def counted_wait(self: eventloop._Writable) -> None:
        waits.append(self.fd)
        await real_wait(self)

    monkeypatch.setattr(eventloop, "sendfile_native", counted)
    monkeypatch.setattr(eventloop._Writable, "wait", counted_wait)
    monkeypatch.setattr(web.FileResponse, "_sendfile_fallback", no_fallback)

    async def main() -> None:
        assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        app = web.Application()
        app.add_routes(boot_routes(MemoryBootHooks(), root, "http://127.0.0.1/"))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://127.0.0.1:{port}/boot/assets/initrd"
        try:
            conn = aiohttp.TCPConnector(limit=1)  # one connection: keep-alive after sendfile
            async with aiohttp.ClientSession(connector=conn) as s:
                async with s.get(url) as r:
                    assert r.status == 200
                    assert await r.read() == body
                async with s.get(url, headers={"Range": "bytes=1000-1999"}) as r:
                    assert r.status == 206
                    assert await r.read() == body[1000:2000]
                async with s.get(url, headers={"Range": "bytes=-4096"}) as r:
                    assert await r.read() == body[-4096:]
                async with s.head(url) as r:
                    assert r.status == 200 and int(r.headers["Content-Length"]) == len(body)
                async with s.get(url + "-missing") as r:
                    assert r.status == 404
        finally:
            await runner.cleanup()

    eventloop.run(main(), "uvloop")
    assert native == [len(body), 1000, 4096]
    assert waits  # the socket filled up at least once, and the transfer went on
