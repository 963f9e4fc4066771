"""One machine's power and boot device, as a BMC sees them, carried out through QMP.

Both faces of the virtual BMC (IPMI and Redfish) call this class, so they share one boot
override and agree on the power state.

  off            the VM is paused (prelaunch, paused, or a guest poweroff under -no-shutdown)
  on             the VM runs, or is paused as a hung machine (vmlab.faults.pause: the marker
                 file ``hung_marker``); a power off, reset or cycle ends the hang
  power on       system_reset -> wait for its RESET event -> cont
  power off      stop (instant, like pulling power)
  soft off       system_powerdown: ACPI power button, the guest decides
  reset          system_reset (the machine keeps running; one that is off comes on)
  power cycle    stop, then power on

Every request either face receives is appended to the machine's command log (JSON lines: time,
client address, face, command), so a test can count what each BMC client sent. A hold file
(tests) makes a power-off take effect only once the file is removed: a machine slow to go off.

Boot override (Redfish BootSourceOverride*, IPMI boot flags): target pxe or hdd, once or
continuous. QEMU rebuilds the firmware's boot order from the devices' ``bootindex`` at each
reset, whoever causes it, so an override is written to ``bootindex`` as soon as it is set. A
"once" override is consumed by the next reset (from the BMC, from the guest rebooting, or
from anyone else), and the standing order is put back when that reset has settled, as with real
firmware.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from .qemu import CD_ID, DISK_ID, NIC_ID
from .qmp import QmpClient

TARGETS = ("none", "pxe", "hdd", "cd")
MODES = ("disabled", "once", "continuous")
DEFAULT_ORDER = ("hdd", "pxe")  # firmware default: disk first, network as fallback
DEVICE_OF = {"pxe": NIC_ID, "hdd": DISK_ID, "cd": CD_ID}
RUNNING = "running"
ONCE_SETTLE_S = 3.0
HOLD_POLL_S = 0.1


@dataclass
class BootOverride:
    target: str = "none"
    mode: str = "disabled"

    @property
    def active(self) -> bool:
        return self.mode != "disabled" and self.target != "none"


def hung_marker(qmp_path: str | Path) -> Path:
    """The file that says the machine's pause is a hang, not a power-off: ``<machine>.hung``
    beside its QMP sockets (``<machine>.qmp``, ``<machine>.qmp-bmc``)."""
    return Path(qmp_path).with_suffix(".hung")


class MachineControl:
    def __init__(
        self,
        qmp_path: str,
        command_log: str | None = None,
        hold_off: str | None = None,
        hung: str | Path | None = None,
    ) -> None:
        self.qmp = QmpClient(qmp_path)
        self.override = BootOverride()
        self._lock = asyncio.Lock()
        self._generation = 0  # bumped by every change, so a late restore never undoes one
        self._once_watch: asyncio.Task[None] | None = None
        self.command_log = Path(command_log) if command_log else None
        self.hold_off = Path(hold_off) if hold_off else None
        self._held: asyncio.Task[None] | None = None
        self.hung = Path(hung) if hung else None

    def record(self, source: str, face: str, command: str) -> None:
        """Append one request to the command log ("power off", "boot pxe once", "read")."""
        if self.command_log is None:
            return
        line = json.dumps({"t": time.time(), "from": source, "face": face, "command": command})
        with open(self.command_log, "a") as f:
            f.write(line + "\n")

    async def connect(self) -> None:
        await self.qmp.connect()

    async def close(self) -> None:
        for task in (self._once_watch, self._held):
            if task is not None:
                task.cancel()
        await self.qmp.close()

    # ---- power ---------------------------------------------------------------------------------

    async def is_on(self) -> bool:
        status = await self.qmp.execute("query-status")
        if self.hung is not None and status["status"] == "paused" and self.hung.exists():
            return True  # frozen, not off: the BMC still sees power
        return status["status"] == RUNNING

    def _end_hang(self) -> None:
        """A power action from the BMC ends a hang: the machine is what QEMU says again."""
        if self.hung is not None:
            self.hung.unlink(missing_ok=True)

    async def power_on(self) -> None:
        async with self._lock:
            if not await self.is_on():
                await self._reset()
                await self.qmp.execute("cont")

    async def power_off(self) -> None:
        async with self._lock:
            if self.hold_off is not None and self.hold_off.exists():
                if self._held is None:
                    self._held = asyncio.create_task(self._off_when_released())
                return
            self._end_hang()
            await self.qmp.execute("stop")

    async def _off_when_released(self) -> None:
        assert self.hold_off is not None
        while self.hold_off.exists():  # a file the test removes: polled, nothing to wait on
            await asyncio.sleep(HOLD_POLL_S)
        async with self._lock:
            self._end_hang()
            await self.qmp.execute("stop")
        self._held = None

    async def replace_qemu(self, restart: Callable[[], Awaitable[None]]) -> None:
        """Run ``restart`` (which stops this machine's QEMU and starts a new one on the same
        sockets), then reconnect and put the boot order (with any override) back: the new
        QEMU starts with the command line's order, and a pending once-override still holds."""
        async with self._lock:
            if self._once_watch is not None:
                self._once_watch.cancel()
                self._once_watch = None
            await restart()
            # The same client, reconnected: others hold it too (the virtual CD drive).
            await self.qmp.close()
            await self.qmp.connect()
            self._generation += 1
            order = _first(self.override.target) if self.override.active else DEFAULT_ORDER
            await self._set_order(order)
            if self.override.active and self.override.mode == "once":
                self._once_watch = asyncio.create_task(self._consume_once(self._generation))

    async def soft_off(self) -> None:
        async with self._lock:
            if await self.is_on():
                await self.qmp.execute("system_powerdown")

    async def reset(self) -> None:
        """Hard reset; a machine that is off is powered on (what BMCs commonly do)."""
        async with self._lock:
            self._end_hang()
            was_on = await self.is_on()
            await self._reset()
            if not was_on:
                await self.qmp.execute("cont")

    async def power_cycle(self) -> None:
        async with self._lock:
            self._end_hang()
            await self.qmp.execute("stop")
            await self._reset()
            await self.qmp.execute("cont")

    async def nmi(self) -> None:
        async with self._lock:
            await self.qmp.execute("inject-nmi")

    # ---- boot device ---------------------------------------------------------------------------

    async def set_boot_override(self, target: str, mode: str) -> None:
        if target not in TARGETS or mode not in MODES:
            raise ValueError(f"boot override {target}/{mode} not one of {TARGETS} x {MODES}")
        async with self._lock:
            self._generation += 1
            if self._once_watch is not None:
                self._once_watch.cancel()
                self._once_watch = None
            if target == "none" or mode == "disabled":
                self.override = BootOverride()
                await self._set_order(DEFAULT_ORDER)
                return
            self.override = BootOverride(target, mode)
            await self._set_order(_first(target))
            if mode == "once":
                self._once_watch = asyncio.create_task(self._consume_once(self._generation))

    async def boot_order(self) -> list[str]:
        """Devices by QEMU's current bootindex, first to boot first."""
        ranked = []
        for target, device in DEVICE_OF.items():
            index = await self.qmp.execute(
                "qom-get", {"path": f"/machine/peripheral/{device}", "property": "bootindex"}
            )
            if index >= 0:
                ranked.append((index, target))
        return [target for _, target in sorted(ranked)]

    def _standing_order(self) -> tuple[str, ...]:
        if self.override.mode == "continuous":
            return _first(self.override.target)
        return DEFAULT_ORDER

    async def _reset(self) -> None:
        with self.qmp.subscribe() as events:
            await self.qmp.execute("system_reset")
            # Wait for this very reset before going on (a `cont` must not run the old state).
            await events.wait("RESET", guest=False, reason="host-qmp-system-reset")

    async def _consume_once(self, generation: int) -> None:
        """Use up a one-time override at the next reset, then put the standing order back.

        The firmware's boot order is fixed at each reset, and SeaBIOS resets the machine
        itself a few times right after a reset from outside: restoring at the first reset
        would let those later ones pick up the standing order. So the order is restored only
        after ONCE_SETTLE_S without a reset; an OS rebooting comes much later than that.
        """
        with self.qmp.subscribe() as events:
            await events.wait("RESET", timeout=None)
            async with self._lock:
                if generation != self._generation:
                    return
                self.override = BootOverride()  # BMCs report a one-time override used now
            while True:
                try:
                    await events.wait("RESET", timeout=ONCE_SETTLE_S)
                except TimeoutError:
                    break
        async with self._lock:
            if generation == self._generation:  # nothing newer was asked for meanwhile
                await self._set_order(self._standing_order())

    async def _set_order(self, order: tuple[str, ...]) -> None:
        # QEMU refuses two devices with one bootindex, so clear all before assigning.
        for device in DEVICE_OF.values():
            await self._set_bootindex(device, -1)
        for rank, target in enumerate(order, start=1):
            await self._set_bootindex(DEVICE_OF[target], rank)

    async def _set_bootindex(self, device: str, index: int) -> None:
        await self.qmp.execute(
            "qom-set",
            {"path": f"/machine/peripheral/{device}", "property": "bootindex", "value": index},
        )


def _first(target: str) -> tuple[str, ...]:
    return (target,) + tuple(t for t in DEFAULT_ORDER if t != target)
