"""IPMI cipher suite 17 (HMAC-SHA256, HMAC-SHA256-128, AES-CBC-128), issue 16 item 7.

No third-party BMC that speaks suite 17 runs here: OpenIPMI's ipmi_sim refuses it ("invalid
authentication algorithm") and pyghmi's BMC server hard-codes suite 3. What is proven:
- metald's server half of suite 17 against an independent client, pyghmi's (which proposes
  suite 17 first), over UDP: a wrong key derivation, MAC length or hash anywhere fails login;
- metald's client half against that server half (the same process as the benchmark fleet);
- negotiation: 17 first, then 3, against ipmi_sim (which refuses 17); with 3 switched off,
  a suite-3-only BMC is refused, never silently downgraded.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from metald.bmc import rmcp
from metald.bmc.base import BmcEndpoint, PowerAction, PowerState
from metald.bmc.ipmi import IpmiDriver
from metald.bmc.rmcp_session import BmcSuiteRefused
from tests.bmc.peers import IpmiSim, free_port

GUID = bytes(range(16))


def _handshake(suite: rmcp.CipherSuite) -> tuple[rmcp.ClientHandshake, rmcp.ServerHandshake]:
    c = rmcp.ClientHandshake(b"admin", b"pw", suite=suite)
    s = rmcp.ServerHandshake({b"admin": b"pw"}, GUID, accept=(17, 3))
    rakp1 = c.on_open_response(s.on_open_request(c.open_request()))
    rakp3 = c.on_rakp2(s.on_rakp1(rakp1))
    rakp4, keys = s.on_rakp3(rakp3)
    assert keys is not None and c.on_rakp4(rakp4) == keys
    return c, s


def test_suite17_halves_agree_and_seal_with_sha256_128() -> None:
    c, s = _handshake(rmcp.SUITE_17)
    assert s.suite is rmcp.SUITE_17
    assert c.keys is not None and c.keys.digest == "sha256" and c.keys.mac_len == 16
    msg = rmcp.encode_request(0x00, 0x01, b"", 3)
    pkt = rmcp.encode_packet(rmcp.PAYLOAD_IPMI, 9, 1, msg, c.keys)
    assert rmcp.decode_packet(pkt, c.keys).payload == msg
    # A suite-3 key cannot open a suite-17 packet (different MAC length and hash).
    c3, _ = _handshake(rmcp.SUITE_3)
    assert c3.keys is not None
    with pytest.raises(rmcp.RmcpError):
        rmcp.decode_packet(pkt, c3.keys)


def test_a_bmc_without_suite_17_refuses_it_as_a_suite_refusal() -> None:
    c = rmcp.ClientHandshake(b"admin", b"pw", suite=rmcp.SUITE_17)
    s = rmcp.ServerHandshake({b"admin": b"pw"}, GUID, accept=(3,))
    with pytest.raises(rmcp.SuiteRefused):
        c.on_open_response(s.on_open_request(c.open_request()))


@pytest.fixture
def suite17_bmc() -> Iterator[int]:
    """One BMC from the benchmark's fleet (metald's server half), accepting suite 17 only."""
    from bench.bmc_fanout import _fleet_main

    port = free_port(socket.SOCK_DGRAM)
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(
        target=_fleet_main, args=(child, port, 1, (0.0, 0.0), 0.0, 1, (0.0, 0.0), (17,))
    )
    proc.start()
    try:
        assert parent.poll(15) and parent.recv() == "ready"
        yield port
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _pyghmi_power(port: int, conn: Any) -> None:
    from pyghmi.ipmi.command import Command

    try:
        cmd = Command(
            bmc="127.0.0.1", userid="admin", password="fleet-password", port=port, keepalive=False
        )
        conn.send(("ok", cmd.get_power()["powerstate"]))
    except Exception as e:  # noqa: BLE001 - reported to the test
        conn.send(("error", repr(e)))


def test_pyghmi_client_logs_in_to_metald_suite17_server(suite17_bmc: int) -> None:
    # A fresh interpreter: pyghmi keeps a global I/O thread that a fork of this one would lose.
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_pyghmi_power, args=(suite17_bmc, child))
    proc.start()
    try:
        assert parent.poll(30), "pyghmi's client did not finish"
        assert parent.recv() == ("ok", "off")
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


async def test_metald_client_speaks_suite17(suite17_bmc: int) -> None:
    ep = BmcEndpoint("127.0.0.1", suite17_bmc, "admin", "fleet-password")
    d = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3, cipher_suites=(17,))
    try:
        assert await d.get_power() is PowerState.OFF
        await d.set_power(PowerAction.ON)
        assert d.suite == 17
    finally:
        await d.close()
    # Only suite 3 on offer from metald: the suite-17-only BMC refuses it.
    d3 = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3, cipher_suites=(3,))
    try:
        with pytest.raises(BmcSuiteRefused):
            await d3.get_power()
    finally:
        await d3.close()


async def test_negotiation_falls_back_to_3_on_ipmi_sim_and_never_downgrades_silently(
    ipmi_sim: IpmiSim,
) -> None:
    ep = BmcEndpoint("127.0.0.1", ipmi_sim.port, ipmi_sim.username, ipmi_sim.password)
    d = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3)  # default: 17, then 3
    try:
        await d.get_power()
        assert d.suite == 3
    finally:
        await d.close()
    strict = IpmiDriver(ep, request_timeout_s=5.0, resend_s=0.3, cipher_suites=(17,))
    try:
        with pytest.raises(BmcSuiteRefused):
            await strict.get_power()
    finally:
        await strict.close()
