"""The discovery/deploy agent (busybox sh) talks HTTPS to metald pinned to metald's CA by the
fingerprint on its kernel command line (metald.ca=), and never follows a redirect with its
token: busybox wget, which it used before, follows one and sends Authorization along."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from metald.boot import pki
from tests.inventory.receiver import Receiver
from tests.inventory.test_agent import BUSYBOX, fake_tool, run_agent, xe9680
from tests.inventory.test_normalize import IPMITOOL
from tests.test_daemon import free_port
from tests.test_listeners import boot_config, running  # noqa: F401  (fixture)

CURL = shutil.which("curl")
pytestmark = [
    pytest.mark.skipif(BUSYBOX is None, reason="busybox is not installed"),
    pytest.mark.skipif(CURL is None, reason="curl is not installed"),
]
Serve = Callable[[web.Application, ssl.SSLContext | None], Awaitable[int]]


@pytest.fixture
def image_bin(tmp_path: Path) -> Path:
    """Every busybox applet and curl, as in the discovery image."""
    import subprocess

    d = tmp_path / "bin"
    d.mkdir()
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        (d / applet).symlink_to(BUSYBOX)  # type: ignore[arg-type]
    (d / "curl").symlink_to(CURL)  # type: ignore[arg-type]
    fake_tool(d, "ipmitool", _write(tmp_path / "lan.txt", IPMITOOL))
    return d


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(app: web.Application, tls: ssl.SSLContext | None) -> int:
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
        return port

    yield start
    for r in runners:
        await r.cleanup()


def _tls(state: Path) -> tuple[pki.BootTls, ssl.SSLContext]:
    tls = pki.ensure_boot_tls(state, "127.0.0.1")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)
    return tls, ctx


def _metald(rec: Receiver, ca_pem: bytes) -> web.Application:
    app = rec.app()

    async def ca(request: web.Request) -> web.Response:
        return web.Response(body=ca_pem)

    app.router.add_get("/boot/ca.pem", ca)
    return app


def _cmdline(url: str, pin: str | None) -> str:
    ca = f" metald.ca={pin}" if pin else ""
    return f"console=ttyS0 metald.url={url} metald.token=agent-token metald.machine=m-1{ca}"


async def test_agent_posts_over_https_pinned_to_metalds_ca(
    tmp_path: Path, image_bin: Path, serve: Serve
) -> None:
    tls, ctx = _tls(tmp_path / "state")
    rec = Receiver(actions=[{"action": "poweroff"}])
    port = await serve(_metald(rec, tls.ca_pem), ctx)
    url = f"https://127.0.0.1:{port}/"
    rc, log = await run_agent(
        xe9680(tmp_path / "root"), image_bin, port, cmdline=_cmdline(url, tls.fingerprint)
    )
    assert rc == 0, log
    assert "] inventory posted (" in log and "] dry run: would poweroff" in log
    assert rec.headers[0]["Authorization"] == "Bearer agent-token"
    assert rec.headers[0]["User-Agent"].startswith("metald-agent/")
    hdr = tmp_path / "root" / "run" / "auth.hdr"
    assert hdr.stat().st_mode & 0o077 == 0  # the token file is the agent's only


@pytest.mark.parametrize("pin", [None, "sha256:" + "ab" * 32, "md5:abc"])
async def test_agent_sends_no_token_to_a_server_it_cannot_authenticate(
    tmp_path: Path, image_bin: Path, serve: Serve, pin: str | None
) -> None:
    """No pin, or another CA answering metald's address (a MITM with its own certificate):
    the agent stops before its first token-carrying call."""
    tls, ctx = _tls(tmp_path / "state")
    rec = Receiver()
    port = await serve(_metald(rec, tls.ca_pem), ctx)
    rc, log = await run_agent(
        xe9680(tmp_path / "root"),
        image_bin,
        port,
        cmdline=_cmdline(f"https://127.0.0.1:{port}/", pin),
        METALD_MAX_TRIES="1",
    )
    assert rc != 0, log
    assert rec.headers == [] and rec.posts == []
    assert ("not the pinned" in log) if pin and pin.startswith("sha256:") else ("pin" in log)


async def test_a_ca_file_swapped_after_the_pin_check_is_not_trusted(
    tmp_path: Path, image_bin: Path, serve: Serve
) -> None:
    """The pin is checked, then curl trusts that CA only: a server with a certificate from
    another CA (whose PEM it serves at /boot/ca.pem) gets no token even if the pin matched
    a CA served elsewhere."""
    good, _ = _tls(tmp_path / "good")
    _, other_ctx = _tls(tmp_path / "other")
    rec = Receiver()
    port = await serve(_metald(rec, good.ca_pem), other_ctx)  # serves the right CA's PEM
    rc, log = await run_agent(
        xe9680(tmp_path / "root"),
        image_bin,
        port,
        cmdline=_cmdline(f"https://127.0.0.1:{port}/", good.fingerprint),
        METALD_MAX_TRIES="1",
    )
    assert rc != 0, log
    assert rec.posts == [] and rec.headers == []
    assert "inventory post failed" in log


def _redirecting(to: str) -> web.Application:
    app = web.Application()

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(to + request.path)

    app.router.add_route("*", "/api/v1/{tail:.+}", moved)
    return app


def _capture(seen: list[dict[str, str]]) -> web.Application:
    app = web.Application()

    async def grab(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"action": "poweroff"})

    app.router.add_route("*", "/{tail:.*}", grab)
    return app


async def test_a_redirect_never_carries_the_token_elsewhere(
    tmp_path: Path, image_bin: Path, serve: Serve
) -> None:
    """metald's address answers 307 to another server: over pinned HTTPS the agent does not
    follow (the other server sees nothing). busybox wget, the client before this, follows it
    and hands the other server the Authorization header: shown here over plain HTTP, the
    agent's path when metald.url is http://."""
    tls, ctx = _tls(tmp_path / "state")
    seen: list[dict[str, str]] = []
    elsewhere = await serve(_capture(seen), None)
    app = _redirecting(f"http://127.0.0.1:{elsewhere}")

    async def ca(request: web.Request) -> web.Response:
        return web.Response(body=tls.ca_pem)

    app.router.add_get("/boot/ca.pem", ca)
    https_port = await serve(app, ctx)
    rc, log = await run_agent(
        xe9680(tmp_path / "root"),
        image_bin,
        https_port,
        cmdline=_cmdline(f"https://127.0.0.1:{https_port}/", tls.fingerprint),
        METALD_MAX_TRIES="1",
    )
    assert rc != 0, log
    assert "HTTP/1.1 307" in log
    assert seen == []
    # the old client, busybox wget, on the same redirect over plain HTTP
    plain_port = await serve(_redirecting(f"http://127.0.0.1:{elsewhere}"), None)
    await run_agent(
        xe9680(tmp_path / "root2"),
        image_bin,
        plain_port,
        cmdline=_cmdline(f"http://127.0.0.1:{plain_port}/", None),
        METALD_MAX_TRIES="1",
    )
    assert seen and seen[0].get("Authorization") == "Bearer agent-token"


