"""Processes the lab starts and later stops, identified so that a reused pid is never killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - tiny read, closed by GC
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat.rpartition(")")[2].split()
    return int(fields[19])


def is_running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def same_process(pid: int, started: int | None) -> bool:
    return started is not None and start_time(pid) == started


def _reap(pid: int) -> None:
    # Processes this very process started become zombies until waited for.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def signal_group_or_pid(pid: int, sig: int) -> None:
    """Signal the process group the pid leads, or only the pid when it leads none."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything in its process
    group: SIGTERM, up to ``grace`` seconds, then SIGKILL; the child is reaped."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def terminate(pids: Iterable[int], grace: float = 3.0, groups: bool = True) -> list[int]:
    """SIGTERM, wait up to ``grace`` seconds, SIGKILL the rest; return any that still live."""
    pids = list(dict.fromkeys(pids))
    send = signal_group_or_pid if groups else _kill_one
    for pid in pids:
        send(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        if not any(is_running(p) for p in pids):
            return []
        time.sleep(0.05)
    for pid in pids:
        if is_running(pid):
            send(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        for pid in pids:
            _reap(pid)
        alive = [p for p in pids if is_running(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def _kill_one(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
