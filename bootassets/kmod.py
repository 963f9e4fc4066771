"""Kernel modules: their dependencies from each module's ``.modinfo`` section, and a load order.

Debian's kernel package ships no ``modules.dep`` (``depmod`` makes it at install time, and
``kmod`` may be missing where we build), so the same facts are read straight from the ELF files:
every ``.ko`` carries ``depends=a,b`` in its ``.modinfo`` section.
"""

from __future__ import annotations

import lzma
from pathlib import Path

from bootassets import elf


class ModuleError(Exception):
    pass


def read_module(path: Path) -> bytes:
    data = path.read_bytes()
    return lzma.decompress(data) if path.name.endswith(".xz") else data


def modinfo(elf_bytes: bytes) -> dict[str, list[str]]:
    """Key -> values of a module's ``.modinfo`` section (a key may repeat: alias=...)."""
    try:
        data = elf.section(elf_bytes, ".modinfo")
    except elf.ElfError as e:
        raise ModuleError(str(e)) from None
    if data is None:
        raise ModuleError("no .modinfo section")
    info: dict[str, list[str]] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            info.setdefault(key, []).append(value)
    return info


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
