"""Load balancing between the instances serving one network: which instance answers a client.
Pure.

Each client falls in one of 256 buckets by the RFC 3074 hash of its MAC (Pearson's hash with
the RFC's mixing table, as Kea's HA load balancing computes it). Kea splits the buckets between
two servers; here each bucket goes to the rendezvous winner (``metald.fleet.rendezvous``) among
the live instances serving the network, so N instances split them about evenly and a dead
instance's buckets move to the others while every other bucket stays where it was.

An instance also answers a client of another instance when the client has waited
``takeover_secs`` (its ``secs`` field, as Kea's HA does): the owner is alive for the fleet but
not answering its clients.
"""

from __future__ import annotations

from collections.abc import Iterable

from metald.fleet.rendezvous import owner

#: RFC 3074 section 6: a "mixing table" of the 256 byte values in pseudo-random order.
MIX_TABLE = bytes(
    (
        251, 175, 119, 215, 81, 14, 79, 191, 103, 49, 181, 143, 186, 157, 0, 232,
        31, 32, 55, 60, 152, 58, 17, 237, 174, 70, 160, 144, 220, 90, 57, 223,
        59, 3, 18, 140, 111, 166, 203, 196, 134, 243, 124, 95, 222, 179, 197, 65,
        180, 48, 36, 15, 107, 46, 233, 130, 165, 30, 123, 161, 209, 23, 97, 16,
        40, 91, 219, 61, 100, 10, 210, 109, 250, 127, 22, 138, 29, 108, 244, 67,
        207, 9, 178, 204, 74, 98, 126, 249, 167, 116, 34, 77, 193, 200, 121, 5,
        20, 113, 71, 35, 128, 13, 182, 94, 25, 226, 227, 199, 75, 27, 41, 245,
        230, 224, 43, 225, 177, 26, 155, 150, 212, 142, 218, 115, 241, 73, 88, 105,
        39, 114, 62, 255, 192, 201, 145, 214, 168, 158, 221, 148, 154, 122, 12, 84,
        82, 163, 44, 139, 228, 236, 205, 242, 217, 11, 187, 146, 159, 64, 86, 239,
        195, 42, 106, 198, 118, 112, 184, 172, 87, 2, 173, 117, 176, 229, 247, 253,
        137, 185, 99, 164, 102, 147, 45, 66, 231, 52, 141, 211, 194, 206, 246, 238,
        56, 110, 78, 248, 63, 240, 189, 93, 92, 51, 53, 183, 19, 171, 72, 50,
        33, 104, 101, 69, 8, 252, 83, 120, 76, 135, 85, 54, 202, 125, 188, 213,
        96, 235, 136, 208, 162, 129, 190, 132, 156, 38, 47, 1, 7, 254, 24, 4,
        216, 131, 89, 21, 28, 133, 37, 153, 149, 80, 170, 68, 6, 169, 234, 151,
    )
)  # fmt: skip

BUCKETS = 256


def rfc3074_hash(key: bytes) -> int:
    """RFC 3074 section 6: the bucket (0-255) of a client identifier (here its MAC)."""
    h = len(key) & 0xFF
    for b in reversed(key):
        h = MIX_TABLE[h ^ b]
    return h


def bucket_owners(network: str, members: Iterable[str]) -> tuple[str | None, ...]:
    """Each bucket's owner among ``members`` (the live instances serving ``network``)."""
    names = sorted(set(members))
    return tuple(owner(f"dhcp:{network}:{b}", names) for b in range(BUCKETS))


class Split:
    """Who answers whom on one network, for one instance; rebuilt when the live set changes."""

    __slots__ = ("instance", "owners", "takeover_secs", "mine", "names")

    def __init__(self, instance: str, owners: tuple[str | None, ...], takeover_secs: int) -> None:
        self.instance = instance
        self.owners = owners
        self.takeover_secs = takeover_secs
        #: Per bucket: whether it is this instance's (or nobody's: then anyone answers).
        self.mine = tuple(o is None or o == instance for o in owners)
        #: The instances the buckets were split among.
        self.names = frozenset(o for o in owners if o is not None)

    def answers(self, chaddr: bytes, secs: int) -> bool:
        """Whether this instance answers a client with this hardware address and ``secs``."""
        return self.mine[rfc3074_hash(chaddr)] or secs >= self.takeover_secs

    def owner_of(self, chaddr: bytes) -> str | None:
        return self.owners[rfc3074_hash(chaddr)]
