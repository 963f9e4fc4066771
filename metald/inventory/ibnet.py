"""The InfiniBand fabric as ``ibnetdiscover`` prints it: which switch port each host (CA) port
is cabled to. Pure.

metald runs no subnet manager and does not trust a host to name its own switch (a tenant has
root on it), so the leaf of a port comes from the fabric's side: an operator (or a timer on the
subnet manager's host) uploads the output of ``ibnetdiscover`` and metald matches the CA port
GUIDs in it with the port GUIDs in the machines' inventories.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SWITCH = re.compile(r'^Switch\s+\d+\s+"S-([0-9a-fA-F]{16})"\s*(?:#\s*"([^"]*)")?')
_CA = re.compile(r'^Ca\s+\d+\s+"H-([0-9a-fA-F]{16})"')
#: A CA's port line: [port](port guid) "S-<switch guid>"[switch port] ... # ... "name"
_CA_PORT = re.compile(r'^\[(\d+)\]\(([0-9a-fA-F]{1,16})\)\s+"S-([0-9a-fA-F]{16})"\[(\d+)\]')
MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Link:
    port_guid: str
    switch_guid: str
    switch_name: str | None
    switch_port: int


def _guid(hex_digits: str) -> str:
    return "0x" + hex_digits.lower().rjust(16, "0")


class IbnetError(ValueError):
    pass


def parse_ibnetdiscover(text: str) -> list[Link]:
    """Every CA port with the switch it is cabled to. Raises ``IbnetError`` when the text has
    no switch or no host port (not ibnetdiscover output)."""
    if len(text) > MAX_BYTES:
        raise IbnetError(f"ibnetdiscover output over {MAX_BYTES} bytes")
    names: dict[str, str | None] = {}
    links: list[Link] = []
    in_ca = False
    for raw in text.splitlines():
        line = raw.strip()
        if m := _SWITCH.match(line):
            names[_guid(m.group(1))] = m.group(2) or None
            in_ca = False
        elif _CA.match(line):
            in_ca = True
        elif not line:
            in_ca = False
        elif in_ca and (m := _CA_PORT.match(line)):
            links.append(
                Link(
                    port_guid=_guid(m.group(2)),
                    switch_guid=_guid(m.group(3)),
                    switch_name=None,
                    switch_port=int(m.group(4)),
                )
            )
    if not names or not links:
        raise IbnetError(
            "no switch or no host port found: upload the output of ibnetdiscover (without -p)"
        )
    return [
        Link(lk.port_guid, lk.switch_guid, names.get(lk.switch_guid), lk.switch_port)
        for lk in links
    ]


def leaf_name(link: Link) -> str:
    """How a leaf is named in machines and placement: its node description when it has a
    plain one, else its GUID."""
    name = link.switch_name
    if name and re.fullmatch(r"[A-Za-z0-9_.:/-]{1,64}", name):
        return name
    return link.switch_guid
