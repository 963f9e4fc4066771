"""One RMCP+ (IPMI 2.0 lanplus) session on asyncio: a connected UDP socket, the login
handshake of ``metald.bmc.rmcp``, sealed packets. Shared by the IPMI driver's command session
(``metald.bmc.ipmi``) and the Serial-over-LAN link (``metald.bmc.sol_link``), which each keep
their own session and decide how requests and replies are matched on it.

UDP loss is the protocol's normal weather: ``exchange`` re-sends every ``resend_s`` until the
reply it waits for arrives or the caller's deadline passes; that is transmission, not the
scheduler's retry policy. Packets that do not decode (another session's, a forgery) are
dropped, never taken for the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from metald.bmc import rmcp
from metald.bmc.base import BmcAuthError, BmcError, BmcTimeout, BmcUnreachable

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_PORT = 623
NETFN_APP = 0x06
CMD_SET_PRIVILEGE = 0x3B
CMD_CLOSE_SESSION = 0x3C


class BmcSuiteRefused(BmcError):
    """The BMC offers none of the cipher suites metald is configured to propose."""


class Datagrams(asyncio.DatagramProtocol):
    """Replies in arrival order, with one waiter: cheaper than a Queue plus wait_for per packet,
    which matters when one loop carries thousands of BMCs."""

    def __init__(self) -> None:
        self.inbox: deque[bytes | Exception] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.inbox.append(data)
        self._wake()

    def error_received(self, exc: Exception) -> None:
        # A connected UDP socket reports ICMP port unreachable here: nothing listens there.
        self.inbox.append(exc)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self, timeout: float) -> bytes | Exception | None:
        """The next datagram or socket error, or None after ``timeout`` seconds."""
        if not self.inbox:
            loop = asyncio.get_running_loop()
            fut = self.waiter = loop.create_future()
            timer = loop.call_later(timeout, self._wake)
            try:
                await fut
            finally:
                timer.cancel()
                self.waiter = None
        return self.inbox.popleft() if self.inbox else None


def oserror_text(e: Exception) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "nothing answers on that port (ICMP port unreachable)"
    return getattr(e, "strerror", None) or str(e)


class RmcpSession:
    """An RMCP+ session with one BMC. ``login`` opens a fresh socket and logs in; ``seal`` and
    ``send`` carry payloads on it; ``drop`` forgets it (the next login starts anew)."""

    def __init__(
        self,
        address: str,
        port: int | None,
        username: str,
        password: str,
        *,
        resend_s: float = 0.5,
        timeout_s: float = 5.0,
    ) -> None:
        self.address = address
        self.port = port or DEFAULT_PORT
        self.username = username
        self.password = password
        self.resend_s = resend_s
        #: Only for the message of a timeout: the deadline itself is the caller's.
        self.timeout_s = timeout_s
        self.transport: asyncio.DatagramTransport | None = None
        self.datagrams: Datagrams | None = None
        self.keys: rmcp.SessionKeys | None = None
        self.console_sid = b""
        self.bmc_sid = 0
        self.seq = 0
        #: The cipher suite of the last login that worked (proposed first next time).
        self.suite: int | None = None

    @property
    def where(self) -> str:
        return f"IPMI BMC {self.address}:{self.port}"

    @property
    def active(self) -> bool:
        return self.keys is not None and self.transport is not None

    async def open_socket(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.transport, self.datagrams = await loop.create_datagram_endpoint(
                Datagrams, remote_addr=(self.address, self.port)
            )
        except OSError as e:
            raise BmcUnreachable(f"{self.where}: {e.strerror or e}") from None

    def drop(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = self.datagrams = None
        self.keys = None

    async def exchange(
        self,
        packet_for_try: Callable[[], bytes],
        accept: Callable[[bytes], T | None],
        deadline: float,
    ) -> T:
        """Send, re-sending every ``resend_s``, until ``accept(packet)`` returns non-None."""
        assert self.transport is not None and self.datagrams is not None
        datagrams = self.datagrams
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if now >= deadline:
                raise BmcTimeout(f"{self.where}: no reply within {self.timeout_s:g} s")
            transport = self.transport
            if transport is None or self.datagrams is not datagrams:
                # Dropped while this exchange waited (a fenced instance drops its sessions):
                # this BMC's call fails, as a lost reply would, not the whole power round.
                raise BmcUnreachable(f"{self.where}: the session was closed while waiting")
            transport.sendto(packet_for_try())
            wait_until = min(deadline, now + self.resend_s)
            while (left := wait_until - loop.time()) > 0:
                item = await datagrams.next(left)
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise BmcUnreachable(f"{self.where}: {oserror_text(item)}")
                try:
                    got = accept(item)
                except rmcp.SuiteRefused as e:
                    raise BmcSuiteRefused(f"{self.where}: {e}") from None
                except rmcp.RmcpAuthError as e:
                    raise BmcAuthError(f"{self.where}: login refused: {e}") from None
                except rmcp.RmcpError as e:
                    log.debug("%s: ignored packet: %s", self.where, e)
                    continue
                if got is not None:
                    return got

    async def login(self, suites: Sequence[int], deadline: float) -> None:
        """Log in with the first of ``suites`` the BMC accepts (the one that worked last time
        goes first); BmcSuiteRefused when it accepts none."""
        order = tuple(suites)
        if self.suite in order:
            order = (self.suite, *(s for s in order if s != self.suite))
        for n, suite in enumerate(order):
            try:
                await self._login_with(rmcp.SUITES[suite], deadline)
            except BmcSuiteRefused:
                if n == len(order) - 1:
                    raise
                continue
            self.suite = suite
            return

    async def _login_with(self, suite: rmcp.CipherSuite, deadline: float) -> None:
        # A new socket for each try: some BMCs key sessions by the client's address and port.
        self.drop()
        await self.open_socket()
        try:
            hs = rmcp.ClientHandshake(self.username.encode(), self.password.encode(), suite=suite)
        except ValueError as e:
            raise BmcAuthError(f"{self.where}: {e}") from None

        def step(ptype: int, payload: bytes, want: int, then: Callable[[bytes], Any]) -> Any:
            pkt = rmcp.encode_packet(ptype, 0, 0, payload)

            def accept(data: bytes) -> Any:
                p = rmcp.decode_packet(data)
                return then(p.payload) if p.payload_type == want else None

            return self.exchange(lambda: pkt, accept, deadline)

        rakp1 = await step(
            rmcp.PAYLOAD_OPEN_REQ, hs.open_request(), rmcp.PAYLOAD_OPEN_RSP, hs.on_open_response
        )
        rakp3 = await step(rmcp.PAYLOAD_RAKP1, rakp1, rmcp.PAYLOAD_RAKP2, hs.on_rakp2)
        self.keys = await step(rmcp.PAYLOAD_RAKP3, rakp3, rmcp.PAYLOAD_RAKP4, hs.on_rakp4)
        self.console_sid = hs.console_sid
        self.bmc_sid = struct.unpack("<I", hs.bmc_sid)[0]
        self.seq = 0

    def seal(self, ptype: int, payload: bytes) -> bytes:
        """``payload`` as the session's next packet: a fresh session sequence number per
        transmission (anti-replay), integrity and confidentiality as the suite says."""
        assert self.keys is not None
        self.seq = (self.seq + 1) & 0xFFFFFFFF or 1
        return rmcp.encode_packet(ptype, self.bmc_sid, self.seq, payload, self.keys)

    def send(self, ptype: int, payload: bytes) -> None:
        """Seal and send once, best effort (no reply awaited, a socket error ignored)."""
        if self.transport is None or self.keys is None:
            return
        with contextlib.suppress(OSError):
            self.transport.sendto(self.seal(ptype, payload))

    def send_close(self) -> None:
        """Close Session, once and unanswered: frees the BMC's session slot (best effort)."""
        if self.active:
            msg = rmcp.encode_request(
                NETFN_APP, CMD_CLOSE_SESSION, struct.pack("<I", self.bmc_sid), 0
            )
            self.send(rmcp.PAYLOAD_IPMI, msg)
