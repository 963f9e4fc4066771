"""BIOS settings and firmware inventory (issue 16, items 4 and 5) through the Redfish driver.

sushy-emulator's fake driver has neither (its BIOS calls raise NotSupported, and it serves no
UpdateService), so these run against the lab's own Redfish BMC in front of a real QEMU."""

from __future__ import annotations

import pytest

from metald.bmc.base import BmcEndpoint, BmcUnsupported, PowerAction
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import LabRedfish, Sushy


def _lab_driver(peer: LabRedfish) -> RedfishDriver:
    ep = BmcEndpoint("127.0.0.1", peer.port, peer.username, peer.password)
    return RedfishDriver(ep, scheme="http", request_timeout_s=5.0)


async def test_firmware_inventory_from_the_update_service(lab_redfish: LabRedfish) -> None:
    d = _lab_driver(lab_redfish)
    try:
        items = {x.id: x for x in await d.firmware_inventory()}
    finally:
        await d.close()
    assert set(items) == {"BMC", "BIOS", "NIC.1"}
    assert items["BIOS"].name == "OVMF" and items["BIOS"].version == "2022.11"
    assert items["BMC"].version == "1.4.0" and items["BMC"].updateable is True


async def test_bios_settings_pending_until_the_next_boot(lab_redfish: LabRedfish) -> None:
    d = _lab_driver(lab_redfish)
    try:
        before = await d.bios()
        assert before.current["SriovGlobalEnable"] == "Disabled" and before.pending == {}
        await d.set_bios_pending({"SriovGlobalEnable": "Enabled", "NumaNodesPerSocket": 2})
        staged = await d.bios()
        assert staged.current["SriovGlobalEnable"] == "Disabled"
        assert staged.pending == {"SriovGlobalEnable": "Enabled", "NumaNodesPerSocket": 2}
        # A value the BMC refuses is refused, not silently staged.
        with pytest.raises(BmcUnsupported, match="not allowed"):
            await d.set_bios_pending({"SriovGlobalEnable": "Maybe"})
        await d.set_power(PowerAction.ON)  # the firmware applies them as it starts
        after = await d.bios()
        assert after.current["SriovGlobalEnable"] == "Enabled"
        assert after.current["NumaNodesPerSocket"] == 2 and after.pending == {}
        await d.set_power(PowerAction.OFF)
    finally:
        await d.close()


async def test_sushy_fake_driver_has_no_bios_nor_firmware(sushy: Sushy) -> None:
    """Why the lab BMC proves items 4 and 5: the third-party emulator does not offer them."""
    ep = BmcEndpoint("127.0.0.1", sushy.port, "admin", "unused")
    d = RedfishDriver(ep, scheme="http", request_timeout_s=5.0)
    try:
        with pytest.raises(BmcUnsupported):
            await d.firmware_inventory()
        with pytest.raises(BmcUnsupported):
            await d.bios()
    finally:
        await d.close()
