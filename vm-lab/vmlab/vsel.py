"""The lab BMC's System Event Log: the IPMI SEL device commands (NetFn Storage 0x0A, IPMI 2.0
section 31) a BMC's owner uses to read it and a fault injector uses to add to it, kept in the
virtual BMC's memory (lost when it restarts, as on a BMC without a persistent SEL).

Get SEL Info, Reserve SEL, Get SEL Entry, Add SEL Entry, Clear SEL and Get SEL Time; nothing
else (no partial adds, no delete)."""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

NETFN_STORAGE = 0x0A
GET_SEL_INFO, RESERVE_SEL, GET_SEL_ENTRY, ADD_SEL_ENTRY = 0x40, 0x42, 0x43, 0x44
CLEAR_SEL, GET_SEL_TIME = 0x47, 0x48
#: Completion codes (IPMI 2.0 table 5-2).
OK, INVALID_RESERVATION, OUT_OF_SPACE, NOT_PRESENT, BAD_LENGTH, BAD_FIELD = (
    0x00, 0xC5, 0xC4, 0xCB, 0xC7, 0xCC,
)  # fmt: skip
RECORD = 16
#: Records kept: a full log refuses more (out of space), as a BMC does.
CAPACITY = 1024


class SystemEventLog:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.records: list[bytes] = []  # 16 bytes each, the record ID in bytes 0-1
        self._next_id = 1
        self._reservation = 0
        self._added = self._erased = 0
        self._lock = threading.Lock()

    def handle(self, request: dict[str, Any], session: Any) -> bool:
        """Answer a Storage SEL command; False for anything else (the caller answers it)."""
        if request.get("netfn") != NETFN_STORAGE:
            return False
        cmd = request.get("command")
        if cmd not in (GET_SEL_INFO, RESERVE_SEL, GET_SEL_ENTRY, ADD_SEL_ENTRY, CLEAR_SEL,
                       GET_SEL_TIME):  # fmt: skip
            return False
        with self._lock:
            code, data = self._answer(cmd, bytes(request.get("data") or b""))
        session.send_ipmi_response(code=code, data=list(data))
        return True

    def _answer(self, cmd: int, data: bytes) -> tuple[int, bytes]:
        now = int(time.time())
        if cmd == GET_SEL_INFO:
            free = (self.capacity - len(self.records)) * RECORD
            # version 0x51, entries, free bytes, last add, last erase, operations: reserve
            return OK, struct.pack("<BHHIIB", 0x51, len(self.records), min(free, 0xFFFF),
                                   self._added, self._erased, 0x02)  # fmt: skip
        if cmd == GET_SEL_TIME:
            return OK, struct.pack("<I", now)
        if cmd == RESERVE_SEL:
            self._reservation = self._reservation % 0xFFFF + 1
            return OK, struct.pack("<H", self._reservation)
        if cmd == ADD_SEL_ENTRY:
            if len(data) != RECORD:
                return BAD_LENGTH, b""
            if len(self.records) >= self.capacity:
                return OUT_OF_SPACE, b""
            rid = self._next_id
            self._next_id = self._next_id % 0xFFFE + 1
            rec = bytearray(data)
            rec[0:2] = struct.pack("<H", rid)
            if rec[2] == 0x02 or 0xC0 <= rec[2] <= 0xDF:  # timestamped records: the SEL's time
                rec[3:7] = struct.pack("<I", now)
            self.records.append(bytes(rec))
            self._added = now
            return OK, struct.pack("<H", rid)
        if cmd == GET_SEL_ENTRY:
            if len(data) != 6:
                return BAD_LENGTH, b""
            rsv, rid, offset, count = struct.unpack("<HHBB", data)
            if (offset or count != 0xFF) and rsv != self._reservation:
                return INVALID_RESERVATION, b""
            if not self.records:
                return NOT_PRESENT, b""
            ids = [struct.unpack_from("<H", r)[0] for r in self.records]
            if rid == 0x0000:
                i = 0
            elif rid == 0xFFFF:
                i = len(ids) - 1
            elif rid in ids:
                i = ids.index(rid)
            else:
                return NOT_PRESENT, b""
            nxt = ids[i + 1] if i + 1 < len(ids) else 0xFFFF
            end = RECORD if count == 0xFF else offset + count
            return OK, struct.pack("<H", nxt) + self.records[i][offset:end]
        if cmd == CLEAR_SEL:
            if len(data) != 6 or data[2:5] != b"CLR":
                return BAD_FIELD, b""
            if struct.unpack_from("<H", data)[0] != self._reservation:
                return INVALID_RESERVATION, b""
            if data[5] == 0xAA:
                self.records.clear()
                self._erased = now
            return OK, b"\x01"  # erasure completed
        return BAD_FIELD, b""
