"""Virtual media boot through a machine's BMC, as the API and the provisioning driver use it:
which machines boot this way (a label), where BMCs fetch each boot's ISO, the fenced, journaled
commands (``insert_for``, ``boot_cd_for``, ``eject_for``), the eject once the boot's agent
reported (``eject_after_report``) and the redaction of nonce URLs (``redact``). The requests
themselves are the ``VirtualMedia`` capability of the BMC's driver
(``metald.bmc.capabilities``; Redfish has it), sent through the fenced executor, so nothing
outside metald.bmc imports a protocol module (docs/architecture.md).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy import select as sa_select
from sqlmodel import Session

from metald.bmc.capabilities import Capability
from metald.bmc.control import Executor
from metald.config import Config
from metald.errors import Conflict, Unprocessable
from metald.machines import add_event
from metald.store.models import Bmc, Event

log = logging.getLogger(__name__)

#: A machine label that makes metald boot it from virtual media instead of PXE (its network
#: gives no DHCP boot options): ``boot-via=virtual-media``.
BOOT_VIA_LABEL = "boot-via"
VIRTUAL_MEDIA = "virtual-media"
#: The event the provisioning driver records when it arms a boot (``data.via`` says how).
BOOT_EVENT = "provision.network-boot"
EJECTED_EVENT = "bmc.vmedia-ejected"
EJECT_FAILED_EVENT = "bmc.vmedia-eject-failed"


_NONCE_URL = re.compile(r"(/boot/n/[^/\s]+/)([^/\s.]{0,6})[^/\s.]*")


def redact(text: str) -> str:
    """``text`` with every per-boot nonce URL cut to its first 6 hex digits (logs, events)."""
    return _NONCE_URL.sub(r"\1\2...", text)


def boot_base(control: Any) -> str | None:
    """The boot HTTP listener's URL, where BMCs fetch each boot's ISO
    (``metald.provision.media_boot``: ``<base>/boot/n/<machine>/<nonce>.iso``); None where
    this instance serves no boot HTTP (``vmedia_base``, set by the daemon)."""
    base = getattr(control, "vmedia_base", None)
    return base.rstrip("/") if base else None


def boot_url_problem(cfg: Config) -> str | None:
    """Why this configuration gives BMCs no URL to fetch a boot's ISO from (the keys to set),
    or None. The daemon then hands the BMC service no ``vmedia_base``, and a virtual-media boot
    is refused at the request (``no_boot_url``) instead of sending a BMC to ``http://None``."""
    b = cfg.boot
    if not b.enabled:
        return (
            "the boot plane is off (boot.enabled = false), so nothing serves the boot ISO to "
            "BMCs: set boot.enabled = true with boot.assets_dir, and boot.http_url or "
            "boot.server_address"
        )
    needs_address = not b.http_url and (b.http_listen or not cfg.api.public_url)
    if needs_address and b.server_address is None:
        return (
            "boot.server_address is not set, so there is no URL a BMC can fetch the boot ISO "
            "from: set boot.http_url, or boot.server_address"
            + ("" if b.http_listen else ", or api.public_url")
        )
    return None


def no_boot_url(problem: str | None, machine_id: str) -> Conflict:
    """The 409 for a virtual-media boot this instance cannot serve, naming the keys to set
    (``problem``: ``boot_url_problem`` of its configuration)."""
    problem = problem or "this metald serves no boot HTTP for BMCs"
    return Conflict(
        f"cannot boot machine {machine_id} from virtual media: {problem}; or boot it with "
        '{"via": "network"}'
    )


def wants_virtual_media(labels: dict[str, str] | None) -> bool:
    return (labels or {}).get(BOOT_VIA_LABEL) == VIRTUAL_MEDIA


async def _media_row(ex: Executor, machine_id: str) -> Bmc:
    """The machine's BMC, refused (422, naming the capability) unless its driver has virtual
    media."""
    row = await ex.row_for_machine(machine_id)
    ex.require(
        row,
        Capability.VIRTUAL_MEDIA,
        f'boot machine {machine_id} with {{"via": "network"}}, or register its Redfish BMC',
    )
    return row


async def check_for(ex: Executor, machine_id: str) -> None:
    """Raise a problem (422) unless the machine's BMC has virtual media and offers a CD."""
    row = await _media_row(ex, machine_id)
    try:
        await ex.execute(
            row, Capability.VIRTUAL_MEDIA, "find_virtual_cd", lambda d: d.find_virtual_cd()
        )
    except Unprocessable as e:
        raise Unprocessable(
            f'{e.detail}; boot machine {machine_id} with {{"via": "network"}} instead',
            bmc_id=row.id,
        ) from None


