"""Shared helpers for the node image tests: the built image and a QEMU runner that reads the
serial console until the lines a test waits for appear."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from vmlab import procs

ROOT = Path(__file__).resolve().parents[2]

needs_qemu_root = [
    pytest.mark.root,
    pytest.mark.lab,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (QEMU lab tests, loop devices)"),
    pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"
    ),
]


@pytest.fixture(scope="session")
def node_image() -> Path:
    """The node image folder (built once, reused while its inputs are unchanged)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("building the node image needs apt-get and dpkg-deb (Debian)")
    from bootassets.node import ensure_node_built

    return ensure_node_built()


def boot_until(
    qemu: list[str],
    console: Path,
    wanted: list[str],
    *,
    timeout: float = 240,
    netns: str | None = None,
    stop_on: tuple[str, ...] = (),
    also: Callable[[], bool] | None = None,
) -> str:
    """Run QEMU (serial to ``console``) until every string in ``wanted`` is on the console (and
    ``also()`` is true), one in ``stop_on`` is, QEMU ends, or ``timeout`` passes; then stop it.
    Returns the console log."""
    cmd = ["qemu-system-x86_64", "-accel", "tcg", *qemu]
    cmd += ["-display", "none", "-monitor", "none", "-serial", f"file:{console}", "-no-reboot"]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    log_file = console.with_suffix(".qemu.log")
    proc = subprocess.Popen(
        cmd, stdout=log_file.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    text = ""
    try:
        while time.monotonic() < deadline:
            text = console.read_text(errors="replace") if console.exists() else ""
            if all(w in text for w in wanted) and (also is None or also()):
                break
            if any(s in text for s in stop_on):
                break
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    finally:
        procs.stop_group(proc)
    text = console.read_text(errors="replace") if console.exists() else ""
    print("\n".join(line for line in text.splitlines() if "metald-node" in line))
    return text
