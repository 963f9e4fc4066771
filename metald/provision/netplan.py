"""The deployed OS's network config: netplan v2 (cloud-init's network-config version 2) from
the machine's inventory NICs, the claim's request and metald's address pools. Pure.

A request (``docs/tenant-os.md``) names NICs by ``name``, ``mac``, ``pci`` (PCI address) or
``role`` (``pxe``: the NIC the machine network-boots from; ``data``: the first other NIC in PCI
address order, ``data:N`` the Nth of them), and asks for

- ``ethernets``: one NIC, DHCP or an address from a pool, MTU, routes;
- ``bonds``: ``802.3ad`` (LACP) or ``active-backup`` over NICs;
- ``vlans``: a VLAN id on a NIC or bond (the id defaults to the pool's);
- ``rails``: one address per rail NIC from each rail's pool, each rail with its own routing
  table and a policy rule for its source address (GPU compute rails); the rail NICs are named,
  or else every data NIC the rest of the request left free, in PCI address order;
- ``dns``: name servers and search domains (else the pools' own).

Addresses come from ``allocate(pool, interface)``: the caller's IPAM (the store). Without a
request the PXE NIC does DHCP, as before; with one, the PXE NIC does DHCP only when it is not
used otherwise and ``pxe_dhcp`` is not false (static from the start: ``pxe_dhcp: false``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Routing table of rail N: RAIL_TABLE_BASE + N.
RAIL_TABLE_BASE = 100
BOND_MODES = ("802.3ad", "active-backup")


class NetworkRequestError(ValueError):
    """The request does not fit this machine or metald's pools; the message says why."""


@dataclass(frozen=True)
class Pool:
    """One network metald hands static addresses out of (``[provision.networks.NAME]``)."""

    name: str
    cidr: str
    gateway: str | None = None
    #: First and last address handed out (default: the whole subnet but the gateway).
    start: str | None = None
    end: str | None = None
    dns: tuple[str, ...] = ()
    search: tuple[str, ...] = ()
    mtu: int | None = None
    vlan: int | None = None

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(self.cidr, strict=False)

    def candidates(self) -> list[str]:
        """Every address this pool may hand out, in order (bounded: /16 at most)."""
        net = self.network
        lo = int(ipaddress.ip_address(self.start)) if self.start else None
        hi = int(ipaddress.ip_address(self.end)) if self.end else None
        out: list[str] = []
        for a in net.hosts():
            if lo is not None and int(a) < lo:
                continue
            if hi is not None and int(a) > hi:
                break
            if self.gateway and str(a) == self.gateway:
                continue
            out.append(str(a))
            if len(out) >= 65536:
                break
        return out


@dataclass(frozen=True)
class NicInfo:
    name: str
    mac: str
    pci: str | None = None
    pxe: bool = False


@dataclass
class _Render:
    nics: list[NicInfo]
    pools: Mapping[str, Pool]
    allocate: Callable[[str, str], str]
    used: dict[str, str] = field(default_factory=dict)  # mac -> what uses it
    out: dict[str, Any] = field(default_factory=lambda: {"version": 2})
    dns_pools: list[Pool] = field(default_factory=list)


def nics_from_inventory(inventory: Mapping[str, Any] | None, pxe_mac: str | None) -> list[NicInfo]:
    out = []
    for n in (inventory or {}).get("nics") or []:
        mac = str(n.get("mac", "")).lower()
        out.append(NicInfo(str(n.get("name")), mac, n.get("pci_address"), mac == pxe_mac))
    return out


def _data_nics(nics: list[NicInfo]) -> list[NicInfo]:
    return sorted((n for n in nics if not n.pxe), key=lambda n: (n.pci or "~", n.name))


