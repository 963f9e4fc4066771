"""Helpers for the lab tests: talk to a lab's BMCs from inside its namespace, read QEMU over
its spare QMP socket, wait for serial console text, and check that nothing of a lab is left."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vmlab import lab as vlab
from vmlab import netns, plan, procs, qemu  # noqa: F401 - re-exported for the tests
from vmlab.qmp import QmpClient

VM_LAB = [sys.executable, "-m", "vmlab"]


def in_ns(ns: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout
    )


def ipmitool(state: dict[str, Any], machine: dict[str, Any], *args: str) -> str:
    bmc = machine["bmc"]
    argv = ["ipmitool", "-I", "lanplus", "-C", "3", "-H", bmc["address"]]
    argv += ["-U", bmc["username"], "-P", bmc["password"], *args]
    done = in_ns(state["netns"], argv)
    assert done.returncode == 0, f"ipmitool {args}: {done.stderr}"
    return done.stdout


def redfish(
    state: dict[str, Any],
    machine: dict[str, Any],
    method: str,
    path: str,
    body: Any = None,
    auth: bool = True,
) -> tuple[int, Any]:
    """One HTTP request to the machine's Redfish service with curl, from inside the lab."""
    bmc = machine["bmc"]
    argv = ["curl", "-s", "-m", "30", "-o", "-", "-w", "\n%{http_code}", "-X", method]
    if auth:
        argv += ["-u", f"{bmc['username']}:{bmc['password']}"]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    argv.append(bmc["redfish_url"] + path)
    done = in_ns(state["netns"], argv)
    assert done.returncode == 0, f"curl {method} {path}: rc {done.returncode} {done.stderr}"
    text, _, code = done.stdout.rpartition("\n")
    return int(code), (json.loads(text) if text.strip() else None)


def system_path(machine: dict[str, Any]) -> str:
    return f"/redfish/v1/Systems/{machine['name']}"


async def qmp(machine: dict[str, Any], command: str, arguments: dict | None = None) -> Any:
    async with QmpClient(machine["qmp"]) as client:
        return await client.execute(command, arguments)


async def qemu_running(machine: dict[str, Any]) -> bool:
    return (await qmp(machine, "query-status"))["status"] == "running"


async def qemu_boot_order(machine: dict[str, Any]) -> list[str]:
    ranked = []
    for target, device in (("pxe", "nic0"), ("hdd", "disk0")):
        index = await qmp(
            machine, "qom-get", {"path": f"/machine/peripheral/{device}", "property": "bootindex"}
        )
        if index >= 0:
            ranked.append((index, target))
    return [t for _, t in sorted(ranked)]


async def wait_boot_order(machine: dict[str, Any], order: list[str], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (got := await qemu_boot_order(machine)) != order:
        assert time.monotonic() < deadline, f"boot order stayed {got}, expected {order}"
        await asyncio.sleep(0.2)


def log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def wait_for_text(path: str, needles: list[str], offset: int = 0, timeout: float = 90) -> str:
    """Serial log text from ``offset`` once every needle has appeared in it, in order."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        position = 0
        for needle in needles:
            found = text.find(needle, position)
            if found < 0:
                break
            position = found + len(needle)
        else:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{needles} not seen in {path} within {timeout} s; tail: {text[-800:]!r}")


#: What a serial log shows once SeaBIOS has named the first device it boots from: the banner,
#: then the whole "Booting from ..." line (waiting for its prefix alone once returned a line
#: still being written, and an empty device name).
SEABIOS_FIRST_BOOT = ["SeaBIOS (version", "Booting from ", "\n"]


def first_seabios_boot_device(text: str) -> str:
    """The device SeaBIOS tried first in the first boot that ``text`` shows."""
    after_banner = text[text.index("SeaBIOS (version") :]
    line = after_banner[after_banner.index("Booting from ") :].splitlines()[0]
    return line.removeprefix("Booting from ").rstrip(". ")


def host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def wait_state(path: Path, predicate: Any, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = None
        if state is not None and predicate(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach the expected state in {timeout} s")


def assert_lab_gone(name: str, state: dict[str, Any], lab_dir: Path) -> None:
    """Nothing of the lab is left: processes, namespace, bridge, taps, files, slot."""
    ns = plan.netns_name(name)
    assert not netns.exists(ns), f"namespace {ns} is still there"
    assert not any(ns == n for n in netns.list_namespaces(plan.NETNS_PREFIX))
    for p in state.get("processes", []):
        alive = procs.same_process(p["pid"], p["start_time"]) and procs.is_running(p["pid"])
        assert not alive, f"{p['role']} pid {p['pid']} still runs"
    names = host_links()
    if "bridge" in state:
        assert state["bridge"] not in names
    for m in state.get("machines", []):
        assert m["tap"] not in names
    assert not lab_dir.exists(), f"{lab_dir} still holds {list(lab_dir.iterdir())}"
    if vlab.SLOTS_DIR.is_dir():
        for slot_file in vlab.SLOTS_DIR.iterdir():
            assert json.loads(slot_file.read_text()).get("name") != name
