"""HTTP boot: per-machine iPXE scripts and the boot assets, as aiohttp routes.

Unauthenticated on purpose: firmware has no token. Scripts carry only what the machine may
know; assets are the read-only assets folder, served by ``web.FileResponse`` (sendfile, HEAD,
Range, ETag/If-None-Match) after the same path checks TFTP applies.
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from metald.boot import metrics
from metald.boot.hooks import BootHooks, ScriptRefused
from metald.boot.ipxe import render_boot_script
from metald.boot.paths import PathRefused, safe_path

log = logging.getLogger(__name__)


def _mac_from(raw: str) -> str | None:
    h = raw.lower().replace(":", "").replace("-", "")
    if len(h) != 12 or any(c not in "0123456789abcdef" for c in h):
        return None
    return ":".join(h[i : i + 2] for i in range(0, 12, 2))


def boot_routes(hooks: BootHooks, assets_dir: Path, public_url: str) -> list[web.RouteDef]:
    root = Path(assets_dir).resolve()
    base = public_url.rstrip("/")

    async def script(request: web.Request) -> web.Response:
        mac = _mac_from(request.match_info["mac"])
        if mac is None:
            raise web.HTTPNotFound(text="not a MAC address\n")
        try:
            target = await hooks.boot_target(mac, client=request.remote)
        except ScriptRefused as e:
            metrics.http_boot.labels("refused").inc()
            log.warning("iPXE script for %s refused: %s", mac, e)
            raise web.HTTPForbidden(
                text=f"refused: {e}; only the address leased to this MAC gets its script\n"
            ) from None
        metrics.http_boot.labels(target.action.value).inc()
        log.info("iPXE script for %s: %s", mac, target.action.value)
        body = render_boot_script(target, mac=mac, public_url=base)
        return web.Response(
            text=body, content_type="text/plain", headers={"Cache-Control": "no-store"}
        )

    async def asset(request: web.Request) -> web.StreamResponse:
        try:
            path = safe_path(root, request.match_info["path"])
        except PathRefused as e:
            if e.reason == "not-found":
                raise web.HTTPNotFound() from None
            raise web.HTTPForbidden() from None
        return web.FileResponse(path)

    return [
        web.get("/boot/{mac}.ipxe", script),
        web.get("/boot/assets/{path:.+}", asset),  # aiohttp answers HEAD for GET routes
    ]
