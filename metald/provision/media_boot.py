"""Per-boot nonce URLs of virtual-media boots: the ISO a BMC fetches and the one script that
carries the boot's agent token, reachable only by who knows the nonce, not by who holds a lease.

A virtual-media boot is armed with a nonce of its own (``boots.arm_boot(media=True)``: the
stored nonce starts with ``MEDIA_PREFIX``). The per-MAC script (``/boot/<mac>.ipxe``) never
hands out such a boot's token (``boots.take_armed_boot``); only these routes do:

- ``GET /boot/n/<machine>/<nonce>.iso``: the ISO, built for this boot (Debian's iPXE ISO whose
  script DHCPs for an address and chains to the URL below). Valid while the boot is armed, so
  a BMC may fetch it (or ranges of it) as often as it likes.
- ``GET /boot/n/<machine>/<nonce>.ipxe``: the machine's script with the agent token; the fetch
  takes the armed boot (one compare-and-swap), so the URL works once, and both URLs die with
  the boot (taken, re-armed, or the machine no longer in a state metald boots).

``<nonce>`` is SHA-256 over the armed boot's stored value (a UUID4: 122 random bits) and the
machine id, 128 bits in hex: it is not the stored value (which becomes ``boot_current`` and the
token's ``boot``, shown in events once used), and guessing it is hopeless. Every refusal is the
same 404, whatever was wrong. Logs and events show the first 6 hex digits only (``redact``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import shutil
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlmodel import Session, select

from metald.bmc.media import redact
from metald.boot.hooks import (
    BootAction,
    target_for_machine,
    with_agent_console,
    with_agent_token,
    with_peer_urls,
)
from metald.boot.http import plain_http_refused
from metald.boot.ipxe import SignedAssets, render_boot_script
from metald.lifecycle import NETWORK_BOOT, State
from metald.provision.boots import MEDIA_PREFIX
from metald.store.models import Machine, Nic

log = logging.getLogger(__name__)

PREFIX = "/boot/n"
_NONCE = re.compile(r"^[0-9a-f]{32}$")
#: ISOs kept built (each ~2 MB, a BMC may fetch one several times or by ranges).
ISO_CACHE = 32
#: ISO builds at once (pycdlib, ~0.3 s of CPU each, in threads).
ISO_BUILDS = 2


def url_nonce(machine_id: str, armed: str) -> str:
    digest = hashlib.sha256(f"metald vmedia v1\0{machine_id}\0{armed}".encode()).hexdigest()
    return digest[:32]


def is_media_boot(armed: str | None) -> bool:
    return bool(armed) and armed.startswith(MEDIA_PREFIX)  # type: ignore[union-attr]


def iso_url(base: str, machine_id: str, armed: str) -> str:
    return f"{base.rstrip('/')}{PREFIX}/{machine_id}/{url_nonce(machine_id, armed)}.iso"


def script_path(machine_id: str, nonce: str) -> str:
    return f"{PREFIX}/{machine_id}/{nonce}.ipxe"


def _armed_machine(s: Session, machine_id: str, nonce: str) -> Machine | None:
    """The machine whose armed virtual-media boot ``nonce`` names, or None."""
    if not _NONCE.match(nonce):
        return None
    m = s.get(Machine, machine_id)
    if m is None or not is_media_boot(m.boot_armed) or State(m.state) not in NETWORK_BOOT:
        return None
    if not hmac.compare_digest(url_nonce(m.id, m.boot_armed or ""), nonce):
        return None
    return m


def _mac_of(s: Session, machine_id: str) -> str:
    nic = s.exec(select(Nic).where(Nic.machine_id == machine_id).order_by(Nic.mac)).first()
    return nic.mac if nic is not None else ""


#: The line of metald's embedded iPXE script that runs a virtual-media ISO's script
#: (bootassets/ipxe.py MEDIA_SCRIPT); an installed build without it (older) cannot.
_RUNS_MEDIA_SCRIPT = "chain --autofree --replace file:/metald.ipxe || goto retry"


def media_efi(assets_dir: str, ipxe: str) -> tuple[Path | None, str | None]:
    """metald's ipxe.efi for the per-boot ISOs' EFI boot image (``<assets_dir>/ipxe/``), or
    None and why UEFI machines cannot boot the ISOs (``boot.ipxe = "debian"``, no build, a
    build from before it ran an ISO's script, no mtools)."""
    from bootassets.iso import efi_unavailable

    if ipxe == "debian" or not assets_dir:
        return None, 'boot.ipxe = "debian"' if ipxe == "debian" else "no boot.assets_dir"
    built = Path(assets_dir) / "ipxe"
    why = efi_unavailable(built / "ipxe.efi")
    if why is None:
        try:
            script = (built / "metald.ipxe").read_text()
        except (OSError, UnicodeDecodeError):
            script = ""
        if _RUNS_MEDIA_SCRIPT not in script.splitlines():
            why = "the installed iPXE build predates virtual-media scripts: rebuild it"
    return (None, why) if why else (built / "ipxe.efi", None)


#: The line of metald's embedded iPXE script that runs the initrd its boot loader handed it
#: (bootassets/ipxe.py MEDIA_INITRD): BIOS virtual media with ``ipxe.lkrn``.
_RUNS_MEDIA_INITRD = "imgexec --autofree --replace <INITRD> || goto retry"


def media_bios(assets_dir: str, ipxe: str) -> tuple[Path | None, str | None]:
    """metald's ipxe.lkrn for the per-boot ISOs' BIOS side (``<assets_dir>/ipxe/``), or None
    and why BIOS machines boot Debian's ipxe.krn from them instead (plain HTTP only: with
    ``require_https`` they cannot fetch their nonce script)."""
    if ipxe == "debian" or not assets_dir:
        return None, 'boot.ipxe = "debian"' if ipxe == "debian" else "no boot.assets_dir"
    built = Path(assets_dir) / "ipxe"
    if not (built / "ipxe.lkrn").is_file():
        return None, "metald's own iPXE has no ipxe.lkrn (python -m bootassets ipxe --install)"
    try:
        script = (built / "metald.ipxe").read_text()
    except (OSError, UnicodeDecodeError):
        script = ""
    if _RUNS_MEDIA_INITRD not in script.splitlines():
        return None, "the installed iPXE build predates BIOS virtual-media scripts: rebuild it"
    return built / "ipxe.lkrn", None


class MediaBootRoutes:
    """The two nonce routes on the boot HTTP listener; ``hooks`` is the boot plane's
    ``StoreBootHooks`` (its token minting, peer URLs and console arguments)."""

    def __init__(
        self,
        hooks: Any,
        public_url: str,
        *,
        ca_pem: bytes | None = None,
        require_https: bool = False,
        efi: Path | None = None,
        bios: Path | None = None,
        signed: SignedAssets | None = None,
    ) -> None:
        self.hooks = hooks
        #: metald's own ipxe.lkrn: each ISO's BIOS side boots it with the boot's script
        #: (HTTPS pinned to metald's CA); None: Debian's ipxe.krn (``media_bios`` says why).
        self.bios = bios
        #: Kernel and initrd over the plain asset listener, verified (metald.boot.signing).
        self.signed = signed
        #: metald's own ipxe.efi: each ISO's EFI boot image runs the boot's script with it
        #: (UEFI machines); None: BIOS only (``media_efi`` says why).
        self.efi = efi
        self.base = public_url.rstrip("/")
        #: The CA the machines' listener chains to: its pin goes on the agent's command line.
        self.ca_pem = ca_pem
        #: ``[boot] require_https``: the nonce script (it carries an agent token) is refused
        #: over plain HTTP, before the nonce is spent.
        self.require_https = require_https
        self._dir: Path | None = None
        self._isos: OrderedDict[str, Path] = OrderedDict()
        self._builds = asyncio.Semaphore(ISO_BUILDS)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(PREFIX + "/{machine}/{nonce}.iso", self.iso),
            web.get(PREFIX + "/{machine}/{nonce}.ipxe", self.script),
        ]

    @staticmethod
    def _refused(request: web.Request, why: str) -> web.HTTPNotFound:
        log.warning("virtual media %s refused: %s", redact(request.path), why)
        return web.HTTPNotFound(text="no such boot\n")

    async def iso(self, request: web.Request) -> web.StreamResponse:
        machine_id, nonce = request.match_info["machine"], request.match_info["nonce"]
        m = await self.hooks.store.run(_armed_machine, machine_id, nonce)
        if m is None:
            raise self._refused(request, "no armed virtual-media boot with that nonce")
        path = self._isos.get(nonce)
        if path is None or not path.exists():
            path = await self._build(nonce, script_path(machine_id, nonce))
        return web.FileResponse(path, headers={"Cache-Control": "no-store"})

    async def _build(self, nonce: str, script: str) -> Path:
        from bootassets.iso import boot_script, write_iso

        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="metald-vmedia-"))
            weakref.finalize(self, shutil.rmtree, self._dir, True)  # gone with the routes
        path = self._dir / f"{nonce}.iso"
        text = boot_script(self.base, script)

        def build() -> None:
            tmp = path.with_suffix(".part")
            with open(tmp, "wb") as f:
                write_iso(f, text, efi=self.efi, bios=self.bios)
            tmp.replace(path)

        async with self._builds:
            await asyncio.to_thread(build)
        self._isos[nonce] = path
        while len(self._isos) > ISO_CACHE:
            _, old = self._isos.popitem(last=False)
            old.unlink(missing_ok=True)
        return path

    async def script(self, request: web.Request) -> web.Response:
        machine_id, nonce = request.match_info["machine"], request.match_info["nonce"]
        if self.require_https and not request.secure:
            return plain_http_refused(request, f"the virtual-media boot script of {machine_id}")
        client = request.remote
        body = await self.hooks.store.run(self._take, machine_id, nonce, client)
        if body is None:
            raise self._refused(request, "no armed virtual-media boot with that nonce (used?)")
        log.info("iPXE script for machine %s through its virtual-media nonce", machine_id)
        return web.Response(
            text=body, content_type="text/plain", headers={"Cache-Control": "no-store"}
        )

    def _take(self, s: Session, machine_id: str, nonce: str, client: str | None) -> str | None:
        """The script with the boot's token, the boot taken; None when the nonce is not the
        machine's armed virtual-media boot (any more)."""
        m = _armed_machine(s, machine_id, nonce)
        if m is None or self.hooks.mint_agent_token is None:
            return None
        armed = m.boot_armed or ""
        # Unwrap the media nonce (compare-and-swap) so the ordinary take below takes it; both
        # in this transaction: of two racing fetches one gets the token, the other nothing.
        row = Machine.__table__  # type: ignore[attr-defined]
        done = s.connection().execute(
            row.update()
            .where(row.c.id == m.id, row.c.boot_armed == armed)
            .values(boot_armed=armed.removeprefix(MEDIA_PREFIX))
        )
        if done.rowcount != 1:
            s.rollback()
            return None
        s.refresh(m)
        mac = _mac_of(s, m.id)
        t = target_for_machine(m)
        if t.action == BootAction.LOCAL:
            s.rollback()
            return None
        token = self.hooks.mint_agent_token(s, m, mac, client)  # commits
        if token is None:
            s.rollback()
            return None
        t = with_peer_urls(with_agent_token(t, token), self.hooks.agent_peer_urls())
        if self.hooks.agent_console:
            t = with_agent_console(t)
        return render_boot_script(
            t, mac=mac, public_url=self.base, ca_pem=self.ca_pem, signed=self.signed
        )
