"""The ``ipmi`` driver: IPMI 2.0 lanplus.

The hot path (power state, power control, boot device) speaks RMCP+ through ``metald.bmc.rmcp``
on asyncio, one connected UDP socket per BMC, so thousands of BMCs cost one event loop instead
of thousands of threads (pyghmi's client holds the GIL for ~4 ms per session, which alone would
spend the whole fan-out budget; see bench/BMC.md). The long tail, sensors (SDR decoding and unit
conversion) and the event log, goes through pyghmi's client in a worker thread.

A session (``metald.bmc.rmcp_session``, the same type the Serial-over-LAN link logs in with) is
opened on first use and kept for ``idle_s`` so a status read and the command after it share one
handshake. A request is re-sent with the same IPMI sequence number (so a BMC that saw it can
answer from its cache instead of acting twice) until the caller's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from metald.bmc import rmcp
from metald.bmc.base import (
    BmcAuthError,
    BmcDriver,
    BmcEndpoint,
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
from metald.bmc.capabilities import Capability
from metald.bmc.rmcp_session import (
    CMD_SET_PRIVILEGE,
    DEFAULT_PORT,
    NETFN_APP,
    RmcpSession,
)
from metald.bmc.sol_link import SolLink

log = logging.getLogger(__name__)
T = TypeVar("T")

NETFN_CHASSIS = 0x00
NETFN_STORAGE = 0x0A
_CONTROL = {
    PowerAction.OFF: 0,
    PowerAction.ON: 1,
    PowerAction.CYCLE: 2,
    PowerAction.RESET: 3,
    PowerAction.SOFT_OFF: 5,
}


class CompletionCodeError(BmcProtocolError):
    """The BMC answered the command with a non-zero completion code."""


class IpmiDriver(BmcDriver):
    protocol = "ipmi"
    capabilities = frozenset(
        {
            Capability.POWER,
            Capability.BOOT_DEVICE,
            Capability.INDICATOR,
            Capability.SENSORS,
            Capability.EVENT_LOG,
            Capability.SERIAL_CONSOLE,
        }
    )

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
        self.port = endpoint.port or DEFAULT_PORT
        self.resend_s = resend_s
        self.request_timeout_s = request_timeout_s
        self.idle_s = idle_s
        #: The command session (power, boot device, identify light).
        self.session = RmcpSession(
            endpoint.address,
            self.port,
            endpoint.username,
            endpoint.password,
            resend_s=resend_s,
            timeout_s=request_timeout_s,
        )
        self._rq_seq = 0
        self._admin = False
        self._lock = asyncio.Lock()
        self._idle: asyncio.TimerHandle | None = None
        self._pyghmi_cmd: Any = None

    def __repr__(self) -> str:
        return f"IpmiDriver({self.ep.address}:{self.port})"

    @property
    def _where(self) -> str:
        return self.session.where

    @property
    def suite(self) -> int | None:
        """The cipher suite of the last login that worked."""
        return self.session.suite

    def _drop_session(self) -> None:
        self.session.drop()
        self._admin = False

    async def _request(
        self, netfn: int, cmd: int, data: bytes = b"", *, admin: bool = False
    ) -> bytes:
        """One IPMI command on the session (logging in first if needed); returns response data."""
        async with self._lock:
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None  # the session is in use: an idle close already due stands down
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.request_timeout_s
            try:
                if self.session.keys is None:
                    self._admin = False
                    await self.session.login(self.cipher_suites, deadline)
                if admin and not self._admin:
                    await self._call(
                        NETFN_APP, CMD_SET_PRIVILEGE, bytes([rmcp.ROLE_ADMIN]), deadline
                    )
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
            finally:
                if self.session.keys is not None:  # still logged in (an error code too)
                    self._idle = loop.call_later(self.idle_s, self._expire)
            return rsp

    async def _call(self, netfn: int, cmd: int, data: bytes, deadline: float) -> bytes:
        session = self.session
        keys = session.keys
        assert keys is not None
        self._rq_seq = (self._rq_seq + 1) & 0x3F
        rq_seq = self._rq_seq
        msg = rmcp.encode_request(netfn, cmd, data, rq_seq)

        def accept(raw: bytes) -> rmcp.IpmiResponse | None:
            p = rmcp.decode_packet(raw, keys)
            if p.payload_type != rmcp.PAYLOAD_IPMI:
                return None
            r = rmcp.decode_response(p.payload)
            return r if (r.rq_seq, r.cmd, r.netfn) == (rq_seq, cmd, netfn | 1) else None

        # A fresh session sequence number per transmission (``seal``), the same rq_seq.
        r = await session.exchange(lambda: session.seal(rmcp.PAYLOAD_IPMI, msg), accept, deadline)
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
        timer = self._idle
        task = asyncio.get_running_loop().create_task(self._close_idle(timer))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _close_idle(self, timer: asyncio.TimerHandle | None) -> None:
        """The idle timer's close, under the command lock, and only if no command used the
        session since the timer fired. The close runs as a task of its own, a loop iteration
        (or, on a starved loop, a long queue of callbacks) after the timer: a command that took
        the lock in between had sent its request on the session, and closing it under that
        command failed the command after the BMC had acted on it, so the scheduler sent it
        again (bench/fleet.py at 10,000 machines: 14 power-ons executed twice)."""
        async with self._lock:
            if self._idle is timer:
                await self.close()

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.session.send_close()
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

    async def event_log_stamp(self) -> str:
        """What changes whenever the SEL does, from Get SEL Info (IPMI 2.0 31.2): the entry
        count and the most recent addition and erase timestamps. One small command, where
        ``event_log`` reads every record."""
        data = await self._request(NETFN_STORAGE, 0x40)
        if len(data) < 13:
            raise BmcProtocolError(f"{self._where}: short Get SEL Info answer ({len(data)} bytes)")
        entries = int.from_bytes(data[1:3], "little")
        added = int.from_bytes(data[5:9], "little")
        erased = int.from_bytes(data[9:13], "little")
        return f"ipmi-sel:{entries}:{added}:{erased}"

    def serial_console(self, on_data: Callable[[bytes], None], *, timeout_s: float) -> SolLink:
        return SolLink(
            self.ep.address,
            self.port,
            self.ep.username,
            self.ep.password,
            on_data,
            resend_s=self.resend_s,
            timeout_s=timeout_s,
        )

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

    def _pyghmi_call(self, fn: Callable[[], T]) -> T:
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


async def _in_pyghmi_thread(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_PYGHMI_THREAD, fn)


def guid_readings(guid: bytes) -> tuple[str, str, str]:
    """The GUID read as fully reversed (IPMI spec), SMBIOS mixed-endian, and as sent."""
    import uuid

    return (
        str(uuid.UUID(bytes=bytes(reversed(guid)))),
        str(uuid.UUID(bytes_le=bytes(guid))),
        str(uuid.UUID(bytes=bytes(guid))),
    )


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
