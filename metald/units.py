"""Sizes as people read them, the same in the web console and ``metalctl``: disks in decimal
units as their vendors label them (``2.0 GB``, ``3.84 TB``), memory in binary units
(``512 GiB``). Pure."""

from __future__ import annotations

_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _scaled(n: float, base: int, units: tuple[str, ...]) -> str:
    i = 0
    while abs(n) >= base and i < len(units) - 1:
        n /= base
        i += 1
    if i == 0:
        return f"{int(n)} {units[0]}"
    # Three significant figures: 2.00 GB reads 2.0 GB, 3.84 TB stays, 960 GB stays.
    text = f"{n:.2f}" if n < 10 else f"{n:.1f}" if n < 100 else f"{n:.0f}"
    if "." in text:
        text = text.rstrip("0")
        text = text + "0" if text.endswith(".") and n < 10 else text.rstrip(".")
    return f"{text} {units[i]}"


def disk_size(size_bytes: int | float | None) -> str:
    """A disk's size in decimal units (``2.0 GB`` for 2,000,000,000 bytes); '' when unknown."""
    if size_bytes is None:
        return ""
    return _scaled(float(size_bytes), 1000, _DECIMAL)


def mib(size_mib: int | float | None) -> str:
    """Memory given in MiB, in binary units (``512 GiB``, ``1.5 TiB``); '' when unknown."""
    if size_mib is None:
        return ""
    return _scaled(float(size_mib) * 1024 * 1024, 1024, _BINARY)


__all__ = ["disk_size", "mib"]
