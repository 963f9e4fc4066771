"""The lab's small helpers that tests and benchmarks share: stopping a process group, free
ports. No lab is built."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from vmlab import labnet, procs

# A shell that starts a grandchild (which writes its pid) and waits for it; with TERM ignored
# the group must be killed.
GROUP = 'trap "" TERM; sleep 600 & echo $! > "$1"; wait'


def _group(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    pidfile = tmp_path / "grandchild.pid"
    proc = subprocess.Popen(["sh", "-c", GROUP, "sh", str(pidfile)], start_new_session=True)
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert proc.poll() is None
    return proc, int(pidfile.read_text())


def test_stop_group_stops_the_child_and_its_group_even_when_it_ignores_sigterm(
    tmp_path: Path,
) -> None:
    proc, grandchild = _group(tmp_path)
    procs.stop_group(proc, grace=0.2)
    assert proc.returncode is not None
    # The grandchild was in the group: signalled with it (a zombie of init at most). A killed
    # process still has to be scheduled to exit, which on a loaded machine takes a moment.
    deadline = time.monotonic() + 10
    while procs.is_running(grandchild):
        assert time.monotonic() < deadline, f"grandchild {grandchild} outlived its group"
        time.sleep(0.02)


def test_stop_group_on_a_finished_child_does_nothing() -> None:
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    procs.stop_group(proc)
    assert proc.returncode == 0


def test_free_port_can_be_bound_for_its_kind() -> None:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        port = labnet.free_port(kind)
        with socket.socket(socket.AF_INET, kind) as s:
            s.bind(("127.0.0.1", port))