def select_nic(sel: Mapping[str, Any] | str, nics: list[NicInfo]) -> NicInfo:
    """The one NIC a selector names; a string is a NIC name."""
    if isinstance(sel, str):
        sel = {"name": sel}
    hits: list[NicInfo]
    if "name" in sel:
        hits = [n for n in nics if n.name == sel["name"]]
    elif "mac" in sel:
        hits = [n for n in nics if n.mac == str(sel["mac"]).lower()]
    elif "pci" in sel:
        hits = [n for n in nics if n.pci and n.pci.lower() == str(sel["pci"]).lower()]
    elif "role" in sel:
        role = str(sel["role"])
        if role == "pxe":
            hits = [n for n in nics if n.pxe]
        elif role.startswith("data"):
            data = _data_nics(nics)
            idx = int(role.split(":", 1)[1]) if ":" in role else 0
            hits = data[idx : idx + 1]
        else:
            raise NetworkRequestError(f"unknown NIC role {role!r}; use pxe, data or data:N")
    else:
        raise NetworkRequestError("a NIC selector needs one of name, mac, pci or role")
    if not hits:
        have = ", ".join(f"{n.name} ({n.mac}{', ' + n.pci if n.pci else ''})" for n in nics)
        raise NetworkRequestError(f"no NIC matches {dict(sel)}; this machine has {have or 'none'}")
    return hits[0]


def _claim(r: _Render, nic: NicInfo, user: str) -> None:
    if nic.mac in r.used:
        raise NetworkRequestError(
            f"NIC {nic.name} ({nic.mac}) is used twice: by {r.used[nic.mac]} and by {user}"
        )
    r.used[nic.mac] = user


def _ethernet(r: _Render, nic: NicInfo) -> str:
    eid = nic.name
    r.out.setdefault("ethernets", {})[eid] = {
        "match": {"macaddress": nic.mac},
        "set-name": nic.name,
    }
    return eid


def _pool(r: _Render, name: str) -> Pool:
    pool = r.pools.get(name)
    if pool is None:
        raise NetworkRequestError(
            f"no network {name!r} in metald's pools; ask for one of: "
            + (", ".join(sorted(r.pools)) or "(none configured)")
        )
    return pool


def _default(pool: Pool) -> str:
    """The default route's destination, spelled so cloud-init 22.4 (Debian 12) parses it too:
    its network-state parser refuses netplan's ``default`` keyword."""
    return "0.0.0.0/0" if pool.network.version == 4 else "::/0"


def _addressing(r: _Render, iface: str, spec: Mapping[str, Any], conf: dict[str, Any]) -> None:
    """DHCP, a pool address, MTU and routes onto one netplan interface."""
    if spec.get("dhcp4"):
        conf["dhcp4"] = True
    mtu = spec.get("mtu")
    net = spec.get("network")
    if net:
        pool = _pool(r, str(net))
        addr = r.allocate(pool.name, iface)
        conf["addresses"] = [f"{addr}/{pool.network.prefixlen}"]
        if pool.gateway and spec.get("default_route", False):
            conf.setdefault("routes", []).append({"to": _default(pool), "via": pool.gateway})
        mtu = mtu or pool.mtu
        r.dns_pools.append(pool)
    if mtu:
        conf["mtu"] = int(mtu)
    for rt in spec.get("routes") or []:
        route: dict[str, Any] = {"to": str(rt["to"]), "via": str(rt["via"])}
        if rt.get("metric") is not None:
            route["metric"] = int(rt["metric"])
        conf.setdefault("routes", []).append(route)


