"""Kernel modules: their dependencies from each module's ``.modinfo`` section, and a load order.

Debian's kernel package ships no ``modules.dep`` (``depmod`` makes it at install time, and
``kmod`` may be missing where we build), so the same facts are read straight from the ELF files:
every ``.ko`` carries ``depends=a,b`` in its ``.modinfo`` section.
"""

from __future__ import annotations

import lzma
import struct
from pathlib import Path


class ModuleError(Exception):
    pass


def read_module(path: Path) -> bytes:
    data = path.read_bytes()
    return lzma.decompress(data) if path.name.endswith(".xz") else data


def modinfo(elf: bytes) -> dict[str, list[str]]:
    """Key -> values of an ELF64 module's ``.modinfo`` section (a key may repeat: alias=...)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ModuleError("not an ELF64 kernel module")
    endian = "<" if elf[5] == 1 else ">"
    shoff = struct.unpack_from(endian + "Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from(endian + "HHH", elf, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        name = struct.unpack_from(endian + "I", elf, base)[0]
        offset, size = struct.unpack_from(endian + "QQ", elf, base + 0x18)
        return name, offset, size

    _, str_off, _ = section(shstrndx)
    for i in range(shnum):
        name_off, offset, size = section(i)
        end = elf.index(b"\0", str_off + name_off)
        if elf[str_off + name_off : end] == b".modinfo":
            info: dict[str, list[str]] = {}
            for item in elf[offset : offset + size].split(b"\0"):
                key, sep, value = item.decode(errors="replace").partition("=")
                if sep:
                    info.setdefault(key, []).append(value)
            return info
    raise ModuleError("no .modinfo section")


def module_name(path: Path) -> str:
    return path.name.split(".ko")[0].replace("-", "_")


def index_modules(modules_dir: Path) -> dict[str, Path]:
    """Module name -> file, for every module under ``lib/modules/<version>/kernel``."""
    return {module_name(p): p for p in modules_dir.rglob("*.ko*") if ".ko" in p.name}


def load_order(wanted: list[str], index: dict[str, Path]) -> list[str]:
    """``wanted`` and everything they depend on, each after its dependencies.

    Modules built into the kernel are not in ``index``; naming one in ``wanted`` is an error,
    but a dependency on one cannot happen (modinfo only lists loadable modules).
    """
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ModuleError(f"dependency cycle: {' -> '.join((*chain, name))}")
        if name not in index:
            raise ModuleError(
                f"module {name!r} not found (needed by {' -> '.join(chain) or 'the image'})"
            )
        state[name] = "visiting"
        deps = modinfo(read_module(index[name])).get("depends", [""])[0]
        for dep in filter(None, deps.split(",")):
            visit(dep.replace("-", "_"), (*chain, name))
        state[name] = "done"
        order.append(name)

    for name in wanted:
        visit(name, ())
    return order
