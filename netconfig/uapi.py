"""WireGuard's cross-platform control protocol (UAPI), as wireguard-go serves it. Pure.

Requests and replies are ``key=value`` lines ending with a blank line; keys are hex. See
https://www.wireguard.com/xplatform/. pyroute2's WireGuard class speaks kernel generic netlink
only, so userspace devices are configured through this protocol instead (no private key ever
goes on a command line or into a file).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from datetime import UTC, datetime


class UapiError(Exception):
    pass


@dataclass
class PeerConfig:
    public_key: str
    allowed_ips: list[str] = field(default_factory=list)
    endpoint: str | None = None
    persistent_keepalive: int | None = None
    remove: bool = False


@dataclass
class PeerStatus:
    public_key: str
    endpoint: str | None = None
    allowed_ips: list[str] = field(default_factory=list)
    last_handshake: datetime | None = None
    rx_bytes: int = 0
    tx_bytes: int = 0


def _hex(key: str) -> str:
    raw = base64.b64decode(key, validate=True)
    if len(raw) != 32:
        raise UapiError("a WireGuard key is 32 bytes")
    return raw.hex()


def render_set(
    *,
    private_key: str | None = None,
    listen_port: int | None = None,
    peers: list[PeerConfig] = (),  # type: ignore[assignment]
    replace_peers: bool = False,
) -> str:
    lines = ["set=1"]
    if private_key is not None:
        lines.append(f"private_key={_hex(private_key)}")
    if listen_port is not None:
        lines.append(f"listen_port={listen_port}")
    if replace_peers:
        lines.append("replace_peers=true")
    for p in peers:
        lines.append(f"public_key={_hex(p.public_key)}")
        if p.remove:
            lines.append("remove=true")
            continue
        if p.endpoint:
            lines.append(f"endpoint={p.endpoint}")
        if p.persistent_keepalive is not None:
            lines.append(f"persistent_keepalive_interval={p.persistent_keepalive}")
        lines.append("replace_allowed_ips=true")
        lines.extend(f"allowed_ip={a}" for a in p.allowed_ips)
    return "\n".join(lines) + "\n\n"


def check_errno(reply: str) -> None:
    for line in reply.splitlines():
        if line.startswith("errno="):
            code = int(line.split("=", 1)[1])
            if code != 0:
                raise UapiError(f"wireguard device refused the request (errno {code})")
            return
    raise UapiError("wireguard device closed the control socket without an answer")


def parse_get(reply: str) -> list[PeerStatus]:
    """The peers in a ``get=1`` reply (device-level keys, private key included, are dropped)."""
    check_errno(reply)
    peers: list[PeerStatus] = []
    sec = nsec = 0
    for line in reply.splitlines():
        key, _, value = line.partition("=")
        if key == "public_key":
            peers.append(PeerStatus(base64.b64encode(bytes.fromhex(value)).decode()))
            sec = nsec = 0
        elif not peers:
            continue
        elif key == "endpoint":
            peers[-1].endpoint = value
        elif key == "allowed_ip":
            peers[-1].allowed_ips.append(value)
        elif key == "rx_bytes":
            peers[-1].rx_bytes = int(value)
        elif key == "tx_bytes":
            peers[-1].tx_bytes = int(value)
        elif key in ("last_handshake_time_sec", "last_handshake_time_nsec"):
            if key.endswith("_sec"):
                sec = int(value)
            else:
                nsec = int(value)
            if sec or nsec:
                peers[-1].last_handshake = datetime.fromtimestamp(sec + nsec / 1e9, UTC)
    return peers