def render(
    request: Mapping[str, Any] | None,
    nics: list[NicInfo],
    pools: Mapping[str, Pool],
    allocate: Callable[[str, str], str],
) -> dict[str, Any]:
    """The network-config (v2) for one machine."""
    r = _Render(nics, pools, allocate)
    pxe = next((n for n in nics if n.pxe), None)
    if not request:
        if pxe:
            r.out["ethernets"] = {
                "pxe0": {"match": {"macaddress": pxe.mac}, "set-name": "pxe0", "dhcp4": True}
            }
        else:
            r.out["ethernets"] = {}
        return r.out
    for e in request.get("ethernets") or []:
        nic = select_nic(e["nic"], nics)
        _claim(r, nic, f"ethernet {nic.name}")
        eid = _ethernet(r, nic)
        _addressing(r, eid, e, r.out["ethernets"][eid])
    for b in request.get("bonds") or []:
        name = str(b["name"])
        mode = str(b.get("mode", "802.3ad"))
        if mode not in BOND_MODES:
            raise NetworkRequestError(f"bond {name}: mode {mode!r}; use one of {BOND_MODES}")
        members = []
        for sel in b.get("nics") or []:
            nic = select_nic(sel, nics)
            _claim(r, nic, f"bond {name}")
            members.append(_ethernet(r, nic))
        if len(members) < 2:
            raise NetworkRequestError(f"bond {name} needs at least two NICs, got {len(members)}")
        params: dict[str, Any] = {"mode": mode, "mii-monitor-interval": 100}
        if mode == "802.3ad":
            params["lacp-rate"] = "fast"
            params["transmit-hash-policy"] = "layer3+4"
        else:
            params["primary"] = members[0]
        conf: dict[str, Any] = {"interfaces": members, "parameters": params}
        _addressing(r, name, b, conf)
        if "mtu" in conf:  # members carry the bond's MTU too
            for m in members:
                r.out["ethernets"][m]["mtu"] = conf["mtu"]
        r.out.setdefault("bonds", {})[name] = conf
    for v in request.get("vlans") or []:
        link = str(v["link"])
        if link not in r.out.get("bonds", {}) and link not in r.out.get("ethernets", {}):
            nic = select_nic(link, nics)
            if nic.mac not in r.used:
                _claim(r, nic, f"vlan link {nic.name}")
            link = nic.name if nic.name in r.out.get("ethernets", {}) else _ethernet(r, nic)
        vid = v.get("id")
        if vid is None and v.get("network"):
            vid = _pool(r, str(v["network"])).vlan
        if vid is None:
            raise NetworkRequestError(f"vlan on {link}: no id, and its network has no vlan")
        name = str(v.get("name") or f"{link}.{int(vid)}")
        conf = {"id": int(vid), "link": link}
        _addressing(r, name, v, conf)
        r.out.setdefault("vlans", {})[name] = conf
    rails = request.get("rails")
    if rails:
        _rails(r, rails)
    if pxe and pxe.mac not in r.used and request.get("pxe_dhcp", True):
        r.out.setdefault("ethernets", {})["pxe0"] = {
            "match": {"macaddress": pxe.mac},
            "set-name": "pxe0",
            "dhcp4": True,
        }
    _dns(r, request.get("dns"))
    return r.out


def _rails(r: _Render, rails: Mapping[str, Any]) -> None:
    nets = [str(n) for n in rails.get("networks") or []]
    sels = rails.get("nics")
    if sels:
        chosen = [select_nic(s, r.nics) for s in sels]
    else:  # every data NIC the rest of the request left free, in PCI order
        chosen = [n for n in _data_nics(r.nics) if n.mac not in r.used]
    if len(chosen) < len(nets):
        raise NetworkRequestError(
            f"rails: {len(nets)} rail networks but only {len(chosen)} NICs for them "
            f"({', '.join(n.name for n in chosen) or 'none'})"
        )
    for i, net in enumerate(nets):
        nic = chosen[i]
        _claim(r, nic, f"rail {i}")
        eid = _ethernet(r, nic)
        conf = r.out["ethernets"][eid]
        pool = _pool(r, net)
        addr = r.allocate(pool.name, eid)
        table = RAIL_TABLE_BASE + i
        conf["addresses"] = [f"{addr}/{pool.network.prefixlen}"]
        mtu = rails.get("mtu") or pool.mtu
        if mtu:
            conf["mtu"] = int(mtu)
        routes: list[dict[str, Any]] = [{"to": str(pool.network), "scope": "link", "table": table}]
        if pool.gateway:
            routes.append({"to": _default(pool), "via": pool.gateway, "table": table})
        conf["routes"] = routes
        conf["routing-policy"] = [{"from": addr, "table": table}]


def _dns(r: _Render, dns: Mapping[str, Any] | None) -> None:
    servers = list((dns or {}).get("nameservers") or [])
    search = list((dns or {}).get("search") or [])
    if not servers:
        for p in r.dns_pools:
            servers += [s for s in p.dns if s not in servers]
            search += [s for s in p.search if s not in search]
    if not servers and not search:
        return
    # netplan has no global DNS: the first statically addressed interface carries it.
    for kind in ("bonds", "vlans", "ethernets"):
        for conf in r.out.get(kind, {}).values():
            if "addresses" in conf:
                ns: dict[str, Any] = {}
                if servers:
                    ns["addresses"] = servers
                if search:
                    ns["search"] = search
                conf["nameservers"] = ns
                return
