"""Serial-over-LAN for a lab machine's virtual BMC: the BMC's end of SOL between the IPMI
session that activated it (pyghmi's server session) and QEMU's serial port, which QEMU
offers as a unix socket (``qemu.serial_socket``) while still writing the serial log.

The SOL rules (sequence numbers, acks, retransmission) are metald's own pure core, used here
from the BMC's side; pyghmi carries the payloads. pyghmi's server runs on its own thread: its
callbacks hop onto the asyncio loop, where the core and the serial socket live.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from pathlib import Path
from typing import Any

from metald.bmc import sol

log = logging.getLogger(__name__)

MAX_PAYLOAD = 252


class SolBridge:
    def __init__(
        self, serial_socket: Path, loop: asyncio.AbstractEventLoop, ipmi_port: int = 623
    ) -> None:
        self.path = serial_socket
        self.loop = loop
        self.ipmi_port = ipmi_port
        self.session: Any = None
        self.core = sol.SolCore(bmc_side=True, chunk=MAX_PAYLOAD - 4)
        self._writer: asyncio.StreamWriter | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = self.loop.create_task(self._serial())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- from pyghmi's thread ---

    def handle(self, request: dict[str, Any], session: Any) -> bool:
        """Activate / Deactivate Payload for SOL; False: not ours."""
        if request["netfn"] != 6 or request["command"] not in (
            sol.CMD_ACTIVATE_PAYLOAD,
            sol.CMD_DEACTIVATE_PAYLOAD,
        ):
            return False
        data = request["data"]
        if not data or data[0] != sol.PAYLOAD_SOL:
            session.send_ipmi_response(code=0xCC)
            return True
        if request["command"] == sol.CMD_ACTIVATE_PAYLOAD:
            if self.session is not None and self.session is not session:
                session.send_ipmi_response(code=sol.ALREADY_ACTIVE)
                return True
            session.sol_handler = lambda p: self.loop.call_soon_threadsafe(self._from_console, p)
            self.loop.call_soon_threadsafe(self._activate, session)
            size = struct.pack("<H", MAX_PAYLOAD)
            session.send_ipmi_response(
                data=[0, 0, 0, 0, *size, *size, *struct.pack("<H", self.ipmi_port), 0xFF, 0xFF]
            )
        else:
            self.loop.call_soon_threadsafe(self._deactivate)
            session.send_ipmi_response()
        return True

    # --- on the loop ---

    def _activate(self, session: Any) -> None:
        self.session = session
        self.core = sol.SolCore(bmc_side=True, chunk=MAX_PAYLOAD - 4)

    def _deactivate(self) -> None:
        if self.session is not None:
            self.session.sol_handler = None
        self.session = None

    def _from_console(self, payload: bytes) -> None:
        if self.session is None:
            return
        data = self.core.on_payload(bytes(payload), self.loop.time())
        if self.core.break_seen:
            self.core.break_seen = False
            log.info("SOL break requested (QEMU's socket serial has no break to send)")
        if data and self._writer is not None:
            self._writer.write(data)
        self._pump()

    def _pump(self) -> None:
        if self.session is None:
            return
        for payload in self.core.due(self.loop.time()):
            self.session.send_payload(payload, payload_type=sol.PAYLOAD_SOL, retry=False)
        if self.core.failed:
            log.info("SOL console stopped acknowledging; deactivating")
            self._deactivate()
            return
        if self._timer is not None:
            self._timer.cancel()
        if (d := self.core.next_deadline()) is not None:
            self._timer = self.loop.call_at(d, self._pump)

    async def _serial(self) -> None:
        """Read the machine's serial port for the life of the BMC (QEMU may restart)."""
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(str(self.path))
            except OSError:
                await asyncio.sleep(0.5)
                continue
            try:
                while data := await reader.read(4096):
                    if self.session is not None:
                        self.core.write(data)
                        self._pump()
            except OSError:
                pass
            finally:
                self._writer.close()
                self._writer = None
            await asyncio.sleep(0.5)
