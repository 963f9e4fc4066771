"""Rendezvous (highest-random-weight) hashing: which member owns a key. Pure.

Every instance computes the same answer from the same member list, with no coordination.
When a member leaves only the keys it owned move (each to the member that ranked second for
it); when one joins it takes about 1/N of the keys from the others.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(member: str, key: str) -> int:
    """A stable pseudo-random weight of (member, key); blake2b, not Python's salted hash()."""
    digest = hashlib.blake2b(f"{member}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(key: str, members: Iterable[str]) -> str | None:
    """The member with the highest weight for ``key``; None when there are no members."""
    best: str | None = None
    best_w = -1
    for m in members:
        w = weight(m, key)
        # Ties (astronomically rare) go to the smaller name so every instance agrees.
        if w > best_w or (w == best_w and best is not None and m < best):
            best, best_w = m, w
    return best
