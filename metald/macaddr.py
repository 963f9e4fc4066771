"""MAC addresses in the one spelling metald stores and compares: ``aa:bb:cc:dd:ee:ff``. Pure."""

from __future__ import annotations

import re

from metald.errors import Unprocessable

_MAC_RE = re.compile(r"^[0-9a-f]{2}([:-]?[0-9a-f]{2}){5}$")


class BadMac(Unprocessable, ValueError):
    """Not a MAC address. A ValueError too, so configuration validators report it."""


def normalize_mac(mac: str) -> str:
    """``AA-BB-CC-DD-EE-FF`` / ``aabb.ccdd.eeff`` / ``aabbccddeeff`` -> ``aa:bb:cc:dd:ee:ff``."""
    m = mac.strip().lower().replace(".", "")
    if not _MAC_RE.match(m):
        raise BadMac(f"{mac!r} is not a MAC address (expected aa:bb:cc:dd:ee:ff)")
    hexdigits = m.replace(":", "").replace("-", "")
    return ":".join(hexdigits[i : i + 2] for i in range(0, 12, 2))
