"""A database network of namespaces, and nftables cuts on it: for the Patroni lab's network-cut
variant (tests/fleet/patroni_lab.py, tests/fleet/pg_failover.py) and its fast test
(tests/fleet/test_netcut.py).

``DbNet`` makes a switch namespace holding a bridge, one namespace per host on it (a veth each,
an address in a private /24), and a veth from the caller's namespace to the bridge (the
"ctl" address) so the test process reaches every host. Nothing is routed out: there is no
default route anywhere, and the only addresses are the /24's. Deleting the switch namespace
removes the bridge and the caller's end of its veth with it; every namespace made is listed in
``names`` (and appended to ``record``, a file the Patroni lab's watchdog reads, so they are
deleted even when the caller is killed).

``cut_ruleset`` is what a cut is: an nftables table in the victim's namespace whose input and
output chains drop every packet that is not loopback (or from/to an address in ``allow``: a
partial partition). Dropped, not rejected: connections hang as on a real cut, as
tests/fleet/test_partition.py does for one instance. Its counters say how many packets the
cut dropped each way. ``heal`` deletes the table.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from netconfig import netns

TABLE = "metald_cut"


def cut_ruleset(allow: Sequence[IPv4Address | str] = (), table: str = TABLE) -> str:
    """The nftables script that cuts a namespace off: everything in and out is dropped but
    loopback and, if given, the addresses in ``allow`` (either direction). Each direction's
    drops are counted (``counter``: ``nft -j list table inet TABLE``)."""
    allowed = sorted({str(IPv4Address(str(a))) for a in allow}, key=lambda a: IPv4Address(a))
    peers_in = f"        ip saddr {{ {', '.join(allowed)} }} accept\n" if allowed else ""
    peers_out = f"        ip daddr {{ {', '.join(allowed)} }} accept\n" if allowed else ""
    return (
        f"table inet {table} {{\n"
        "    chain input {\n"
        "        type filter hook input priority -300; policy accept;\n"
        '        iif "lo" accept\n'
        f"{peers_in}"
        "        counter drop\n"
        "    }\n"
        "    chain output {\n"
        "        type filter hook output priority -300; policy accept;\n"
        '        oif "lo" accept\n'
        f"{peers_out}"
        "        counter drop\n"
        "    }\n"
        "}\n"
    )


def nft(ns: str, script: str) -> None:
    r = subprocess.run(
        netns.exec_argv(ns, ["nft", "-f", "-"]), input=script, text=True, capture_output=True
    )
    if r.returncode != 0:
        raise netns.NetnsError(f"nft in {ns}: {r.stderr.strip()}\n{script}")


def cut(ns: str, allow: Sequence[IPv4Address | str] = (), table: str = TABLE) -> None:
    """Cut ``ns`` off (``cut_ruleset``); atomic: one nft transaction."""
    nft(ns, cut_ruleset(allow, table))


def heal(ns: str, table: str = TABLE) -> None:
    nft(ns, f"delete table inet {table}\n")


def dropped(ns: str, table: str = TABLE) -> dict[str, int]:
    """Packets the cut dropped so far: ``{"input": n, "output": n}``."""
    out = subprocess.run(
        netns.exec_argv(ns, ["nft", "-j", "list", "table", "inet", table]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: dict[str, int] = {}
    for item in json.loads(out)["nftables"]:
        rule = item.get("rule")
        if rule is None:
            continue
        for expr in rule["expr"]:
            if "counter" in expr:
                counts[rule["chain"]] = int(expr["counter"]["packets"])
    return counts


class DbNet:
    """The switch, the hosts, the caller's leg: see the module's docstring. ``add(name)`` makes a
    host; ``close()`` deletes every namespace made (the caller's veth goes with the switch)."""

    def __init__(self, tag: str | None = None, record: Path | None = None) -> None:
        pid = os.getpid()
        self.tag = tag or f"{pid % 100000}"
        # A /24 per process (10.214.0.0/16): two runs at once do not share addresses.
        self.net = IPv4Network(f"10.214.{pid % 250}.0/24")
        self.ctl = self.net[1]
        self.record = record
        self.names: list[str] = []
        self.hosts: dict[str, tuple[str, IPv4Address]] = {}
        self.switch = self._ns("sw")
        self.ctl_if = f"mdb{self.tag}"[:15]
        try:
            # iproute2, not pyroute2: this runs inside the tests' event loop too.
            self._ip(self.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0",
                     "stp_state", "0")  # fmt: skip
            self._ip(self.switch, "link", "set", "br0", "up")
            subprocess.run(
                ["ip", "link", "add", self.ctl_if, "type", "veth", "peer", "name", "ctl",
                 "netns", self.switch],
                check=True, capture_output=True,
            )  # fmt: skip
            subprocess.run(
                ["ip", "addr", "add", f"{self.ctl}/{self.net.prefixlen}", "dev", self.ctl_if],
                check=True, capture_output=True,
            )  # fmt: skip
            subprocess.run(["ip", "link", "set", self.ctl_if, "up"], check=True)
            self._ip(self.switch, "link", "set", "ctl", "master", "br0", "up")
        except BaseException:
            self.close()
            raise

    def namespace(self, role: str) -> str:
        """A namespace of the lab not on the bridge (say, a client side behind a host)."""
        return self._ns(role)

    def _ns(self, role: str) -> str:
        name = f"mdb{self.tag}{role}"
        if self.record is not None:  # first: a kill between the two still deletes it
            with open(self.record, "a") as f:
                f.write(name + "\n")
        netns.create(name)
        self.names.append(name)
        return name

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True)

    def add(self, name: str, host: int) -> tuple[str, IPv4Address]:
        """A host namespace ``name`` at the /24's address ``host`` on the bridge: (ns, ip)."""
        ns = self._ns(name)
        ip = self.net[host]
        netns.veth(self.switch, f"p{name}"[:15], ns, "eth0")
        self._ip(self.switch, "link", "set", f"p{name}"[:15], "master", "br0", "up")
        netns.address(ns, "eth0", f"{ip}/{self.net.prefixlen}")
        self.hosts[name] = (ns, ip)
        return ns, ip

    def ns(self, name: str) -> str:
        return self.hosts[name][0]

    def ip(self, name: str) -> IPv4Address:
        return self.hosts[name][1]

    def close(self) -> None:
        for name in reversed(self.names):
            with contextlib.suppress(netns.NetnsError):
                netns.delete(name)
        self.names.clear()
        subprocess.run(["ip", "link", "del", self.ctl_if], capture_output=True)
