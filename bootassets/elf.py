"""Just enough ELF64 reading for the image builder: named sections and DT_NEEDED entries."""

from __future__ import annotations

import struct
from pathlib import Path

SHT_DYNAMIC = 6
DT_NEEDED = 1
#: e_machine values (the ELF header's target architecture).
EM_X86_64 = 62
EM_AARCH64 = 183
MACHINE_NAMES = {EM_X86_64: "amd64", EM_AARCH64: "arm64"}


class ElfError(Exception):
    pass


def _endian(elf: bytes) -> str:
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ElfError("not an ELF64 file")
    return "<" if elf[5] == 1 else ">"


def machine(elf: bytes) -> int:
    """The ELF header's e_machine: which CPU the file's code is for."""
    e = _endian(elf)
    if len(elf) < 0x14:
        raise ElfError("truncated ELF header")
    return int(struct.unpack_from(e + "H", elf, 0x12)[0])


def _section_table(elf: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of every section, in file order."""
    e = _endian(elf)
    shoff = struct.unpack_from(e + "Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", elf, 0x3A)
    raw = []
    for i in range(shnum):
        base = shoff + i * shentsize
        name, stype = struct.unpack_from(e + "II", elf, base)
        offset, size = struct.unpack_from(e + "QQ", elf, base + 0x18)
        link = struct.unpack_from(e + "I", elf, base + 0x28)[0]
        raw.append((name, stype, offset, size, link))
    str_off = raw[shstrndx][2]
    table = []
    for name, stype, offset, size, link in raw:
        end = elf.index(b"\0", str_off + name)
        table.append((elf[str_off + name : end].decode(), stype, offset, size, link))
    return table


def section(elf: bytes, name: str) -> bytes | None:
    """The contents of the named section, or None."""
    for sname, _, offset, size, _ in _section_table(elf):
        if sname == name:
            return elf[offset : offset + size]
    return None


def needed(elf: bytes) -> list[str]:
    """Shared libraries a program or library names (DT_NEEDED), in order."""
    e = _endian(elf)
    table = _section_table(elf)
    dynamic = next((t for t in table if t[1] == SHT_DYNAMIC), None)
    if dynamic is None:
        return []  # static
    _, _, offset, size, link = dynamic
    strtab = table[link][2]
    names = []
    for pos in range(offset, offset + size, 16):
        tag, val = struct.unpack_from(e + "qQ", elf, pos)
        if tag == 0:
            break
        if tag == DT_NEEDED:
            end = elf.index(b"\0", strtab + val)
            names.append(elf[strtab + val : end].decode())
    return names


def library_closure(program: Path, lib_dirs: list[Path]) -> dict[str, Path]:
    """soname -> file for every library ``program`` needs, directly or not."""
    found: dict[str, Path] = {}
    todo = needed(program.read_bytes())
    while todo:
        soname = todo.pop()
        if soname in found:
            continue
        path = next((d / soname for d in lib_dirs if (d / soname).exists()), None)
        if path is None:
            raise ElfError(
                f"{program.name} needs {soname}, which is in none of the unpacked packages"
            )
        found[soname] = path.resolve()
        todo += needed(found[soname].read_bytes())
    return found
