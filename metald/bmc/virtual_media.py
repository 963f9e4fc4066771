"""Redfish VirtualMedia: insert an ISO by URL into the BMC's virtual CD, boot from it once,
eject it: the protocol half. The fenced, journaled commands that the API and the provisioning
driver send through a machine's BMC (``insert_for``, ``boot_cd_for``, ``eject_for``) are in
``metald.bmc.media``, which reaches these through ``BmcControl.virtual_media`` (no protocol
module is imported from outside metald.bmc).

It goes through the Redfish driver's own requests, so the same guards hold: every link the BMC
hands back must stay on the BMC's origin, credentials and TLS pinning are the driver's. The
virtual CD is looked for under the system (newer Redfish) and under its managers (older).
"""

from __future__ import annotations

from typing import Any

from metald.bmc.base import BmcProtocolError, BmcUnsupported
from metald.bmc.redfish import RedfishDriver

CD_TYPES = {"CD", "DVD"}


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


#: What ``BmcControl.virtual_media`` may run, by operation name.
OPERATIONS = {
    "find_virtual_cd": find_cd,
    "insert_media": insert,
    "eject_media": eject,
    "boot_cd_once": boot_cd_once,
}
