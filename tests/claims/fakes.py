"""A stand-in for the BMC's PowerControl (metald.bmc.control): records what the network-boot step asks, keeps one power state for every
machine (off/on as commanded), fails on demand."""

from __future__ import annotations

from metald.bmc.base import BootTarget, PowerAction, PowerState
from metald.errors import MetaldError, NotFound


class FakeBmc:
    def __init__(self, power_state: str = "on", fail: str | None = None) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.states: dict[str, str] = {}
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
        device: BootTarget,
        persistent: bool = False,
        *,
        uefi: bool | None = None,
        actor: str = "",
        step: str | None = None,
    ) -> None:
        self._check(machine_id)
        self.calls.append((machine_id, "boot", f"{device}{'+persistent' if persistent else ''}"))

    async def read_power(self, machine_id: str, *, actor: str = "") -> PowerState:
        self._check(machine_id)
        self.calls.append((machine_id, "power", "status"))
        return PowerState(self.states.get(machine_id, self.power_state))

    async def power(
        self, machine_id: str, action: PowerAction, *, actor: str = "", step: str | None = None
    ) -> PowerState:
        self._check(machine_id)
        self.calls.append((machine_id, "power", str(action)))
        if action in ("off", "soft-off"):
            self.states[machine_id] = "off"
        elif action in ("on", "cycle", "reset"):
            self.states[machine_id] = "on"
        return PowerState(self.states.get(machine_id, self.power_state))

    @property
    def power_state(self) -> str:
        """Every machine's power state until a command changes one."""
        return self._default

    @power_state.setter
    def power_state(self, value: str) -> None:
        self._default = value
        self.states.clear()
