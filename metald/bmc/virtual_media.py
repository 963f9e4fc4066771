"""Redfish VirtualMedia: insert an ISO by URL into the BMC's virtual CD, boot from it once,
eject it. A building block for ``POST /api/v1/machines/{id}/boot {"via": "virtual-media"}``
(issue 16 item 3), and the fenced, journaled commands the provisioning driver sends through
a machine's BMC (``insert_for``, ``boot_cd_for``, ``eject_for``).

It goes through the Redfish driver's own requests, so the same guards hold: every link the BMC
hands back must stay on the BMC's origin, credentials and TLS pinning are the driver's. The
virtual CD is looked for under the system (newer Redfish) and under its managers (older).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metald.bmc.base import BmcProtocolError, BmcUnsupported
from metald.bmc.redfish import RedfishDriver
from metald.errors import Unprocessable

if TYPE_CHECKING:
    from metald.bmc.commands import BmcControl
    from metald.store.models import Bmc

CD_TYPES = {"CD", "DVD"}

#: The boot ISO under the boot HTTP listener's assets (``/boot/assets/<name>``).
ISO_NAME = "metald-boot.iso"
#: A machine label that makes metald boot it from virtual media instead of PXE (its network
#: gives no DHCP boot options): ``boot-via=virtual-media``.
BOOT_VIA_LABEL = "boot-via"
VIRTUAL_MEDIA = "virtual-media"


async def find_cd(d: RedfishDriver) -> tuple[str, dict[str, Any]]:
    """The path and resource of the first virtual media device that takes a CD or DVD."""
    system = await d._system_resource()
    collections: list[str] = []
    if vm := (system.get("VirtualMedia") or {}).get("@odata.id"):
        collections.append(vm)
    managers = [m["@odata.id"] for m in (system.get("Links") or {}).get("ManagedBy", [])]
    if not managers:
        coll = await d._get("/redfish/v1/Managers")
        managers = [m["@odata.id"] for m in coll.get("Members", []) if "@odata.id" in m]
    for path in managers:
        mgr = await d._get(path)
        if vm := (mgr.get("VirtualMedia") or {}).get("@odata.id"):
            collections.append(vm)
    for coll_path in collections:
        coll = await d._get(coll_path)
        for member in coll.get("Members", []):
            if "@odata.id" not in member:
                continue
            res = await d._get(member["@odata.id"])
            if CD_TYPES & set(res.get("MediaTypes") or []):
                return member["@odata.id"], res
    raise BmcUnsupported(f"{d._where}: the BMC offers no virtual CD or DVD")


def _action(path: str, res: dict[str, Any], name: str) -> str:
    target = ((res.get("Actions") or {}).get(f"#VirtualMedia.{name}") or {}).get("target")
    return target or f"{path.rstrip('/')}/Actions/VirtualMedia.{name}"


async def insert(d: RedfishDriver, image_url: str) -> str:
    """Insert ``image_url`` (ejecting what was there); returns the device's path once the BMC
    reports the image inserted."""
    path, res = await find_cd(d)
    if res.get("Inserted"):
        await d._act("POST", _action(path, res, "EjectMedia"), {})
    body = {"Image": image_url, "Inserted": True, "WriteProtected": True}
    await d._act("POST", _action(path, res, "InsertMedia"), body)
    now = await d._get(path)
    if not now.get("Inserted") or now.get("Image") != image_url:
        raise BmcProtocolError(
            f"{d._where}: asked to insert {image_url}, the BMC reports "
            f"Inserted={now.get('Inserted')!r} Image={now.get('Image')!r}"
        )
    return path


async def eject(d: RedfishDriver) -> None:
    path, res = await find_cd(d)
    if res.get("Inserted"):
        await d._act("POST", _action(path, res, "EjectMedia"), {})


async def boot_cd_once(d: RedfishDriver) -> None:
    """The next boot (only) from the virtual CD."""
    s = await d._system_resource()
    allowed = (s.get("Boot") or {}).get("BootSourceOverrideTarget@Redfish.AllowableValues")
    if allowed and "Cd" not in allowed:
        raise BmcUnsupported(f"{d._where}: boot target Cd not offered ({allowed})")
    assert d._system_uri is not None
    body = {"Boot": {"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once"}}
    await d._act("PATCH", d._system_uri, body)


def iso_url(control: Any) -> str | None:
    """The URL of the boot ISO the BMC fetches: on the boot HTTP listener (``vmedia_base``,
    set by the daemon); None where this instance serves no boot HTTP."""
    base = getattr(control, "vmedia_base", None)
    return f"{base.rstrip('/')}/boot/assets/{ISO_NAME}" if base else None


def wants_virtual_media(labels: dict[str, str] | None) -> bool:
    return (labels or {}).get(BOOT_VIA_LABEL) == VIRTUAL_MEDIA


async def _redfish_row(control: BmcControl, machine_id: str) -> Bmc:
    row = await control.row_for_machine(machine_id)
    if row.protocol != "redfish":
        raise Unprocessable(
            f"machine {machine_id}'s BMC {row.id} speaks {row.protocol}, and virtual media "
            'needs Redfish: boot it with {"via": "network"}, or register its Redfish BMC',
            bmc_id=row.id,
        )
    return row


async def check_for(control: BmcControl, machine_id: str) -> None:
    """Raise a problem (422) unless the machine's BMC is Redfish and offers a virtual CD."""
    row = await _redfish_row(control, machine_id)
    try:
        await control._command(row, "find_virtual_cd", lambda d: find_cd(d))  # type: ignore[arg-type]
    except Unprocessable as e:
        raise Unprocessable(
            f'{e.detail}; boot machine {machine_id} with {{"via": "network"}} instead',
            bmc_id=row.id,
        ) from None


async def insert_for(control: BmcControl, machine_id: str, url: str, step: str | None) -> None:
    """Insert ``url`` into the machine's virtual CD, journaled as ``vmedia:insert``."""
    row = await _redfish_row(control, machine_id)
    await control._fence(row, "vmedia:insert", step)
    await control._command(row, "insert_media", lambda d: insert(d, url))  # type: ignore[arg-type]


async def boot_cd_for(control: BmcControl, machine_id: str, step: str | None) -> None:
    """The machine's next boot (only) from its virtual CD, journaled as ``boot:cd``."""
    row = await _redfish_row(control, machine_id)
    await control._fence(row, "boot:cd", step)
    await control._command(row, "boot_cd_once", lambda d: boot_cd_once(d))  # type: ignore[arg-type]


async def eject_for(control: BmcControl, machine_id: str) -> None:
    row = await _redfish_row(control, machine_id)
    await control._fence(row, None, None)
    await control._command(row, "eject_media", lambda d: eject(d))  # type: ignore[arg-type]
