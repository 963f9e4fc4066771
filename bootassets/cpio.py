"""A writer for the cpio "newc" format the Linux kernel unpacks as its initramfs.

Pure Python so the image is built without root (device nodes need no mknod), without the
``cpio`` tool (not on a minimal Debian), and byte-for-byte reproducibly (fixed mtimes, sorted
entries, inode numbers from order).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

_TRAILER = "TRAILER!!!"


@dataclass(frozen=True)
class Entry:
    path: str  # without a leading slash: "bin/busybox"
    mode: int  # full st_mode: type bits | permissions
    data: bytes = b""  # file contents, or the link target for symlinks
    rdev_major: int = 0
    rdev_minor: int = 0


def directory(path: str, perm: int = 0o755) -> Entry:
    return Entry(path, stat.S_IFDIR | perm)


def file(path: str, data: bytes, perm: int = 0o644) -> Entry:
    return Entry(path, stat.S_IFREG | perm, data)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, stat.S_IFLNK | 0o777, target.encode())


def char_device(path: str, major: int, minor: int, perm: int = 0o600) -> Entry:
    return Entry(path, stat.S_IFCHR | perm, rdev_major=major, rdev_minor=minor)


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _header(ino: int, e: Entry, nlink: int, namesize: int) -> bytes:
    fields = (
        ino,
        e.mode,
        0,
        0,
        nlink,
        0,
        len(e.data),
        0,
        0,
        e.rdev_major,
        e.rdev_minor,
        namesize,
        0,
    )
    return b"070701" + b"".join(f"{v:08x}".encode() for v in fields)


def pack(entries: list[Entry]) -> bytes:
    """The archive: parents are listed before children (the kernel needs that), then a trailer."""
    out = bytearray()
    ordered = sorted(entries, key=lambda e: e.path.split("/"))
    for ino, e in enumerate([*ordered, Entry(_TRAILER, 0)], start=1):
        name = e.path.encode() + b"\0"
        nlink = 2 if stat.S_ISDIR(e.mode) else 1
        head = _header(ino if e.path != _TRAILER else 0, e, nlink, len(name))
        out += head + name + _pad4(len(head) + len(name))
        out += e.data + _pad4(len(e.data))
    return bytes(out)
