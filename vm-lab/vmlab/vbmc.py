"""One machine's virtual BMC: IPMI (pyghmi's BMC server) and Redfish, both on the machine's BMC
address in the lab namespace, both driving QEMU through one QMP connection.

Run as its own process, inside the lab namespace::

    python -m vmlab.vbmc --state <lab state.json> --machine m0

pyghmi's server is blocking, so it runs in a thread; its handlers hand each request to the
asyncio loop (where QMP and Redfish live) and wait for the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pyghmi.ipmi.bmc as pyghmi_bmc
import pyghmi.ipmi.private.serversession as serversession
from aiohttp import web

from . import qemu, redfish, redfish_secureboot
from .power import MachineControl, hung_marker
from .secureboot_fw import FirmwareVars
from .vsel import SystemEventLog
from .vsol import SolBridge

# RMCP+ algorithm numbers (IPMI 2.0 tables 13-17..13-19): the server speaks only cipher suite 3.
RAKP_HMAC_SHA1, HMAC_SHA1_96, AES_CBC_128 = 1, 1, 1
NO_CIPHER_SUITE_MATCH = 0x11  # RMCP+ status code
IPMI_CALL_TIMEOUT = 20.0
BOOT_FLAGS_PARAM = 5
IPMI_DEVICE = {"network": "pxe", "hd": "hdd", "default": "none"}
DEVICE_CODE = {"pxe": 0x04, "hdd": 0x08, "none": 0x00}  # boot device selector, bits 5:2
CHASSIS_CONTROL = {0: "off", 1: "on", 2: "cycle", 3: "reset", 4: "nmi", 5: "soft"}


class SuiteThreeSession(serversession.ServerSession):
    """pyghmi's server session, but refusing proposals it cannot honour.

    pyghmi's server always answers an open-session request with cipher suite 3 (SHA-1), whatever
    was proposed. pyghmi's own client proposes SHA-256 first and then fails on the SHA-1 reply;
    told "no matching cipher suite" it retries with SHA-1, which works. ipmitool -C 3 proposes
    SHA-1 directly.
    """

    def create_open_session_response(self, request: bytearray) -> bytearray:
        proposed = (request[12], request[20], request[28]) if len(request) >= 32 else None
        if proposed != (RAKP_HMAC_SHA1, HMAC_SHA1_96, AES_CBC_128):
            self.clientsessionid = request[4:8]
            return bytearray([request[0], NO_CIPHER_SUITE_MATCH, 0, 0]) + request[4:8]
        return super().create_open_session_response(request)


class LabIpmiBmc(pyghmi_bmc.Bmc):
    """IPMI chassis commands mapped onto MachineControl (running on ``loop``)."""

    def __init__(
        self,
        authdata: dict[str, str],
        address: str,
        port: int,
        system_uuid: str,
        control: MachineControl,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(authdata, port=port, bmcuuid=uuid.UUID(system_uuid), address=address)
        self.control = control
        self.loop = loop
        self.sol: SolBridge | None = None
        # A System Event Log (vmlab.vsel), and a Get Device ID that says so honestly: device
        # SDRs (bit 7 of the revision) but none, no SDR repository, so IPMI clients (pyghmi)
        # read the SEL without first walking a sensor repository this BMC does not have.
        self.sel = SystemEventLog()
        self.revision = 0x80

    def handle_raw_request(self, request: dict[str, Any], session: Any) -> None:
        if self.sol is not None and self.sol.handle(request, session):
            return
        if self.sel.handle(request, session):
            return
        super().handle_raw_request(request, session)

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(IPMI_CALL_TIMEOUT)

    def sessionless_data(self, data: bytes, sockaddr: Any) -> None:
        # Open-session requests (RMCP+ payload 0x10) get our session class; the rest as usual.
        raw = bytearray(data)
        if (
            len(raw) >= 22
            and raw[0] == 6
            and raw[2:4] == b"\xff\x07"
            and raw[4] == 6
            and raw[5] == 0x10
        ):
            SuiteThreeSession(
                self.authdata, self.kg, sockaddr, self.serversocket, raw[16:], self.uuid, bmc=self
            )
            return
        super().sessionless_data(data, sockaddr)

    def get_system_guid(self) -> uuid.UUID:
        return self.uuid

    def get_chassis_status(self, session: Any) -> None:
        self.control.record(session.sockaddr[0], "ipmi", "read")
        super().get_chassis_status(session)

    def control_chassis(self, request: dict[str, Any], session: Any) -> None:
        directive = request["data"][0] if request["data"] else None
        self.control.record(
            session.sockaddr[0], "ipmi", f"power {CHASSIS_CONTROL.get(directive, directive)}"
        )
        super().control_chassis(request, session)

    def cold_reset(self) -> int:
        return 0  # the BMC restarting itself changes nothing a client can see

    def get_power_state(self) -> str:
        return "on" if self._run(self.control.is_on()) else "off"

    def power_on(self) -> None:
        self._run(self.control.power_on())

    def power_off(self) -> None:
        self._run(self.control.power_off())

    def power_reset(self) -> None:
        self._run(self.control.reset())

    def power_cycle(self) -> None:
        self._run(self.control.power_cycle())

    def power_shutdown(self) -> None:
        self._run(self.control.soft_off())

    def pulse_diag(self) -> None:
        self._run(self.control.nmi())

    def set_system_boot_options(self, request: dict[str, Any], session: Any) -> None:
        data = request["data"]
        if not data or data[0] != BOOT_FLAGS_PARAM:
            # Other parameters (set-in-progress, info acknowledge, ...) are accepted and ignored,
            # which is what clients expect of a BMC that has nothing to do for them.
            session.send_ipmi_response()
            return
        flags = data[1] if len(data) > 1 else 0
        selector = (data[2] >> 2) & 0x0F if len(data) > 2 else 0
        device = IPMI_DEVICE.get(pyghmi_bmc.ipmicommand.boot_devices.get(selector, ""))
        if device is None:
            session.send_ipmi_response(code=0xCC)  # invalid data field: no such device here
            return
        mode = "continuous" if flags & 0x40 else "once"
        if not flags & 0x80 or device == "none":
            self.control.record(session.sockaddr[0], "ipmi", "boot none")
            self._run(self.control.set_boot_override("none", "disabled"))
        else:
            self.control.record(session.sockaddr[0], "ipmi", f"boot {device} {mode}")
            self._run(self.control.set_boot_override(device, mode))
        session.send_ipmi_response()

    def get_system_boot_options(self, request: dict[str, Any], session: Any) -> None:
        if request["data"][0] != BOOT_FLAGS_PARAM:
            session.send_ipmi_response(code=0x80)  # parameter not supported
            return
        override = self.control.override
        flags = 0
        if override.active:
            flags = 0x80 | (0x40 if override.mode == "continuous" else 0)
        device = DEVICE_CODE[override.target] if override.active else 0
        session.send_ipmi_response(data=[1, BOOT_FLAGS_PARAM, flags, device, 0, 0, 0])


def machine_entry(state: dict[str, Any], name: str) -> dict[str, Any]:
    for machine in state["machines"]:
        if machine["name"] == name:
            return machine
    raise SystemExit(f"no machine {name} in the lab state")


async def serve(state_path: Path, machine_name: str) -> None:
    state = json.loads(state_path.read_text())
    machine = machine_entry(state, machine_name)
    bmc = machine["bmc"]
    control = MachineControl(
        machine["qmp_bmc"],
        machine.get("bmc_commands"),
        machine.get("bmc_hold_off"),
        hung=hung_marker(machine["qmp_bmc"]),
    )
    await control.connect()

    info = redfish.SystemInfo(
        system_id=machine["name"],
        uuid=machine["uuid"],
        mac=machine["mac"],
        firmware=machine["firmware"],
        memory_mb=machine["memory_mb"],
        cpus=machine["cpus"],
        serial_number=machine["serial_number"],
        username=bmc["username"],
        password=bmc["password"],
        media_dir=Path(machine["disk"]).parent,
    )
    app = redfish.make_app(control, info)
    if machine.get("secure_boot") and redfish_secureboot.SECURE_BOOT in app:
        app[redfish_secureboot.APPLY] = FirmwareVars(machine, state, control).apply
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, bmc["address"], bmc["redfish_port"]).start()

    ipmi = LabIpmiBmc(
        {bmc["username"]: bmc["password"]},
        bmc["address"],
        bmc["ipmi_port"],
        machine["uuid"],
        control,
        asyncio.get_running_loop(),
    )
    ipmi.sol = SolBridge(
        qemu.serial_socket(Path(machine["serial_log"])), asyncio.get_running_loop()
    )
    ipmi.sol.start()
    threading.Thread(target=ipmi.listen, name="ipmi", daemon=True).start()

    # The lab waits for this file: both servers are bound once it exists.
    Path(machine["bmc_ready"]).write_text(str(os.getpid()))
    print(f"vbmc {machine_name}: IPMI {bmc['address']}:{bmc['ipmi_port']}, "
          f"Redfish {bmc['redfish_url']}", file=sys.stderr, flush=True)  # fmt: skip

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await ipmi.sol.stop()
    await runner.cleanup()
    await control.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="virtual BMC of one vm-lab machine")
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--machine", required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.state, args.machine))


if __name__ == "__main__":
    main()