async def insert_for(ex: Executor, machine_id: str, url: str, step: str | None) -> None:
    """Insert ``url`` into the machine's virtual CD, journaled as ``vmedia:insert``."""
    row = await _media_row(ex, machine_id)
    try:
        await ex.execute(
            row,
            Capability.VIRTUAL_MEDIA,
            "insert_media",
            lambda d: d.insert_media(url),
            journal="vmedia:insert",
            step=step,
            write=True,
        )
    except Exception as e:
        # The URL carries the boot's nonce: what is recorded of a failure (an event, the
        # machine's last_error) shows its first digits only.
        if isinstance(getattr(e, "detail", None), str):
            e.detail = redact(e.detail)  # type: ignore[attr-defined]
        e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
        raise


async def boot_cd_for(ex: Executor, machine_id: str, step: str | None) -> None:
    """The machine's next boot (only) from its virtual CD, journaled as ``boot:cd``."""
    row = await _media_row(ex, machine_id)
    await ex.execute(
        row,
        Capability.VIRTUAL_MEDIA,
        "boot_cd_once",
        lambda d: d.boot_cd_once(),
        journal="boot:cd",
        step=step,
        write=True,
    )


async def eject_for(ex: Executor, machine_id: str) -> None:
    row = await _media_row(ex, machine_id)
    await ex.execute(
        row, Capability.VIRTUAL_MEDIA, "eject_media", lambda d: d.eject_media(), write=True
    )


def _media_boot_to_eject(s: Session, machine_id: str) -> str | None:
    """The ISO URL of the machine's latest armed boot when it was a virtual-media boot whose
    media has not been ejected (nor its eject tried) since; else None. One Core SELECT of the
    latest such event's kind and data (no ORM object: it runs after every inventory)."""
    row = s.connection().execute(_LATEST_MEDIA_EVENT, {"m": machine_id}).first()
    if row is None or row.kind != BOOT_EVENT:
        return None
    data = row.data or {}
    return data.get("image") if data.get("via") == VIRTUAL_MEDIA else None


_EVENTS = Event.__table__  # type: ignore[attr-defined]
_LATEST_MEDIA_EVENT = (
    sa_select(_EVENTS.c.kind, _EVENTS.c.data)
    .where(
        _EVENTS.c.machine_id == bindparam("m"),
        _EVENTS.c.kind.in_([BOOT_EVENT, EJECTED_EVENT, EJECT_FAILED_EVENT]),
    )
    .order_by(_EVENTS.c.id.desc())
    .limit(1)
)


def after_inspection_probe(s: Session, machine_id: str) -> tuple[str | None, bool]:
    """What the work after an accepted inventory needs to know, in one read: the virtual-media
    ISO to eject (``_media_boot_to_eject``) and whether the machine has a BMC at all (without
    one there is no firmware to read nor BIOS to stage). A storm's machines have neither, and
    then nothing else is read or written for them."""
    image = _media_boot_to_eject(s, machine_id)
    linked = s.connection().execute(_BMC_OF_MACHINE, {"m": machine_id}).first() is not None
    return image, linked


_BMCS = Bmc.__table__  # type: ignore[attr-defined]
_BMC_OF_MACHINE = sa_select(_BMCS.c.id).where(_BMCS.c.machine_id == bindparam("m")).limit(1)


async def eject_after_report(ex: Executor, machine_id: str, actor: str) -> bool | None:
    """The agent of a virtual-media boot reported (inventory, or the end of a provision or
    wipe): the ISO has done its work, so eject it through the BMC. Recorded as an event
    (``bmc.vmedia-ejected``, or ``bmc.vmedia-eject-failed`` with the BMC's answer: a BMC that
    will not eject leaves the CD in, never the machine stuck). None when there was nothing to
    eject (not a virtual-media boot, or already done)."""
    image = await ex.store.run(_media_boot_to_eject, machine_id)
    if image is None:
        return None
    instance = ex.instance
    try:
        await eject_for(ex, machine_id)
    except Exception as e:  # noqa: BLE001 - any failure to eject is an event, never raised
        detail = getattr(e, "detail", None) or str(e) or type(e).__name__
        log.warning("machine %s: ejecting the boot ISO failed: %s", machine_id, detail)
        kind, reason, ok = EJECT_FAILED_EVENT, f"ejecting {image} failed: {detail}", False
    else:
        kind, reason, ok = EJECTED_EVENT, f"ejected {image} after the agent reported", True

    def note(s: Session) -> None:
        add_event(
            s, kind, actor, machine_id=machine_id, reason=reason,
            data={"image": image}, instance=instance,
        )  # fmt: skip
        s.commit()

    await ex.store.run(note)
    return ok
