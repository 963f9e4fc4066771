"""Firmware images metald offers to BMCs: fetched from a baseline component's URL, kept by
their SHA-256, verified before any BMC is offered one, and served to BMCs from the boot HTTP
listener (``/boot/firmware/<sha256>.bin``), where firmware fetches without a token.

An image is downloaded to a temporary file beside the store and becomes ``<sha256>.bin`` only
once its SHA-256 matches the baseline's: nothing half-downloaded or altered is ever served.
It is hashed again right before each offer (the store is a folder an operator can touch).
Images are vendor firmware, not secrets: anyone who can reach the boot listener and knows an
image's SHA-256 can fetch it, as with the boot assets.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

from metald.errors import Unprocessable
from metald.problem import problem

log = logging.getLogger(__name__)
_SHA = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20


class ImageRefused(Unprocessable):
    title = "Firmware image refused"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


class FirmwareImages:
    """The verified image store (one folder) and its HTTP route."""

    def __init__(self, root: Path, *, max_bytes: int, timeout_s: float) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}

    def path_of(self, sha256: str) -> Path:
        if not _SHA.match(sha256):
            raise ImageRefused(f"{sha256[:80]!r} is not a SHA-256 (64 lower-case hex digits)")
        return self.root / f"{sha256}.bin"

    async def ensure(self, url: str, sha256: str) -> Path:
        """The image with this SHA-256, downloaded from ``url`` first if it is not kept yet,
        and verified now. Raises ImageRefused (422) with what to do."""
        path = self.path_of(sha256)
        lock = self._locks.setdefault(sha256, asyncio.Lock())
        async with lock:
            if not path.exists():
                await self._fetch(url, sha256, path)
            got = await asyncio.to_thread(_hash_file, path)
            if got != sha256:
                path.unlink(missing_ok=True)
                raise ImageRefused(
                    f"the kept image {path.name} no longer matches its SHA-256 (it was altered "
                    "on disk); it was removed and will be downloaded again on the next try"
                )
        return path

    async def _fetch(self, url: str, sha256: str, path: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o750)
        fd, tmp_name = tempfile.mkstemp(dir=self.root, prefix=".download-")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                got = await self._copy(url, out)
            if got != sha256:
                raise ImageRefused(
                    f"the image at {_shown(url)} has SHA-256 {got}, not the baseline's "
                    f"{sha256}; fix the baseline's url or sha256 (nothing was offered to a BMC)"
                )
            tmp.chmod(0o644)
            tmp.replace(path)
            log.info("firmware image %s stored from %s", sha256[:12], _shown(url))
        finally:
            tmp.unlink(missing_ok=True)

    async def _copy(self, url: str, out: object) -> str:
        h = hashlib.sha256()
        size = 0

        def take(chunk: bytes) -> None:
            nonlocal size
            size += len(chunk)
            if size > self.max_bytes:
                raise ImageRefused(
                    f"the image at {_shown(url)} is larger than [firmware] max_image_mb "
                    f"({self.max_bytes >> 20} MiB)"
                )
            h.update(chunk)
            out.write(chunk)  # type: ignore[attr-defined]

        if url.startswith("file://"):
            src = Path(url[len("file://") :])
            try:
                with src.open("rb") as f:
                    while chunk := f.read(CHUNK):
                        take(chunk)
            except OSError as e:
                raise ImageRefused(f"cannot read the image {src}: {e.strerror}") from None
            return h.hexdigest()
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as r:
                if r.status != 200:
                    raise ImageRefused(
                        f"downloading the image from {_shown(url)} answered HTTP {r.status}"
                    )
                async for chunk in r.content.iter_chunked(CHUNK):
                    take(chunk)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise ImageRefused(
                f"cannot download the image from {_shown(url)} ({type(e).__name__}); check the "
                "baseline's url and that metald can reach it"
            ) from None
        return h.hexdigest()

    def routes(self) -> list[web.RouteDef]:
        async def image(request: web.Request) -> web.StreamResponse:
            sha = request.match_info["sha256"]
            path = self.root / f"{sha}.bin"
            if not _SHA.match(sha) or not path.is_file():
                return problem(404, "Not found", f"no firmware image {sha[:64]}")
            return web.FileResponse(path, headers={"Cache-Control": "no-store"})

        return [web.get("/boot/firmware/{sha256}.bin", image)]

    def remove_all(self) -> None:
        """Tests and tools: forget every kept image."""
        shutil.rmtree(self.root, ignore_errors=True)


def _shown(url: str) -> str:
    """A URL as logs and errors show it: without credentials or query."""
    if "://" not in url:
        return url[:200]
    scheme, rest = url.split("://", 1)
    host, _, path = rest.partition("/")
    host = host.rsplit("@", 1)[-1]
    return f"{scheme}://{host}/{path.split('?', 1)[0]}"[:200]
