"""The test BMC peers start reliably: the wait for a peer's port reads the socket table (it
never binds the port itself, which once made a starting ``ipmi_sim`` exit 1 in CI), it counts
only the peer's own socket, and a simulator whose port was taken is started again elsewhere."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from tests.bmc import peers


def test_udp_bound_sees_the_owner_and_never_takes_the_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert peers.udp_bound(port)
        assert peers.udp_bound(port, pid=os.getpid())
        assert not peers.udp_bound(port, pid=1)  # bound, but not by that process
    assert not peers.udp_bound(port)
    for _ in range(3):  # looking leaves the port free for the peer
        assert not peers.udp_bound(port, pid=os.getpid())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.skipif(shutil.which("ipmi_sim") is None, reason="ipmi_sim (openipmi) not installed")
def test_a_sim_whose_port_was_taken_starts_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    thief = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    thief.bind(("127.0.0.1", 0))
    taken = thief.getsockname()[1]
    ports = iter([taken, peers.labnet.free_port(socket.SOCK_DGRAM)])
    monkeypatch.setattr(peers, "_udp_port", lambda: next(ports))
    try:
        sim, proc = peers.start_ipmi_sim(tmp_path)
        try:
            assert sim.port != taken
            assert next(ports, None) is None  # the taken port was tried first
            assert proc.poll() is None
            assert peers.udp_bound(sim.port, pid=proc.pid)
        finally:
            peers.stop_peer(proc)
    finally:
        thief.close()
