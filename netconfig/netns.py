"""Network namespaces and veth pairs. Names are the caller's; nothing is guessed.

These run iproute2's ``ip`` rather than pyroute2's ``NetNS``/``netns.create``: pyroute2 forks
a helper process (without exec) per namespace and SIGTERMs it on close. A forked child shares
the asyncio loop's signal wake-up socket, so inside metald that SIGTERM reached the daemon's
loop as its own and stopped it. Netlink in the caller's own namespace (``IPRoute``) does not
fork and stays in pyroute2.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

NETNS_DIR = Path("/run/netns")


class NetnsError(Exception):
    pass


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def path(name: str) -> str:
    return str(NETNS_DIR / name)


def create(name: str) -> None:
    """Create the namespace with its loopback up."""
    _ip("netns", "add", name)
    _ip("-n", name, "link", "set", "lo", "up")


def delete(name: str) -> None:
    if os.path.exists(path(name)):
        _ip("netns", "delete", name)


def exists(name: str) -> bool:
    return os.path.exists(path(name))


def veth(a_ns: str, a_if: str, b_ns: str, b_if: str) -> None:
    """A veth pair with one end in each namespace (both down; see ``address``)."""
    _ip("link", "add", a_if, "netns", a_ns, "type", "veth", "peer", "name", b_if, "netns", b_ns)


def address(ns_name: str, ifname: str, cidr: str, *, up: bool = True) -> None:
    _ip("-n", ns_name, "addr", "add", cidr, "dev", ifname)
    if up:
        link_up(ns_name, ifname)


def link_up(ns_name: str, ifname: str) -> None:
    _ip("-n", ns_name, "link", "set", ifname, "up")


def exec_argv(name: str, argv: Sequence[str]) -> list[str]:
    """argv that runs ``argv`` inside the namespace.

    nsenter changes only the network namespace; unlike ``ip netns exec`` it does not remount
    /sys, which some daemons (slurmd) do not survive.
    """
    return ["nsenter", f"--net={path(name)}", "--", *argv]


def run(name: str, *argv: str) -> None:
    """Run ``argv`` inside the namespace and wait for it; NetnsError with its stderr if it
    fails."""
    r = subprocess.run(exec_argv(name, argv), capture_output=True, text=True)
    if r.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} in {name}: {r.stderr.strip()}")


def enable_forwarding(name: str) -> None:
    """Let the namespace route IPv4 between its interfaces."""
    run(name, "sysctl", "-qw", "net.ipv4.ip_forward=1")


def pid_exec_argv(pid: int, argv: Sequence[str]) -> list[str]:
    """argv that runs ``argv`` in the mount, network and UTS namespaces of process ``pid`` (a
    simulated machine started with ``exec_argv(name, ["unshare", ...])``)."""
    return ["nsenter", "-t", str(pid), "-m", "-n", "-u", "--", *argv]


#: Shell lines that remove namespace ``$NS`` and host link ``$VETH``, quietly, for a script that
#: must not import anything (a reaper that outlives its Python process).
TEARDOWN_SH = 'ip netns delete "$NS" 2>/dev/null\nip link del "$VETH" 2>/dev/null\n'


def links(ns_name: str) -> list[str]:
    out = _ip("-n", ns_name, "-o", "link", "show")
    # "2: uh0@if5: <...>" -> "uh0"
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
