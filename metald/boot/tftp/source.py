"""What a TFTP transfer reads from: shared, bounded file contents, never a copy per transfer.

Small files (iPXE binaries, a few hundred KB) are kept whole in one LRU cache with a bounded
total, so 200 clients fetching ipxe.efi share one ``bytes``. Bigger files are read block by
block with ``os.pread`` from one descriptor shared by every transfer of that file version, so
a transfer of a 1 GB image costs no memory beyond the block in flight. netascii (text mode)
needs a converted copy: it is made once per file version, cached like any small file, and
refused for files over ``NETASCII_MAX`` (no PXE client asks for a binary in netascii).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from metald.boot.tftp.packet import to_netascii

#: Files at most this big are kept in memory between transfers; bigger ones are pread.
CACHE_FILE_MAX = 16 << 20
CACHE_TOTAL_MAX = 256 << 20
#: netascii is for text files; converting a big binary per request would copy it each time.
NETASCII_MAX = 1 << 20


class SourceRefused(Exception):
    """The file cannot be served in the mode asked. ``reason`` is a metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Source(Protocol):
    """A file version's bytes, read by offset. ``close`` releases what the transfer held."""

    size: int

    def read(self, offset: int, n: int) -> bytes: ...

    def close(self) -> None: ...


class BytesSource:
    """Contents held in memory (shared between transfers; slicing copies one block only)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset : offset + n]

    def close(self) -> None:
        pass


class _SharedFd:
    def __init__(self, fd: int, key: tuple[int, int, int, int]) -> None:
        self.fd = fd
        self.key = key
        self.refs = 0


class FdSource:
    """A file read with pread from a descriptor shared by every transfer of its version."""

    def __init__(self, cache: FileCache, shared: _SharedFd, size: int) -> None:
        self._cache = cache
        self._shared: _SharedFd | None = shared
        self.size = size
        shared.refs += 1

    def read(self, offset: int, n: int) -> bytes:
        assert self._shared is not None, "read after close"
        return os.pread(self._shared.fd, n, offset)

    def close(self) -> None:
        if self._shared is not None:
            self._cache._release(self._shared)
            self._shared = None


class FileCache:
    """Opens files for transfers: small ones from memory, big ones by pread.

    Entries are keyed by path and mode and revalidated by (inode, mtime, size) on every open,
    so a replaced file is served fresh; memory is bounded by ``total_max`` (LRU).
    """

    def __init__(
        self,
        *,
        file_max: int = CACHE_FILE_MAX,
        total_max: int = CACHE_TOTAL_MAX,
        netascii_max: int = NETASCII_MAX,
    ) -> None:
        self.file_max = file_max
        self.total_max = total_max
        self.netascii_max = netascii_max
        self._files: OrderedDict[tuple[Path, str], tuple[tuple[int, int, int], bytes]] = (
            OrderedDict()
        )
        self._total = 0
        self._fds: dict[tuple[int, int, int, int], _SharedFd] = {}

    @property
    def cached_bytes(self) -> int:
        return self._total

    @property
    def open_fds(self) -> int:
        return len(self._fds)

    def open(self, path: Path, mode: str = "octet") -> Source:
        """A source for ``path`` (already checked by ``safe_path``). Raises OSError or
        SourceRefused."""
        st = os.stat(path)
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._files.get((path, mode))
        if hit is not None and hit[0] == version:
            self._files.move_to_end((path, mode))
            return BytesSource(hit[1])
        if mode == "netascii" and st.st_size > self.netascii_max:
            raise SourceRefused(
                "netascii-too-big",
                f"netascii only for files up to {self.netascii_max} bytes, use octet mode",
            )
        if mode == "octet" and st.st_size > self.file_max:
            return self._open_fd(path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
            if st.st_size > self.file_max:  # grew between stat and open
                return self._open_fd(path)
            data = _read_all(fd, st.st_size)
        finally:
            os.close(fd)
        if mode == "netascii":
            data = to_netascii(data)
        self._store((path, mode), version, data)
        return BytesSource(data)

    def _store(self, key: tuple[Path, str], version: tuple[int, int, int], data: bytes) -> None:
        old = self._files.pop(key, None)
        if old is not None:
            self._total -= len(old[1])
        if len(data) > self.total_max:
            return
        while self._files and self._total + len(data) > self.total_max:
            _, (_, evicted) = self._files.popitem(last=False)
            self._total -= len(evicted)
        self._files[key] = (version, data)
        self._total += len(data)

    def _open_fd(self, path: Path) -> FdSource:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        shared = self._fds.get(key)
        if shared is None:
            shared = self._fds[key] = _SharedFd(fd, key)
        else:
            os.close(fd)
        return FdSource(self, shared, st.st_size)

    def _release(self, shared: _SharedFd) -> None:
        shared.refs -= 1
        if shared.refs <= 0 and self._fds.get(shared.key) is shared:
            del self._fds[shared.key]
            os.close(shared.fd)


def _read_all(fd: int, size: int) -> bytes:
    chunks = []
    left = size
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
