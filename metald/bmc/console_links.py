"""Where the console service's links come from: the machine's registered BMC row, its
password decrypted only here, the daemon's BMC settings for timing. Kept apart from
``metald.bmc.console`` so the API reaches consoles without importing a protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metald.bmc.console import ConsoleUnsupported
from metald.bmc.sol_link import SolLink


class BmcLinks:
    """Links from the machine's registered BMC: IPMI Serial-over-LAN. Redfish has no console
    metald speaks (vendors carry it over SSH or their own WebSocket), so a Redfish-only BMC
    is a clear 409 before any WebSocket opens."""

    def __init__(self, bmc_service: Any, secrets: Any) -> None:
        self.bmc = bmc_service
        self.secrets = secrets

    async def check(self, machine_id: str) -> Any:
        """The machine's BMC row, when it can carry a console (NoBmc / ConsoleUnsupported)."""
        row = await self.bmc.control.row_for_machine(machine_id)
        if row.protocol != "ipmi":
            raise ConsoleUnsupported(
                f"machine {machine_id}'s BMC speaks {row.protocol}; metald carries serial "
                "consoles over IPMI Serial-over-LAN only. Register the BMC's IPMI interface "
                "(protocol ipmi) for this machine, or use the BMC's own web console"
            )
        return row

    async def __call__(self, machine_id: str, on_data: Callable[[bytes], None]) -> SolLink:
        row = await self.check(machine_id)
        cfg = self.bmc.cfg
        return SolLink(
            row.address,
            row.port,
            row.username,
            self.secrets.decrypt(row.password_enc),
            on_data,
            resend_s=cfg.ipmi_resend_ms / 1000,
            timeout_s=max(1.0, cfg.timeout_s),
        )
