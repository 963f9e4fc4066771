"""An IPMI exchange whose session is dropped while it waits for a reply (a fenced instance
drops every BMC session at once, ``BmcService.wake``) fails as that BMC's error. It raised
AttributeError on its next resend, which ended the whole power-sync round over every BMC the
instance owns (seen at 10,000 machines and BMCs, bench/fleet.py, issue 33)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from metald.bmc.base import BmcError
from metald.bmc.rmcp_session import RmcpSession


async def test_a_session_dropped_mid_exchange_fails_as_a_bmc_error() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # receives, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        session = RmcpSession(
            "127.0.0.1", silent.getsockname()[1], "u", "p", resend_s=0.05, timeout_s=5
        )
        await session.open_socket()
        loop = asyncio.get_running_loop()
        call = asyncio.ensure_future(
            session.exchange(lambda: b"\x06\x00\xff\x07", lambda _p: None, loop.time() + 5)
        )
        await asyncio.sleep(0.02)  # waiting for a reply, between two resends
        session.drop()
        with pytest.raises(BmcError, match="closed while waiting"):
            await asyncio.wait_for(call, 5)
    finally:
        silent.close()
