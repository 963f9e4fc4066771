"""A stand-in for BmcService: records what the driver asks, fails on demand."""

from __future__ import annotations

from typing import Any

from metald.errors import MetaldError, NotFound


class FakeBmc:
    def __init__(self, power_state: str = "on", fail: str | None = None) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.power_state = power_state
        #: "error": every command fails like an unreachable BMC; "absent": no BMC linked.
        self.fail = fail

    def _check(self, machine_id: str) -> None:
        if self.fail == "absent":
            raise NotFound(f"machine {machine_id} has no BMC")
        if self.fail == "error":
            raise MetaldError("the BMC did not answer within 10 s")

    async def set_boot_device(
        self,
        machine_id: str,
        device: str,
        persistent: bool = False,
        uefi: bool = True,
        actor: str = "",
    ) -> dict[str, Any]:
        self._check(machine_id)
        self.calls.append((machine_id, "boot", f"{device}{'+persistent' if persistent else ''}"))
        return {}

    async def power(self, machine_id: str, action: str, actor: str = "") -> dict[str, Any]:
        self._check(machine_id)
        self.calls.append((machine_id, "power", action))
        return {"power_state": self.power_state}
