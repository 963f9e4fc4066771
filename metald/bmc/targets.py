"""Where a BMC registration may connect (issue 24 item 2).

``POST /api/v1/bmcs`` connects to the address it is given before storing anything, so without a
rule it is a request forger and port scanner aimed from metald's own host: its loopback, its
PostgreSQL, its own listeners. ``check`` refuses, before a byte is sent:

- an address outside ``[bmc] networks`` when that list is set (every resolved address of a host
  name must lie inside);
- loopback, link-local, unspecified, multicast and broadcast addresses, unless an entry of
  ``[bmc] networks`` that lies itself in that range names them (``127.0.0.0/8`` for a lab of
  simulated BMCs; ``0.0.0.0/0`` does not count);
- metald's own listeners (``[api] listen``, ``[boot] http_listen``, the store's host and port),
  whatever the networks say.

The refusal says which rule, never anything a peer sent (nothing has been sent yet).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from metald.config import Config, split_hostport
from metald.errors import Unprocessable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Ranges never connected to unless a configured network inside them names the address.
SPECIAL: tuple[tuple[str, tuple[Network, ...]], ...] = (
    ("loopback", (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))),
    ("link-local", (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))),
    ("unspecified", (ipaddress.ip_network("0.0.0.0/8"), ipaddress.ip_network("::/128"))),
    ("multicast", (ipaddress.ip_network("224.0.0.0/4"), ipaddress.ip_network("ff00::/8"))),
    ("broadcast", (ipaddress.ip_network("255.255.255.255/32"),)),
)
DEFAULT_PORTS = {"ipmi": (623,), "redfish": (443,), "auto": (443, 623)}


def own_listeners(cfg: Config) -> list[tuple[str, int]]:
    """metald's own TCP endpoints (host, port): the staff API, the provisioning listener and
    the store's server. A wildcard host stands for every address of this host."""
    out = [split_hostport(cfg.api.listen)]
    if cfg.boot.http_listen:
        out.append(split_hostport(cfg.boot.http_listen))
    if cfg.store.url and "://" in cfg.store.url and not cfg.store.url.startswith("sqlite"):
        u = urlsplit(cfg.store.url)
        try:
            port = u.port or 5432
        except ValueError:
            port = 5432
        out.append(((u.hostname or "localhost"), port))
    return out


def _normal(ip: Address) -> Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def refusal(
    ips: Iterable[Address],
    ports: Iterable[int],
    networks: Iterable[Network],
    own: Iterable[tuple[Iterable[Address], int]],
) -> str | None:
    """Why a BMC at these addresses and ports may not be connected to (None: it may)."""
    nets = list(networks)
    ports = set(ports)
    for raw in ips:
        ip = _normal(raw)
        for own_ips, own_port in own:
            if own_port in ports and ip in set(own_ips):
                return f"{ip} port {own_port} is one of metald's own listeners, not a BMC"
        for kind, ranges in SPECIAL:
            inside = [r for r in ranges if r.version == ip.version and ip in r]
            if inside and not any(
                n.version == ip.version and ip in n and n.subnet_of(inside[0])  # type: ignore[arg-type]
                for n in nets
            ):
                return (
                    f"{ip} is a {kind} address; metald connects there only when an entry of "
                    f"[bmc] networks inside {inside[0]} names it (a lab of simulated BMCs)"
                )
        if nets and not any(n.version == ip.version and ip in n for n in nets):
            shown = ", ".join(str(n) for n in nets)
            return f"{ip} is outside [bmc] networks ({shown}); add its network there"
    return None


def _local_ips() -> set[Address]:
    out: set[Address] = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            out.add(_normal(ipaddress.ip_address(info[4][0].split("%")[0])))
    except (OSError, ValueError):
        pass
    return out


async def _resolve(host: str) -> list[Address]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise Unprocessable(
            f"could not verify the BMC at {host}: the resolve step did not succeed (the name "
            "does not resolve); check the name, or register it by IP",
            step="resolve",
        ) from None
    return [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]


async def check(
    address: str,
    port: int | None,
    protocol: str,
    networks: Iterable[Network],
    own: Iterable[tuple[str, int]],
) -> None:
    """Unprocessable (422) when the BMC at ``address`` (a host, an IP, or ``http(s)://host``)
    may not be connected to: outside ``networks``, a special address, or metald's own."""
    host, scheme = address, ""
    if "://" in address:
        u = urlsplit(address)
        host, scheme = u.hostname or "", u.scheme
        port = port or u.port
    ips = await _resolve(host)
    if port is not None:
        ports: tuple[int, ...] = (port,)
    elif scheme == "http":
        ports = (80,)
    else:
        ports = DEFAULT_PORTS.get(protocol, DEFAULT_PORTS["auto"])
    own_sets: list[tuple[Iterable[Address], int]] = []
    for h, p in own:
        if h in ("0.0.0.0", "::", ""):
            own_sets.append((_local_ips(), p))
        else:
            try:
                own_sets.append((await _resolve(h), p))
            except Unprocessable:
                continue
    why = refusal(ips, ports, networks, own_sets)
    if why is not None:
        raise Unprocessable(
            f"metald does not connect to the BMC at {address}: {why}", step="target"
        )
