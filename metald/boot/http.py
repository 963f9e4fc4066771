"""HTTP boot: per-machine iPXE scripts and the boot assets, as aiohttp routes.

Unauthenticated on purpose: firmware has no token. Scripts carry only what the machine may
know; assets are the read-only assets folder, served by ``web.FileResponse`` (sendfile, HEAD,
Range, ETag/If-None-Match) after the same path checks TFTP applies, hidden (dot) files and
folders excepted. The assets folder is never the state folder (``config.assets_root_problem``).
Errors are problem+json, like the rest of the API.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web, web_fileresponse

from metald.boot import metrics, sendfile
from metald.boot.hooks import BootHooks, ScriptRefused
from metald.boot.ipxe import REFUSED, SIGNATURES, SignedAssets, render_boot_script
from metald.boot.paths import PathRefused, safe_path
from metald.problem import problem

if TYPE_CHECKING:
    from metald.boot.signing import AssetSigner

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _mac_from(raw: str) -> str | None:
    h = raw.lower().replace(":", "").replace("-", "")
    if len(h) != 12 or any(c not in "0123456789abcdef" for c in h):
        return None
    return ":".join(h[i : i + 2] for i in range(0, 12, 2))


#: Paths that accept a token from a machine (the agent API, joins, mesh and health reports):
#: refused over plain HTTP when ``[boot] require_https`` is on.
TOKEN_PATHS = frozenset({"/api/v1/join", "/api/v1/mesh", "/api/v1/health/report"})
TOKEN_PREFIXES = ("/api/v1/agent/",)


def plain_http_refused(request: web.Request, what: str) -> web.Response:
    metrics.http_boot.labels("refused").inc()
    log.warning("refused %s over plain HTTP from %s", request.path, request.remote)
    return problem(
        403,
        "HTTPS required",
        f"{what} is served over HTTPS only (boot.require_https): use the https:// URL of the "
        f"provisioning listener, which the machine's kernel command line (metald.url) carries "
        f"when it booted metald's iPXE",
        instance=request.path,
    )


def require_https_middleware() -> Any:
    """Middleware: answer 403 problem+json to a request over plain HTTP on a path that takes a
    token, before authentication reads it (the token has crossed the network in clear by then,
    but it is refused, so a sniffer cannot use a request that metald would have answered)."""

    @web.middleware
    async def mw(request: web.Request, handler: Handler) -> web.StreamResponse:
        p = request.path
        if not request.secure and (p in TOKEN_PATHS or p.startswith(TOKEN_PREFIXES)):
            return plain_http_refused(request, p)
        return await handler(request)

    return mw


def boot_routes(
    hooks: BootHooks,
    assets_dir: Path,
    public_url: str,
    *,
    require_https: bool = False,
    ca_pem: bytes | None = None,
    signed: SignedAssets | None = None,
    signer: AssetSigner | None = None,
) -> list[web.RouteDef]:
    """``ca_pem``: the CA machines pin, served at /boot/ca.pem (it is no secret; a machine
    checks what it fetched against the fingerprint on its kernel command line). ``signed`` and
    ``signer``: scripts load the kernel and initrd from the plain-HTTP asset listener and
    verify them against the signatures served here (/boot/signatures/<asset>;
    metald.boot.signing); a machine reports a failed check to /boot/image-refused/<mac>/<errno>."""
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
        if require_https and not request.secure and "metald.token" in target.kernel_args:
            return plain_http_refused(request, f"the {target.action.value} script for {mac}")
        metrics.http_boot.labels(target.action.value).inc()
        log.info("iPXE script for %s: %s", mac, target.action.value)
        body = render_boot_script(target, mac=mac, public_url=base, ca_pem=ca_pem, signed=signed)
        return web.Response(
            text=body, content_type="text/plain", headers={"Cache-Control": "no-store"}
        )

    async def signature(request: web.Request) -> web.Response:
        if signer is None:
            raise web.HTTPNotFound(text="boot images are not signed (no boot.assets_http_listen)\n")
        path = _asset_path(root, request.match_info["path"])
        body = await signer.signature(path)
        return web.Response(
            body=body,
            content_type="application/pkcs7-signature",
            headers={"Cache-Control": "no-store"},
        )

    async def refused(request: web.Request) -> web.Response:
        mac = _mac_from(request.match_info["mac"])
        if mac is None:
            raise web.HTTPNotFound(text="not a MAC address\n")
        report = getattr(hooks, "image_refused", None)
        if report is None:
            raise web.HTTPNotFound(text="no machine store\n")
        what = request.query.get("file", "")[:200]
        errno = request.match_info["errno"][:16]
        try:
            recorded = await report(mac, client=request.remote, file=what, errno=errno)
        except ScriptRefused as e:
            raise web.HTTPForbidden(text=f"refused: {e}\n") from None
        metrics.http_boot.labels("image_refused").inc()
        return web.Response(text="recorded\n" if recorded else "already recorded\n")

    routes = [
        web.get("/boot/ca.pem", _problems(ca_route(ca_pem))),
        web.get("/boot/{mac}.ipxe", _problems(script)),
        *asset_routes(root),
    ]
    if signer is not None:
        routes += [
            web.get(SIGNATURES + "{path:.+}", _problems(signature)),
            web.get(REFUSED + "{mac}/{errno}", _problems(refused)),
        ]
    return routes


def _asset_path(root: Path, name: str) -> Path:
    try:
        return safe_path(root, name)
    except PathRefused as e:
        if e.reason in ("not-found", "hidden"):
            raise web.HTTPNotFound(text=f"no boot asset {name}") from None
        raise web.HTTPForbidden(text=f"{name} is not served ({e.reason})") from None


def asset_routes(assets_dir: Path) -> list[web.RouteDef]:
    """``/boot/assets/<path>``: the read-only assets folder (HEAD, Range, ETag). Also all the
    plain-HTTP asset listener (``[boot] assets_http_listen``) serves."""
    root = Path(assets_dir).resolve()

    async def asset(request: web.Request) -> web.StreamResponse:
        return AssetResponse(_asset_path(root, request.match_info["path"]))

    # aiohttp answers HEAD for GET routes
    return [web.get("/boot/assets/{path:.+}", _problems(asset))]


#: aiohttp's FileResponse steps AssetResponse calls on the loop; without them (another aiohttp
#: than the one this was written against) it is aiohttp's FileResponse unchanged.
_STEPS = ("_make_response", "_prepare_open_file", "_not_modified", "_precondition_failed")
_INLINE = all(hasattr(web.FileResponse, a) for a in _STEPS) and hasattr(
    web_fileresponse, "_FileResponseResult"
)


class AssetResponse(web.FileResponse):
    """aiohttp's FileResponse (HEAD, Range, ETag and the other conditionals, the same headers
    and statuses) with two costs taken out of every boot-asset download:

    - the file is checked, opened and closed on the loop, not through two thread hand-offs
      per request (the assets folder is local and read-only: a stat and an open are
      microseconds; aiohttp does them in a thread because its files may be anywhere);
    - a large body is sent by the kernel from a worker thread when one is free
      (``metald.boot.sendfile``), so downloads use every core; the rest, or all of it when
      none is free, on the loop as before.
    """

    async def prepare(self, request: web.BaseRequest) -> Any:
        if not _INLINE:
            return await super().prepare(request)
        result = web_fileresponse._FileResponseResult
        accept_encoding = request.headers.get(hdrs.ACCEPT_ENCODING, "").lower()
        try:
            res, fobj, st, encoding = self._make_response(request, accept_encoding)
        except PermissionError:
            self.set_status(web.HTTPForbidden.status_code)
            return await web.StreamResponse.prepare(self, request)
        except OSError:
            self.set_status(web.HTTPNotFound.status_code)
            return await web.StreamResponse.prepare(self, request)
        if res is result.NOT_ACCEPTABLE:
            self.set_status(web.HTTPForbidden.status_code)
            return await web.StreamResponse.prepare(self, request)
        if res is result.PRE_CONDITION_FAILED:
            return await self._precondition_failed(request)
        if res is result.NOT_MODIFIED:
            etag = f"{st.st_mtime_ns:x}-{st.st_size:x}"
            return await self._not_modified(request, etag, st.st_mtime)
        assert fobj is not None
        try:
            return await self._prepare_open_file(request, fobj, st, encoding)
        finally:
            fobj.close()

    async def _sendfile(self, request: web.BaseRequest, fobj: Any, offset: int, count: int) -> Any:
        transport = request.transport
        loop = asyncio.get_running_loop()
        if (
            web_fileresponse.NOSENDFILE
            or self.compression
            or not sendfile.eligible(loop, transport, count)
        ):
            return await super()._sendfile(request, fobj, offset, count)
        writer = await web.StreamResponse.prepare(self, request)
        assert writer is not None and transport is not None
        if transport.get_write_buffer_size() == 0:  # the headers went out at once
            sent = await sendfile.send_threaded(transport, fobj, offset, count)
            offset, count = offset + sent, count - sent
        if count:
            await loop.sendfile(transport, fobj, offset, count)
        await web.StreamResponse.write_eof(self)
        return writer


def ca_route(ca_pem: bytes | None) -> Handler:
    async def ca(request: web.Request) -> web.Response:

        if ca_pem is None:
            raise web.HTTPNotFound(text="the provisioning listener has no certificate (HTTP)\n")
        return web.Response(body=ca_pem, content_type="application/x-pem-file")

    return ca


_TITLES = {403: "Forbidden", 404: "Not found"}


def _problems(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Turn a handler's HTTP errors into problem+json, keeping their status and sentence."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            detail = (e.text or "").strip()
            if not detail or detail == f"{e.status}: {e.reason}":
                detail = f"{e.reason} ({request.path})"
            return problem(e.status, _TITLES.get(e.status, e.reason), detail, instance=request.path)

    return wrapped
