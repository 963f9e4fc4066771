"""The virtual BMC's virtual CD (Redfish VirtualMedia) carried out through QMP.

InsertMedia fetches the image over HTTP the way a BMC does (into a file of the BMC's own, at
most ``MAX_IMAGE_BYTES``), then puts it in the machine's CD drive with
``blockdev-change-medium``; EjectMedia ejects it (``eject``, forced: the machine may be off or
its OS may hold the tray locked). What is reported is read back from QEMU (``query-block``):
``Inserted`` is whether the drive holds a medium, and ``Image`` is the URL only while the
medium in the drive is the file that URL was fetched into.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .qemu import CD_ID
from .qmp import QmpClient

MAX_IMAGE_BYTES = 64 << 20
FETCH_TIMEOUT_S = 60.0


class MediaError(Exception):
    """The image could not be fetched or inserted; the message says why."""


@dataclass(frozen=True)
class MediaState:
    inserted: bool
    image: str | None


class VirtualCd:
    def __init__(self, qmp: QmpClient, media_dir: Path, name: str) -> None:
        self.qmp = qmp
        self.file = media_dir / f"{name}.vmedia.iso"
        self._url: str | None = None  # what was fetched into self.file
        self._lock = asyncio.Lock()

    async def state(self) -> MediaState:
        medium = await self._medium()
        if medium is None:
            return MediaState(False, None)
        ours = self._url is not None and os.path.realpath(medium) == str(self.file.resolve())
        return MediaState(True, self._url if ours else None)

    async def insert(self, url: str) -> None:
        async with self._lock:
            if await self._medium() is not None:
                raise MediaError("a medium is already inserted: eject it first")
            data = await _fetch(url)
            tmp = self.file.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(self.file)
            await self.qmp.execute(
                "blockdev-change-medium",
                {"id": CD_ID, "filename": str(self.file), "format": "raw",
                 "read-only-mode": "read-only"},
            )  # fmt: skip
            self._url = url

    async def eject(self) -> None:
        async with self._lock:
            await self.qmp.execute("eject", {"id": CD_ID, "force": True})
            self._url = None

    async def _medium(self) -> str | None:
        """The file in the CD drive, or None when it is empty (or its tray open)."""
        for dev in await self.qmp.execute("query-block"):
            qdev = str(dev.get("qdev") or "")
            if qdev == CD_ID or qdev.startswith(f"/machine/peripheral/{CD_ID}/"):
                inserted = dev.get("inserted")
                if not inserted or dev.get("tray_open"):
                    return None
                return str(inserted.get("file") or "")
        raise MediaError(f"the machine has no CD drive {CD_ID}")


async def _fetch(url: str) -> bytes:
    if not url.startswith(("http://", "https://")):
        raise MediaError(f"Image {url!r} is not an http(s) URL")
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as resp:
            if resp.status != 200:
                raise MediaError(f"GET {url} answered {resp.status}")
            data = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise MediaError(f"{url} is larger than {MAX_IMAGE_BYTES} bytes")
            return bytes(data)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise MediaError(f"could not fetch {url}: {e or type(e).__name__}") from None