async def test_metald_urls_over_plain_http_get_no_token_from_an_https_agent(
    tmp_path: Path, image_bin: Path, serve: Serve
) -> None:
    """An https agent whose metald stops answering goes on with metald.urls=, but never to a
    plain http:// one (curl --proto =https)."""
    seen: list[dict[str, str]] = []
    plain = await serve(_capture(seen), None)
    tls, ctx = _tls(tmp_path / "state")
    app = web.Application()

    async def ca(request: web.Request) -> web.Response:
        return web.Response(body=tls.ca_pem)

    async def hang_up(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()  # the instance dies mid-call: no answer
        return web.Response()

    app.router.add_get("/boot/ca.pem", ca)
    app.router.add_route("*", "/api/v1/{tail:.+}", hang_up)
    port = await serve(app, ctx)
    cmd = _cmdline(f"https://127.0.0.1:{port}/", tls.fingerprint)
    rc, log = await run_agent(
        xe9680(tmp_path / "root"),
        image_bin,
        port,
        cmdline=cmd + f" metald.urls=http://127.0.0.1:{plain}",
        METALD_MAX_TRIES="1",
    )
    assert rc != 0, log
    assert f"going on with http://127.0.0.1:{plain}" in log  # it did fail over
    assert seen == []


async def test_the_real_agent_enrolls_through_metalds_own_ca(
    tmp_path: Path,
    image_bin: Path,
    running,  # type: ignore[no-untyped-def]  # noqa: F811
) -> None:
    """End to end on loopback: metald with [boot] tls_auto makes its CA, serves the discovery
    script over HTTPS with metald.ca= on the kernel command line, and the real agent, given
    that command line, pins the CA and posts its inventory to metald over HTTPS."""
    import re

    from metald import machines
    from metald.config import load_config
    from metald.lifecycle import Trigger

    assets = tmp_path / "assets"
    assets.mkdir()
    port = free_port()
    cfg = load_config(
        boot_config(
            tmp_path,
            f'http_listen = "127.0.0.1:{port}"\ntls_auto = true\n',
            assets=str(assets),
        )
    )
    d = await running(cfg)
    with d.store.session() as s:  # a machine metald sends to inspection (discovery, token)
        m = machines.create_machine(s, macs=["52:54:00:00:00:aa"], actor="test")
        machines.transition(s, m.id, Trigger.INSPECT, actor="test")
    trust = ssl.create_default_context(cafile=str(tmp_path / "state" / pki.CA_CERT))
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"https://127.0.0.1:{port}/boot/52:54:00:00:00:aa.ipxe", ssl=trust) as r,
    ):
        script = await r.text()
    kernel = next(line for line in script.splitlines() if line.startswith("kernel "))
    args = dict(re.findall(r"(metald\.[a-z]+)=(\S+)", kernel))
    assert args["metald.url"] == f"https://127.0.0.1:{port}" and "metald.token" in args
    cmdline = " ".join(f"{k}={v}" for k, v in args.items())
    _rc, log = await run_agent(
        xe9680(tmp_path / "root"), image_bin, port, cmdline=cmdline, METALD_MAX_TRIES="3"
    )
    assert "] inventory posted (" in log, log
    with d.store.session() as s:
        assert machines.get_machine(s, m.id).inventory is not None
