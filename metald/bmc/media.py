"""Virtual media boot through a machine's BMC, as the API and the provisioning driver use it:
which machines boot this way (a label), the ISO's URL, and the fenced, journaled commands
(``insert_for``, ``boot_cd_for``, ``eject_for``). The Redfish requests themselves are
``metald.bmc.virtual_media``'s, run through ``BmcControl.virtual_media``, so nothing outside
metald.bmc imports a protocol module (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

from metald.errors import Unprocessable

#: The boot ISO under the boot HTTP listener's assets (``/boot/assets/<name>``).
ISO_NAME = "metald-boot.iso"
#: A machine label that makes metald boot it from virtual media instead of PXE (its network
#: gives no DHCP boot options): ``boot-via=virtual-media``.
BOOT_VIA_LABEL = "boot-via"
VIRTUAL_MEDIA = "virtual-media"


def iso_url(control: Any) -> str | None:
    """The URL of the boot ISO the BMC fetches: on the boot HTTP listener (``vmedia_base``,
    set by the daemon); None where this instance serves no boot HTTP."""
    base = getattr(control, "vmedia_base", None)
    return f"{base.rstrip('/')}/boot/assets/{ISO_NAME}" if base else None


def wants_virtual_media(labels: dict[str, str] | None) -> bool:
    return (labels or {}).get(BOOT_VIA_LABEL) == VIRTUAL_MEDIA


async def _redfish_row(control: Any, machine_id: str) -> Any:
    row = await control.row_for_machine(machine_id)
    if row.protocol != "redfish":
        raise Unprocessable(
            f"machine {machine_id}'s BMC {row.id} speaks {row.protocol}, and virtual media "
            'needs Redfish: boot it with {"via": "network"}, or register its Redfish BMC',
            bmc_id=row.id,
        )
    return row


async def check_for(control: Any, machine_id: str) -> None:
    """Raise a problem (422) unless the machine's BMC is Redfish and offers a virtual CD."""
    row = await _redfish_row(control, machine_id)
    try:
        await control.virtual_media(row, "find_virtual_cd")
    except Unprocessable as e:
        raise Unprocessable(
            f'{e.detail}; boot machine {machine_id} with {{"via": "network"}} instead',
            bmc_id=row.id,
        ) from None


async def insert_for(control: Any, machine_id: str, url: str, step: str | None) -> None:
    """Insert ``url`` into the machine's virtual CD, journaled as ``vmedia:insert``."""
    row = await _redfish_row(control, machine_id)
    await control._fence(row, "vmedia:insert", step)
    await control.virtual_media(row, "insert_media", url)


async def boot_cd_for(control: Any, machine_id: str, step: str | None) -> None:
    """The machine's next boot (only) from its virtual CD, journaled as ``boot:cd``."""
    row = await _redfish_row(control, machine_id)
    await control._fence(row, "boot:cd", step)
    await control.virtual_media(row, "boot_cd_once")


async def eject_for(control: Any, machine_id: str) -> None:
    row = await _redfish_row(control, machine_id)
    await control._fence(row, None, None)
    await control.virtual_media(row, "eject_media")
