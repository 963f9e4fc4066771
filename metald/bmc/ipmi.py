"""The ``ipmi`` driver: IPMI 2.0 lanplus.

The hot path (power state, power control, boot device) speaks RMCP+ through ``metald.bmc.rmcp``
on asyncio, one connected UDP socket per BMC, so thousands of BMCs cost one event loop instead
of thousands of threads (pyghmi's client holds the GIL for ~4 ms per session, which alone would
spend the whole fan-out budget; see bench/BMC.md). The long tail, sensors (SDR decoding and unit
conversion) and the event log, goes through pyghmi's client in a worker thread.

A session is opened on first use and kept for ``idle_s`` so a status read and the command after
it share one handshake. UDP loss is the protocol's normal weather: a request is re-sent with the
same IPMI sequence number (so a BMC that saw it can answer from its cache instead of acting
twice) until the caller's deadline; that is transmission, not the scheduler's retry policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from metald.bmc import rmcp
from metald.bmc.base import (
    BmcAuthError,
    BmcDriver,
    BmcEndpoint,
    BmcError,
    BmcProtocolError,
    BmcTimeout,
    BmcUnreachable,
    BootDevice,
    BootTarget,
    LogEntry,
    PowerAction,
    PowerState,
    Sensor,
    SystemIdentity,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 623
NETFN_CHASSIS = 0x00
NETFN_APP = 0x06
_CONTROL = {
    PowerAction.OFF: 0,
    PowerAction.ON: 1,
    PowerAction.CYCLE: 2,
    PowerAction.RESET: 3,
    PowerAction.SOFT_OFF: 5,
}


class CompletionCodeError(BmcProtocolError):
    """The BMC answered the command with a non-zero completion code."""


class _Datagrams(asyncio.DatagramProtocol):
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


class BmcSuiteRefused(BmcError):
    """The BMC offers none of the cipher suites metald is configured to propose."""


class IpmiDriver(BmcDriver):
    protocol = "ipmi"

    def __init__(
        self,
        endpoint: BmcEndpoint,
        *,
        resend_s: float = 0.5,
        request_timeout_s: float = 5.0,
        idle_s: float = 20.0,
        cipher_suites: tuple[int, ...] = (17, 3),
    ) -> None:
        self.ep = endpoint
        #: Proposed in this order at login (one open-session each); the one that worked
        #: goes first next time.
        self.cipher_suites = tuple(s for s in cipher_suites if s in rmcp.SUITES) or (3,)
        self.suite: int | None = None
        self.port = endpoint.port or DEFAULT_PORT
        self.resend_s = resend_s
        self.request_timeout_s = request_timeout_s
        self.idle_s = idle_s
        self._transport: asyncio.DatagramTransport | None = None
        self._proto: _Datagrams | None = None
        self._keys: rmcp.SessionKeys | None = None
        self._console_sid = b""
        self._bmc_sid = 0
        self._seq = 0
        self._rq_seq = 0
        self._admin = False
        self._lock = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None
        self._pyghmi_cmd: Any = None

    def __repr__(self) -> str:
        return f"IpmiDriver({self.ep.address}:{self.port})"

    @property
    def _where(self) -> str:
        return f"IPMI BMC {self.ep.address}:{self.port}"

    # --- transport ---

    async def _open_socket(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._transport, self._proto = await loop.create_datagram_endpoint(
                _Datagrams, remote_addr=(self.ep.address, self.port)
            )
        except OSError as e:
            raise BmcUnreachable(f"{self._where}: {e.strerror or e}") from None

    def _drop_session(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport = self._proto = None
        self._keys = None
        self._admin = False

    async def _exchange(self, packet_for_try: Any, accept: Any, deadline: float) -> Any:
        """Send, re-sending every ``resend_s``, until ``accept(packet)`` returns non-None."""
        assert self._transport is not None and self._proto is not None
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if now >= deadline:
                raise BmcTimeout(f"{self._where}: no reply within {self.request_timeout_s:g} s")
            self._transport.sendto(packet_for_try())
            wait_until = min(deadline, now + self.resend_s)
            while (left := wait_until - loop.time()) > 0:
                item = await self._proto.next(left)
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise BmcUnreachable(f"{self._where}: {_oserror_text(item)}")
                try:
                    got = accept(item)
                except rmcp.SuiteRefused as e:
                    raise BmcSuiteRefused(f"{self._where}: {e}") from None
                except rmcp.RmcpAuthError as e:
                    raise BmcAuthError(f"{self._where}: login refused: {e}") from None
                except rmcp.RmcpError as e:
                    log.debug("%s: ignored packet: %s", self._where, e)
                    continue
                if got is not None:
                    return got

    # --- session ---

    async def _login(self, deadline: float) -> None:
        order = self.cipher_suites
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
        self._drop_session()
        await self._open_socket()
        try:
            hs = rmcp.ClientHandshake(
                self.ep.username.encode(), self.ep.password.encode(), suite=suite
            )
        except ValueError as e:
            raise BmcAuthError(f"{self._where}: {e}") from None

        def step(ptype: int, payload: bytes, want: int, then: Any) -> Any:
            pkt = rmcp.encode_packet(ptype, 0, 0, payload)

            def accept(data: bytes) -> Any:
                p = rmcp.decode_packet(data)
                return then(p.payload) if p.payload_type == want else None

            return self._exchange(lambda: pkt, accept, deadline)

        rakp1 = await step(
            rmcp.PAYLOAD_OPEN_REQ, hs.open_request(), rmcp.PAYLOAD_OPEN_RSP, hs.on_open_response
        )
        rakp3 = await step(rmcp.PAYLOAD_RAKP1, rakp1, rmcp.PAYLOAD_RAKP2, hs.on_rakp2)
        self._keys = await step(rmcp.PAYLOAD_RAKP3, rakp3, rmcp.PAYLOAD_RAKP4, hs.on_rakp4)
        self._console_sid = hs.console_sid
        self._bmc_sid = struct.unpack("<I", hs.bmc_sid)[0]
        self._seq = 0

    async def _request(
        self, netfn: int, cmd: int, data: bytes = b"", *, admin: bool = False
    ) -> bytes:
        """One IPMI command on the session (logging in first if needed); returns response data."""
        async with self._lock:
            if self._idle is not None:
                self._idle.cancel()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.request_timeout_s
            try:
                if self._keys is None:
                    await self._login(deadline)
                if admin and not self._admin:
                    await self._call(NETFN_APP, 0x3B, bytes([rmcp.ROLE_ADMIN]), deadline)
                    self._admin = True
                try:
                    rsp = await self._call(netfn, cmd, data, deadline)
                except (BmcTimeout, BmcUnreachable) as e:
                    e.maybe_delivered = True  # sent at least once; the BMC may have acted on it
                    raise
            except CompletionCodeError:
                raise  # the BMC answered, with an error code: the session itself is fine
            except BaseException:
                # Log in again next time, from a new socket: some BMCs (pyghmi's among them) key
                # sessions by the client's address and port and trip over a second login.
                self._drop_session()
                raise
            self._idle = loop.call_later(self.idle_s, self._expire)
            return rsp

    async def _call(self, netfn: int, cmd: int, data: bytes, deadline: float) -> bytes:
        keys = self._keys
        assert keys is not None
        self._rq_seq = (self._rq_seq + 1) & 0x3F
        rq_seq = self._rq_seq
        msg = rmcp.encode_request(netfn, cmd, data, rq_seq)

        def packet() -> bytes:
            # A fresh session sequence number per transmission (anti-replay), same rq_seq.
            self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
            return rmcp.encode_packet(rmcp.PAYLOAD_IPMI, self._bmc_sid, self._seq, msg, keys)

        def accept(raw: bytes) -> rmcp.IpmiResponse | None:
            p = rmcp.decode_packet(raw, keys)
            if p.payload_type != rmcp.PAYLOAD_IPMI:
                return None
            r = rmcp.decode_response(p.payload)
            return r if (r.rq_seq, r.cmd, r.netfn) == (rq_seq, cmd, netfn | 1) else None

        r = await self._exchange(packet, accept, deadline)
        if r.code != 0:
            what = rmcp.COMPLETION.get(r.code, "error")
            if r.code == 0xD4:
                raise BmcAuthError(f"{self._where}: user lacks the privilege for this command")
            raise CompletionCodeError(
                f"{self._where}: command 0x{netfn:02x}/0x{cmd:02x} failed: {what} (0x{r.code:02x})"
            )
        return r.data

    def _expire(self) -> None:
        if self._lock.locked():
            return
        task = asyncio.get_running_loop().create_task(self.close())
        task.add_done_callback(lambda t: t.exception())

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._keys is not None and self._transport is not None:
            # Close Session frees the BMC's session slot; best effort, no retransmission.
            msg = rmcp.encode_request(NETFN_APP, 0x3C, struct.pack("<I", self._bmc_sid), 0)
            self._seq += 1
            with contextlib.suppress(OSError):
                self._transport.sendto(
                    rmcp.encode_packet(rmcp.PAYLOAD_IPMI, self._bmc_sid, self._seq, msg, self._keys)
                )
        self._drop_session()

    # --- the driver interface ---

    async def identify(self) -> SystemIdentity:
        try:
            guid = await self._request(NETFN_APP, 0x37)  # Get System GUID
        except BmcProtocolError:
            # Optional command: a BMC without it still proves the login by a status read.
            await self.get_power()
            return SystemIdentity()
        if len(guid) != 16:
            return SystemIdentity()
        # BMCs disagree on the GUID's byte order (the spec says least significant byte first,
        # SMBIOS mixes orders): keep every reading so linking finds the machine whichever it is.
        full, mixed, raw = guid_readings(guid)
        return SystemIdentity(system_uuid=full, extra={"uuid_candidates": [mixed, raw]})

    async def get_power(self) -> PowerState:
        data = await self._request(NETFN_CHASSIS, 0x01)  # Get Chassis Status
        if not data:
            raise BmcProtocolError(f"{self._where}: empty chassis status")
        return PowerState.ON if data[0] & 0x01 else PowerState.OFF

    async def set_power(self, action: PowerAction) -> None:
        await self._request(NETFN_CHASSIS, 0x02, bytes([_CONTROL[action]]), admin=True)

    async def set_boot_device(self, boot: BootDevice) -> None:
        # Boot flags parameter 5 (table 28-14): valid, persistent, EFI; device selector.
        flags = 0x80 | (0x40 if boot.persistent else 0) | (0x20 if boot.uefi else 0)
        device = 0x04 if boot.device is BootTarget.PXE else 0x08
        await self._request(NETFN_CHASSIS, 0x08, bytes([0x05, flags, device, 0, 0, 0]), admin=True)

    async def set_locate(self, on: bool) -> None:
        # Chassis Identify (IPMI 2.0 28.5): interval 0 with "force on" lights it until turned
        # off; interval 0 without it turns it off.
        await self._request(NETFN_CHASSIS, 0x04, bytes([0, 1 if on else 0]), admin=True)

    async def get_locate(self) -> bool | None:
        data = await self._request(NETFN_CHASSIS, 0x01)  # Get Chassis Status
        # Byte 3 (misc chassis state): bit 6 says whether bits 5:4 (identify state) are valid.
        if len(data) < 3 or not data[2] & 0x40:
            return None
        return (data[2] >> 4) & 0x03 != 0

    async def sensors(self) -> list[Sensor]:
        return await _in_pyghmi_thread(self._pyghmi_sensors)

    async def event_log(self) -> list[LogEntry]:
        return await _in_pyghmi_thread(self._pyghmi_event_log)

    # --- pyghmi, in a thread ---

    def _pyghmi(self) -> Any:
        from pyghmi.exceptions import IpmiException
        from pyghmi.ipmi.command import Command

        if self._pyghmi_cmd is not None:
            return self._pyghmi_cmd
        try:
            self._pyghmi_cmd = Command(
                bmc=self.ep.address,
                userid=self.ep.username,
                password=self.ep.password,
                port=self.port,
                keepalive=False,
            )
        except IpmiException as e:
            raise _pyghmi_error(self._where, e) from None
        return self._pyghmi_cmd

    def _pyghmi_sensors(self) -> list[Sensor]:
        cmd = self._pyghmi()
        return self._pyghmi_call(lambda: [_sensor(r) for r in cmd.get_sensor_data()])

    def _pyghmi_event_log(self) -> list[LogEntry]:
        cmd = self._pyghmi()
        return self._pyghmi_call(lambda: [_log_entry(e) for e in cmd.get_event_log()])

    def _pyghmi_call(self, fn: Any) -> Any:
        # pyghmi caches the session per BMC and user and expires it itself; logging it out here
        # would break the next Command built on the cached session.
        from pyghmi.exceptions import IpmiException

        try:
            return fn()
        except IpmiException as e:
            self._pyghmi_cmd = None
            raise _pyghmi_error(self._where, e) from None
        except Exception as e:  # pyghmi has internal failure modes of its own
            self._pyghmi_cmd = None
            log.debug("%s: pyghmi failed", self._where, exc_info=True)
            raise BmcProtocolError(f"{self._where}: {type(e).__name__} in pyghmi") from None


#: pyghmi's client shares sessions between Command objects and hangs when two threads build
#: them at once (seen in tests): all pyghmi work runs on this one thread.
_PYGHMI_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyghmi")


async def _in_pyghmi_thread(fn: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_PYGHMI_THREAD, fn)


def guid_readings(guid: bytes) -> tuple[str, str, str]:
    """The GUID read as fully reversed (IPMI spec), SMBIOS mixed-endian, and as sent."""
    import uuid

    return (
        str(uuid.UUID(bytes=bytes(reversed(guid)))),
        str(uuid.UUID(bytes_le=bytes(guid))),
        str(uuid.UUID(bytes=bytes(guid))),
    )


def _oserror_text(e: Exception) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "nothing answers on that port (ICMP port unreachable)"
    return getattr(e, "strerror", None) or str(e)


def _pyghmi_error(where: str, e: Exception) -> Exception:
    text = str(e)
    low = text.lower()
    if "password" in low or "unauthorized" in low or "user" in low:
        return BmcAuthError(f"{where}: login refused")
    if "timeout" in low or "timed out" in low or "unreachable" in low:
        return BmcTimeout(f"{where}: no reply")
    return BmcProtocolError(f"{where}: {text}")


_SENSOR_KINDS = {
    "Temperature": "temperature",
    "Fan": "fan",
    "Current": "current",
    "Voltage": "voltage",
    "Power Supply": "power",
    "Other": "other",
}


def _sensor(r: Any) -> Sensor:
    kind = _SENSOR_KINDS.get(getattr(r, "type", ""), "other")
    unit = getattr(r, "units", None) or None
    if unit == "W":
        kind = "power"
    health_map = {0: "ok", 1: "warning", 2: "critical", 4: "critical"}
    health = health_map.get(int(getattr(r, "health", 0) or 0), "critical")
    if getattr(r, "unavailable", False):
        health = "unknown"
    value = r.value if isinstance(r.value, (int, float)) else None
    return Sensor(name=r.name, kind=kind, value=value, unit=unit, health=health)


def _log_entry(e: dict[str, Any]) -> LogEntry:
    from datetime import UTC, datetime

    ts = e.get("timestamp")
    at = None
    if isinstance(ts, str):
        with contextlib.suppress(ValueError):
            at = datetime.fromisoformat(ts).replace(tzinfo=UTC)
    parts = [str(e.get(k)) for k in ("component_type", "component", "event") if e.get(k)]
    # pyghmi's Health: Ok 0, Warning 1, Critical 2, Failed 4 (memory uncorrectable ECC,
    # uncorrectable machine checks, non-recoverable thresholds): Failed is critical too.
    severity = {0: "ok", 1: "warning", 2: "critical", 4: "critical"}.get(
        int(e.get("severity") or 0), "critical"
    )
    rid = e.get("record_id", e.get("id", ""))
    return LogEntry(id=str(rid), at=at, severity=severity, message=" ".join(parts))
