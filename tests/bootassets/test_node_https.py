"""The node image's HTTP client (bootassets/node/metald-node ``http``) over HTTPS: curl pinned
to metald's CA by ``NODE_CA`` (metald.ca= or the join info's ca), the bearer token never
following a redirect, nothing sent to a server it cannot authenticate. The mesh and health
loops and the join all go through ``http``. Runs the real function under busybox sh."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from aiohttp import web

from metald.boot import pki
from tests.bootassets.conftest import ROOT
from tests.inventory.test_agent_https import Serve, _capture, _redirecting, _tls, serve  # noqa: F401

SCRIPT = ROOT / "bootassets/node/metald-node"
pytestmark = pytest.mark.skipif(
    shutil.which("busybox") is None or shutil.which("curl") is None, reason="needs busybox, curl"
)


async def node_http(state: Path, pin: str, url: str, token: str = "node-token") -> str:
    state.mkdir(exist_ok=True)
    (state / "req.json").write_text('{"applied": 0}')
    body = (
        f". {SCRIPT}\nNODE_CA={pin}\n"
        f'http POST {url} "$STATE/req.json" {token}; echo "rc=$? status=$HTTP_STATUS"\n'
        'echo "error=$HTTP_ERROR"; cat "$STATE/http.body" 2>/dev/null; echo\n'
        "http_header X-Seen\n"
    )
    env = dict(os.environ, METALD_NODE_LIB="1", METALD_NODE_STATE=str(state))
    proc = await asyncio.create_subprocess_exec(
        "busybox", "sh", "-c", body, env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return out.decode()


def _mesh(tls: pki.BootTls, seen: list[dict[str, str]]) -> web.Application:
    app = web.Application()

    async def ca(request: web.Request) -> web.Response:
        return web.Response(body=tls.ca_pem)

    async def mesh(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        assert await request.json() == {"applied": 0}
        return web.json_response({"generation": 3}, headers={"X-Seen": "yes"})

    app.router.add_get("/boot/ca.pem", ca)
    app.router.add_post("/api/v1/mesh", mesh)
    return app


async def test_node_posts_over_https_pinned_to_metalds_ca(tmp_path: Path, serve: Serve) -> None:  # noqa: F811
    tls, ctx = _tls(tmp_path / "pki")
    seen: list[dict[str, str]] = []
    port = await serve(_mesh(tls, seen), ctx)
    out = await node_http(tmp_path / "s", tls.fingerprint, f"https://127.0.0.1:{port}/api/v1/mesh")
    assert "rc=0 status=200" in out and '"generation": 3' in out and "yes" in out, out
    assert seen[0]["Authorization"] == "Bearer node-token"
    assert seen[0]["User-Agent"] == "metald-node/1"
    assert not (tmp_path / "s" / "http.hdr").exists()  # the token file does not outlive the call


@pytest.mark.parametrize("pin", ["", "sha256:" + "cd" * 32])
async def test_node_sends_no_token_to_a_server_it_cannot_authenticate(
    tmp_path: Path,
    serve: Serve,  # noqa: F811
    pin: str,
) -> None:
    tls, ctx = _tls(tmp_path / "pki")
    seen: list[dict[str, str]] = []
    port = await serve(_mesh(tls, seen), ctx)
    out = await node_http(tmp_path / "s", pin, f"https://127.0.0.1:{port}/api/v1/mesh")
    assert seen == [], out
    assert ("rc=2" in out and "no sha256 CA pin" in out) if not pin else "not the pinned" in out


async def test_a_certificate_from_another_ca_gets_no_token(tmp_path: Path, serve: Serve) -> None:  # noqa: F811
    good, _ = _tls(tmp_path / "good")
    _, other = _tls(tmp_path / "other")
    seen: list[dict[str, str]] = []
    port = await serve(_mesh(good, seen), other)  # serves the pinned CA's PEM, not its cert
    out = await node_http(tmp_path / "s", good.fingerprint, f"https://127.0.0.1:{port}/api/v1/mesh")
    assert "rc=1" in out and seen == [], out


async def test_node_never_follows_a_redirect_with_its_token(tmp_path: Path, serve: Serve) -> None:  # noqa: F811
    tls, ctx = _tls(tmp_path / "pki")
    seen: list[dict[str, str]] = []
    elsewhere = await serve(_capture(seen), ctx)
    app = _redirecting(f"https://127.0.0.1:{elsewhere}")

    async def ca(request: web.Request) -> web.Response:
        return web.Response(body=tls.ca_pem)

    app.router.add_get("/boot/ca.pem", ca)
    port = await serve(app, ctx)
    out = await node_http(tmp_path / "s", tls.fingerprint, f"https://127.0.0.1:{port}/api/v1/mesh")
    assert "rc=0 status=307" in out, out  # an answer the caller treats as one, not followed
    assert seen == []
