"""Where the console service's links come from: the machine's registered BMC, through its
driver's ``SerialConsole`` capability (``metald.bmc.capabilities``; IPMI Serial-over-LAN), with
the daemon's BMC settings for timing. Kept apart from ``metald.bmc.console`` so the API reaches
consoles without importing a protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metald.bmc.capabilities import Capability, ConsoleLink
from metald.bmc.console import ConsoleUnsupported
from metald.bmc.executor import capabilities_of


class BmcLinks:
    """Links from the machine's registered BMC. Redfish has no console metald speaks (vendors
    carry it over SSH or their own WebSocket), so a BMC whose driver lacks the serial-console
    capability is a clear 409 before any WebSocket opens."""

    def __init__(self, bmc_service: Any, secrets: Any) -> None:
        self.bmc = bmc_service
        #: Unused since the driver holds the BMC's credentials; kept for the daemon's wiring.
        self.secrets = secrets

    async def check(self, machine_id: str) -> Any:
        """The machine's BMC row, when it can carry a console (NoBmc / ConsoleUnsupported)."""
        row = await self.bmc.control.row_for_machine(machine_id)
        if Capability.SERIAL_CONSOLE not in capabilities_of(row.protocol):
            raise ConsoleUnsupported(
                f"machine {machine_id}'s BMC speaks {row.protocol}, which has no "
                f"{Capability.SERIAL_CONSOLE.value} capability; metald carries serial "
                "consoles over IPMI Serial-over-LAN only. Register the BMC's IPMI interface "
                "(protocol ipmi) for this machine, or use the BMC's own web console",
                capability=Capability.SERIAL_CONSOLE.value,
            )
        return row

    async def __call__(self, machine_id: str, on_data: Callable[[bytes], None]) -> ConsoleLink:
        row = await self.check(machine_id)
        driver = self.bmc.control.driver_for(row)
        link: ConsoleLink = driver.serial_console(
            on_data, timeout_s=max(1.0, self.bmc.cfg.timeout_s)
        )
        return link
