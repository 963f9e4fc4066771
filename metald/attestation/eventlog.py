"""The UEFI measured-boot event log (TCG PC Client Platform Firmware Profile, crypto-agile
format): parsed into events and replayed into the PCR values it claims.

The log itself proves nothing (it is plain bytes the OS hands over); it becomes evidence once
its replay equals the PCR values a verified quote signed. Then each event tells what was
measured: which firmware volume, UEFI variable, option ROM or boot application.

Pure: bytes in, events and digests out.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from dataclasses import dataclass

from metald.attestation.tpm import HASH_IDS, HASHES

EV_NO_ACTION = 0x3
EV_SEPARATOR = 0x4
EV_EFI_VARIABLE_DRIVER_CONFIG = 0x80000001
EV_EFI_VARIABLE_BOOT = 0x80000002
EV_EFI_ACTION = 0x80000007
EV_EFI_VARIABLE_AUTHORITY = 0x800000E0

EVENT_TYPES = {
    0x0: "EV_PREBOOT_CERT",
    0x1: "EV_POST_CODE",
    0x3: "EV_NO_ACTION",
    0x4: "EV_SEPARATOR",
    0x5: "EV_ACTION",
    0x6: "EV_EVENT_TAG",
    0x7: "EV_S_CRTM_CONTENTS",
    0x8: "EV_S_CRTM_VERSION",
    0x9: "EV_CPU_MICROCODE",
    0xA: "EV_PLATFORM_CONFIG_FLAGS",
    0xB: "EV_TABLE_OF_DEVICES",
    0xC: "EV_COMPACT_HASH",
    0xD: "EV_IPL",
    0xE: "EV_IPL_PARTITION_DATA",
    0xF: "EV_NONHOST_CODE",
    0x10: "EV_NONHOST_CONFIG",
    0x11: "EV_NONHOST_INFO",
    0x12: "EV_OMIT_BOOT_DEVICE_EVENTS",
    0x80000001: "EV_EFI_VARIABLE_DRIVER_CONFIG",
    0x80000002: "EV_EFI_VARIABLE_BOOT",
    0x80000003: "EV_EFI_BOOT_SERVICES_APPLICATION",
    0x80000004: "EV_EFI_BOOT_SERVICES_DRIVER",
    0x80000005: "EV_EFI_RUNTIME_SERVICES_DRIVER",
    0x80000006: "EV_EFI_GPT_EVENT",
    0x80000007: "EV_EFI_ACTION",
    0x80000008: "EV_EFI_PLATFORM_FIRMWARE_BLOB",
    0x80000009: "EV_EFI_HANDOFF_TABLES",
    0x8000000A: "EV_EFI_PLATFORM_FIRMWARE_BLOB2",
    0x8000000B: "EV_EFI_HANDOFF_TABLES2",
    0x8000000C: "EV_EFI_VARIABLE_BOOT2",
    0x80000010: "EV_EFI_HCRTM_EVENT",
    0x800000E0: "EV_EFI_VARIABLE_AUTHORITY",
    0x800000E1: "EV_EFI_SPDM_FIRMWARE_BLOB",
    0x800000E2: "EV_EFI_SPDM_FIRMWARE_CONFIG",
}

_SPEC_ID = b"Spec ID Event03\x00"
_STARTUP_LOCALITY = b"StartupLocality\x00"
#: Events whose digest is, by the profile, the hash of exactly their event data: a log that
#: shows other data for such an event is lying about what was measured.
_DATA_HASHED = frozenset({EV_SEPARATOR, EV_EFI_ACTION, EV_EFI_VARIABLE_DRIVER_CONFIG})
#: The most events a log may hold: a real one has a few hundred.
MAX_EVENTS = 10_000


class EventLogError(ValueError):
    """The bytes are not a crypto-agile TCG event log."""


@dataclass(frozen=True)
class Event:
    index: int  # position in the log, 0 = the Spec ID header
    pcr: int
    type: int
    digests: dict[str, bytes]  # hashlib name -> digest
    data: bytes

    @property
    def type_name(self) -> str:
        return EVENT_TYPES.get(self.type, f"0x{self.type:08x}")

    @property
    def label(self) -> str:
        """A short human description: the UEFI variable name, the action text, or ''."""
        if self.type in (
            EV_EFI_VARIABLE_DRIVER_CONFIG,
            EV_EFI_VARIABLE_BOOT,
            0x8000000C,
            EV_EFI_VARIABLE_AUTHORITY,
        ):
            var = efi_variable(self.data)
            if var is not None:
                return var[1]
        if self.type in (EV_EFI_ACTION, 0x5, 0x8, 0xD) or self.type == EV_SEPARATOR:
            text = self.data.rstrip(b"\x00")
            if text and all(32 <= c < 127 for c in text):
                return text.decode()
        if self.type in (0x8000000A, 0x8000000B) and self.data:
            n = self.data[0]
            text = self.data[1 : 1 + n]
            if all(32 <= c < 127 for c in text):
                return text.decode()
        return ""

    def data_mismatch(self, alg: str) -> bool:
        """Whether this event's data contradicts its digest (for events whose digest is the
        hash of their data)."""
        if self.type not in _DATA_HASHED or alg not in self.digests:
            return False
        return hashlib.new(alg, self.data).digest() != self.digests[alg]


def efi_variable(data: bytes) -> tuple[str, str, bytes] | None:
    """A UEFI_VARIABLE_DATA: (vendor GUID, name, value), or None if the data is not one."""
    if len(data) < 32:
        return None
    guid = str(uuid.UUID(bytes_le=data[:16]))
    name_len, data_len = struct.unpack("<QQ", data[16:32])
    end = 32 + name_len * 2
    if end + data_len != len(data):
        return None
    try:
        name = data[32:end].decode("utf-16-le")
    except UnicodeDecodeError:
        return None
    return guid, name, data[end:]


@dataclass(frozen=True)
class EventLog:
    algorithms: dict[str, int]  # hashlib name -> digest size, from the Spec ID header
    events: tuple[Event, ...]
    startup_locality: int

    def replay(self, alg: str = "sha256") -> dict[int, bytes]:
        """The PCR values this log claims: each measured event extended in order into a PCR
        that starts at zero (PCR 0 starts at the startup locality)."""
        if alg not in self.algorithms:
            raise EventLogError(f"the event log has no {alg} digests")
        size = self.algorithms[alg]
        pcrs: dict[int, bytes] = {}
        for ev in self.events:
            if ev.type == EV_NO_ACTION or ev.index == 0:
                continue
            start = bytes(size)
            if ev.pcr == 0:
                start = bytes(size - 1) + bytes([self.startup_locality])
            pcrs[ev.pcr] = hashlib.new(alg, pcrs.get(ev.pcr, start) + ev.digests[alg]).digest()
        return pcrs

    def measured(self, pcr: int) -> list[Event]:
        return [e for e in self.events if e.pcr == pcr and e.type != EV_NO_ACTION and e.index]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise EventLogError(f"event log ends inside an event (offset {self.pos})")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])


def parse(data: bytes) -> EventLog:
    """Parse a crypto-agile log (``/sys/kernel/security/tpm0/binary_bios_measurements``)."""
    r = _Reader(data)
    pcr, kind = r.u32(), r.u32()
    r.take(20)
    header = r.take(r.u32())
    if kind != EV_NO_ACTION or pcr != 0 or not header.startswith(_SPEC_ID):
        raise EventLogError("not a crypto-agile event log (no Spec ID Event03 header)")
    h = _Reader(header[len(_SPEC_ID) :])
    h.take(4 + 4)  # platformClass, version minor/major, errata, uintnSize
    count = h.u32()
    if not 0 < count <= 16:
        raise EventLogError("the event log names no digest algorithms")
    sizes: dict[int, int] = {}
    for _ in range(count):
        alg, size = h.u16(), h.u16()
        sizes[alg] = size
    algorithms = {HASHES[a][0]: s for a, s in sizes.items() if a in HASHES}
    for name, size in algorithms.items():
        if hashlib.new(name).digest_size != size:
            raise EventLogError(f"the event log gives {name} a wrong digest size")
    events = [Event(0, 0, EV_NO_ACTION, {}, header)]
    locality = 0
    while r.pos < len(data):
        if len(events) > MAX_EVENTS:
            raise EventLogError(f"the event log has more than {MAX_EVENTS} events")
        pcr, kind = r.u32(), r.u32()
        digests: dict[str, bytes] = {}
        for _ in range(r.u32()):
            alg = r.u16()
            if alg not in sizes:
                raise EventLogError(f"event {len(events)} uses an undeclared algorithm")
            digest = r.take(sizes[alg])
            if alg in HASHES:
                digests[HASHES[alg][0]] = digest
        body = r.take(r.u32())
        if pcr > 23:
            raise EventLogError(f"event {len(events)} names PCR {pcr}")
        if kind == EV_NO_ACTION and body.startswith(_STARTUP_LOCALITY) and len(body) >= 17:
            locality = body[16]
        elif kind != EV_NO_ACTION and set(digests) != set(algorithms):
            raise EventLogError(f"event {len(events)} lacks a digest of a declared algorithm")
        events.append(Event(len(events), pcr, kind, digests, body))
    return EventLog(algorithms, tuple(events), locality)


__all__ = ["HASH_IDS", "Event", "EventLog", "EventLogError", "efi_variable", "parse"]
