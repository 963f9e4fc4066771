"""One IPMI Serial-over-LAN link on asyncio: an RMCP+ session of its own
(``metald.bmc.rmcp_session``, the type the IPMI driver logs in with; cipher suite 3), SOL
activated on it, and ``metald.bmc.sol.SolCore`` fed from one UDP
socket. It owns one reader task and stops it itself.

The link is separate from the driver's power-control session on purpose: a console stays open
for hours, and power commands must not queue behind it. If SOL is already active (a session
metald left behind when it died, or another tool's), the link deactivates that instance once
and activates again, as ipmitool's ``sol deactivate`` would. The session is kept alive with a
Get Device ID every ``keepalive_s``; a keepalive left unanswered for ``timeout_s``, a packet
unacknowledged after the core's tries, or the BMC saying SOL is ending closes the link with a
reason, and the console manager decides whether to reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from metald.bmc import rmcp, sol
from metald.bmc.base import BmcProtocolError, BmcTimeout, BmcUnreachable
from metald.bmc.rmcp_session import (
    CMD_SET_PRIVILEGE,
    NETFN_APP,
    RmcpSession,
    oserror_text,
)

log = logging.getLogger(__name__)

CMD_GET_DEVICE_ID = 0x01
#: The cipher suites the link proposes.
SUITES = (3,)


class SolUnavailable(BmcProtocolError):
    """The BMC refused to start SOL (disabled, limit reached, or still held by another)."""


class SolLink:
    def __init__(
        self,
        address: str,
        port: int | None,
        username: str,
        password: str,
        on_data: Callable[[bytes], None],
        *,
        resend_s: float = 0.5,
        timeout_s: float = 5.0,
        keepalive_s: float = 15.0,
        retransmit_s: float = 1.0,
    ) -> None:
        self.session = RmcpSession(
            address, port, username, password, resend_s=resend_s, timeout_s=timeout_s
        )
        self.on_data = on_data
        self.resend_s = resend_s
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.core = sol.SolCore(retransmit_s=retransmit_s)
        self.closed: asyncio.Future[str] | None = None
        #: True when activation had to deactivate an SOL session someone else left active.
        self.took_over = False
        #: Keepalives the BMC answered (the session is known good up to the last one).
        self.keepalives = 0
        self._rq_seq = 0
        self._pending: dict[tuple[int, int, int], asyncio.Future[rmcp.IpmiResponse]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()

    @property
    def _where(self) -> str:
        return self.session.where

    # --- public ---

    async def open(self) -> None:
        """Log in, activate SOL (taking over a stale activation once), start the reader."""
        loop = asyncio.get_running_loop()
        self.closed = loop.create_future()
        try:
            await self.session.login(SUITES, loop.time() + self.timeout_s)
            self._reader = loop.create_task(self._run(), name=f"sol {self._where}")
            await self._call(NETFN_APP, CMD_SET_PRIVILEGE, bytes([rmcp.ROLE_ADMIN]))
            rsp = await self._call(
                NETFN_APP, sol.CMD_ACTIVATE_PAYLOAD, sol.activate_request(), check=False
            )
            if rsp.code == sol.ALREADY_ACTIVE:
                self.took_over = True
                log.info("%s: SOL was active on another session; deactivating it", self._where)
                await self._call(NETFN_APP, sol.CMD_DEACTIVATE_PAYLOAD, sol.deactivate_request())
                rsp = await self._call(
                    NETFN_APP, sol.CMD_ACTIVATE_PAYLOAD, sol.activate_request(), check=False
                )
            if rsp.code != 0:
                why = sol.ACTIVATE_ERRORS.get(rsp.code, f"completion code 0x{rsp.code:02x}")
                raise SolUnavailable(f"{self._where}: cannot start Serial-over-LAN: {why}")
            act = sol.parse_activation(rsp.data)
            if act.inbound_size >= 5:
                self.core.chunk = min(self.core.chunk, act.inbound_size - 4)
            # 623 is what a BMC behind a port forward believes it listens on.
            if act.port not in (0, 623, self.session.port):
                raise SolUnavailable(
                    f"{self._where}: the BMC carries SOL on another port ({act.port}), "
                    "which metald does not follow"
                )
        except BaseException:
            await self._teardown("open failed")
            raise

    def write(self, data: bytes) -> None:
        self.core.write(data)
        self._kick.set()

    def send_break(self) -> None:
        self.core.send_break()
        self._kick.set()

    async def close(self) -> None:
        """Deactivate SOL and close the session (best effort), then stop the reader."""
        if self.session.active:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    self._call(
                        NETFN_APP, sol.CMD_DEACTIVATE_PAYLOAD, sol.deactivate_request(), check=False
                    ),
                    self.resend_s * 2,
                )
            self.session.send_close()
        await self._teardown("closed")

    # --- requests ---

    def _send_ipmi(self, msg: bytes) -> None:
        self.session.send(rmcp.PAYLOAD_IPMI, msg)

    async def _call(
        self, netfn: int, cmd: int, data: bytes = b"", *, check: bool = True
    ) -> rmcp.IpmiResponse:
        """One IPMI request on the session, re-sent with the same rq_seq until answered."""
        loop = asyncio.get_running_loop()
        self._rq_seq = (self._rq_seq + 1) & 0x3F
        key = (netfn | 1, cmd, self._rq_seq)
        fut: asyncio.Future[rmcp.IpmiResponse] = loop.create_future()
        self._pending[key] = fut
        msg = rmcp.encode_request(netfn, cmd, data, self._rq_seq)
        deadline = loop.time() + self.timeout_s
        try:
            while True:
                self._send_ipmi(msg)
                left = deadline - loop.time()
                if left <= 0:
                    raise BmcTimeout(f"{self._where}: no reply within {self.timeout_s:g} s")
                with contextlib.suppress(TimeoutError):
                    rsp = await asyncio.wait_for(asyncio.shield(fut), min(left, self.resend_s))
                    break
                if self.closed is not None and self.closed.done():
                    raise BmcUnreachable(f"{self._where}: {self.closed.result()}")
        finally:
            self._pending.pop(key, None)
        if check and rsp.code != 0:
            what = rmcp.COMPLETION.get(rsp.code, "error")
            raise BmcProtocolError(
                f"{self._where}: command 0x{netfn:02x}/0x{cmd:02x} failed: {what} "
                f"(0x{rsp.code:02x})"
            )
        return rsp

    # --- the reader: datagrams, the SOL core's timers, keepalive ---

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_keepalive = loop.time() + self.keepalive_s
        keepalive: asyncio.Task[Any] | None = None
        reason = "closed"
        try:
            while True:
                now = loop.time()
                for payload in self.core.due(now):
                    self.session.send(sol.PAYLOAD_SOL, payload)
                if self.core.failed:
                    reason = "the BMC stopped acknowledging console data"
                    break
                if self.core.deactivated:
                    reason = "the BMC ended Serial-over-LAN (another session may have taken it)"
                    break
                if keepalive is not None and keepalive.done():
                    if keepalive.exception() is not None:
                        reason = f"keepalive failed: {keepalive.exception()}"
                        break
                    self.keepalives += 1
                    keepalive = None
                if now >= next_keepalive and keepalive is None:
                    keepalive = loop.create_task(self._call(NETFN_APP, CMD_GET_DEVICE_ID))
                    next_keepalive = now + self.keepalive_s
                wake = next_keepalive
                if (d := self.core.next_deadline()) is not None:
                    wake = min(wake, d)
                item = await self._next(max(0.0, wake - loop.time()), keepalive)
                if isinstance(item, Exception):
                    reason = f"{oserror_text(item)}"
                    break
                if item is not None:
                    self._dispatch(item, loop.time())
        except asyncio.CancelledError:
            reason = "closed"
            raise
        finally:
            if keepalive is not None and not keepalive.done():
                keepalive.cancel()
            if self.closed is not None and not self.closed.done():
                self.closed.set_result(reason)

    async def _next(self, timeout: float, keepalive: asyncio.Task[Any] | None) -> Any:
        """A datagram, or None when the timeout passes, a write arrives or a keepalive ends."""
        datagrams = self.session.datagrams
        assert datagrams is not None
        if datagrams.inbox:
            return datagrams.inbox.popleft()
        self._kick.clear()
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(datagrams.next(timeout)),
            asyncio.ensure_future(self._kick.wait()),
        ]
        if keepalive is not None:
            waits.append(keepalive)
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits[:2]:
            if w not in done:
                w.cancel()
        if waits[0] in done:
            return waits[0].result()
        return None

    def _dispatch(self, raw: bytes, now: float) -> None:
        try:
            p = rmcp.decode_packet(raw, self.session.keys)
        except rmcp.RmcpError:
            self.core.counters.malformed += 1
            return
        if p.payload_type == sol.PAYLOAD_SOL:
            data = self.core.on_payload(p.payload, now)
            if data:
                self.on_data(data)
        elif p.payload_type == rmcp.PAYLOAD_IPMI:
            try:
                r = rmcp.decode_response(p.payload)
            except rmcp.RmcpError:
                self.core.counters.malformed += 1
                return
            fut = self._pending.get((r.netfn, r.cmd, r.rq_seq))
            if fut is not None and not fut.done():
                fut.set_result(r)

    async def _teardown(self, reason: str) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self.closed is not None and not self.closed.done():
            self.closed.set_result(reason)
        self.session.drop()
