"""The lab BMC's Secure Boot state, carried into the machine's firmware.

A Secure Boot machine (``Lab(secure_boot=True)``) runs OVMF's Secure Boot build
(``OVMF_CODE_4M.secboot.fd``, SMM) on its own variable store. What a Redfish client changes
(``SecureBootEnable``, the certificates in PK, KEK, db and dbx: ``vmlab.redfish_secureboot``)
takes effect at the machine's next power-on through the BMC, as real firmware reads its
variables as it starts. QEMU reads the variable store once, when it starts, so the BMC then:

1. stops the machine's QEMU (QMP ``quit``) and waits for it to exit;
2. rewrites its variable store with ``virt-fw-vars`` (the PyPI package ``virt-firmware``):
   PK, KEK, db and dbx replaced by the BMC's certificates, and ``SecureBootEnable`` set, when
   Secure Boot is enabled and a PK is enrolled; without them (disabled), no keys at all: OVMF
   in setup mode enforces nothing. Every other variable (boot options, BootOrder) is kept;
3. starts QEMU again with the same command line (paused, as at the lab's start), reconnects
   the BMC's QMP client and puts the BMC's boot order back.

Then the power-on goes on as for any machine. Nothing happens when the state the firmware
holds is already the one asked for. The new QEMU process is the BMC's child, in the lab's
namespace: ``vm-lab down`` stops it with everything else there.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import procs
from .power import MachineControl
from .redfish_secureboot import SecureBootState

#: The owner GUID the lab's certificates are enrolled under (OVMF's EnrollDefaultKeys GUID).
OWNER = "a0baa8a3-041d-48a8-bc87-c36d121b5e3d"
STOP_TIMEOUT_S = 20.0
START_TIMEOUT_S = 20.0


def virt_fw_vars() -> str:
    return str(Path(sys.executable).parent / "virt-fw-vars")


def wanted(state: SecureBootState) -> tuple[Any, ...]:
    """What the firmware's variables must hold for ``state``: nothing when Secure Boot is off
    or no PK is set (setup mode), else each database's certificates."""
    if not state.enable or not state.dbs["PK"]:
        return ("off",)
    return ("on", *(tuple(c.fingerprint for c in state.dbs[d]) for d in ("PK", "KEK", "db", "dbx")))


def write_vars(vars_file: Path, state: SecureBootState) -> None:
    """Rewrite ``vars_file`` in place for ``state`` (QEMU must not be running on it)."""
    with tempfile.TemporaryDirectory(prefix="vmlab-sb-") as tmp:
        argv = [virt_fw_vars(), "--input", str(vars_file), "--output", f"{tmp}/vars.fd"]
        for name in ("PK", "KEK", "db", "dbx", "SecureBootEnable"):
            argv += ["--delete", name]
        if wanted(state) != ("off",):
            flag = {"PK": "--set-pk", "KEK": "--add-kek", "db": "--add-db", "dbx": "--add-dbx-cert"}
            for db, option in flag.items():
                for i, cert in enumerate(state.dbs[db][:1] if db == "PK" else state.dbs[db]):
                    pem = Path(tmp) / f"{db}-{i}.pem"
                    pem.write_text(cert.pem)
                    argv += [option, OWNER, str(pem)]
            argv.append("--sb")
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"virt-fw-vars failed: {r.stderr.strip() or r.stdout.strip()}")
        Path(f"{tmp}/vars.fd").replace(vars_file)


class FirmwareVars:
    """Keeps one machine's OVMF variables in step with its BMC's Secure Boot state."""

    def __init__(self, machine: dict[str, Any], lab_state: dict[str, Any], control: MachineControl):
        self.machine = machine
        self.control = control
        self.argv: list[str] = machine["qemu_argv"]
        self.vars_file = Path(machine["uefi_vars"])
        self.pid: int | None = next(
            (
                p["pid"]
                for p in lab_state.get("processes", [])
                if p["role"] == "qemu" and p.get("machine") == machine["name"]
            ),
            None,
        )
        self.proc: subprocess.Popen[bytes] | None = None
        #: What the variable store holds: the lab starts every machine with no keys.
        self.applied: tuple[Any, ...] = ("off",)

    async def apply(self, state: SecureBootState) -> bool:
        """Before a power-on: restart the machine on variables that hold ``state`` when they
        do not already. Returns whether it restarted."""
        want = wanted(state)
        if want == self.applied:
            return False
        await self.control.replace_qemu(lambda: self._restart(state))
        self.applied = want
        return True

    async def _restart(self, state: SecureBootState) -> None:
        await self._stop()
        await asyncio.to_thread(write_vars, self.vars_file, state)
        for sock in (self.machine["qmp_bmc"], self.machine["qmp"]):
            Path(sock).unlink(missing_ok=True)
        with open(self.machine["qemu_log"], "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.pid = self.proc.pid
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not (Path(self.machine["qmp_bmc"]).exists() and Path(self.machine["qmp"]).exists()):
            if self.proc.poll() is not None or loop.time() > deadline:
                raise RuntimeError(f"QEMU did not come back (exit {self.proc.poll()})")
            await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        # QEMU may close the socket before it answers.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.control.qmp.execute("quit"), 5)
        await self.control.qmp.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_TIMEOUT_S
        while self.pid is not None and procs.is_running(self.pid):
            if self.proc is not None:
                self.proc.poll()  # reap our own child
            if loop.time() > deadline:
                procs.terminate([self.pid], groups=False)
                break
            await asyncio.sleep(0.05)
