"""A scriptable IPMI BMC on pyghmi's server class, for fault injection. Run as its own process:

    python fault_bmc.py PORT MODE [PASSWORD]

MODE: ``ok`` answers everything; ``slow`` answers chassis commands after 1.5 s; ``timeout`` logs
in but never answers chassis commands; ``vanish`` exits (no reply) on the first chassis control.
Every chassis control it acts on is appended to stdout as ``control N`` so a test can count them.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import pyghmi.ipmi.bmc as bmc


class FaultBmc(bmc.Bmc):
    def __init__(self, port: int, mode: str, password: str) -> None:
        super().__init__(
            {"admin": password},
            port=port,
            address="127.0.0.1",
            bmcuuid=uuid.UUID("6b1e2a5c-0d3f-4e0a-9c57-1f2e3d4c5b6a"),
        )
        self.mode = mode
        self.power = "off"

    def get_power_state(self) -> str:
        return self.power

    def _control(self, state: str) -> None:
        print(f"control {state}", flush=True)
        self.power = state

    def power_on(self) -> None:
        self._control("on")

    def power_off(self) -> None:
        self._control("off")

    def power_cycle(self) -> None:
        self._control("on")

    def power_shutdown(self) -> None:
        self._control("off")

    def handle_raw_request(self, request, session):  # type: ignore[no-untyped-def]
        if request["netfn"] == 0:
            if self.mode == "timeout":
                return None
            if self.mode == "slow":
                time.sleep(1.5)
            if self.mode == "vanish" and request["command"] == 2:
                os._exit(3)
        return super().handle_raw_request(request, session)


if __name__ == "__main__":
    port, mode = int(sys.argv[1]), sys.argv[2]
    password = sys.argv[3] if len(sys.argv) > 3 else "password"
    server = FaultBmc(port, mode, password)
    print("ready", flush=True)
    server.listen()
