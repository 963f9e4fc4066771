"""The lab's plan: names, addresses, MACs and ports, computed from the lab's name and slot.

Pure functions, no I/O. A slot ``k`` (1..250) is unique among the labs running on a host; it
makes every interface name, subnet and MAC of one lab distinct from every other lab's, so two
labs never collide even if they are later joined by veth pairs.

Address plan of slot k (one /16 per lab, of which the first /24 is the boot network):
  10.k.0.1        metald's boot plane (DHCP/TFTP/HTTP), on the lab bridge
  10.k.0.2-99     virtual BMCs, one per machine, extra addresses on the same bridge
  10.k.0.100-239  left to metald's DHCP for the machines
  10.k.0.240-254  namespaces attached to the lab (tenant control planes, WireGuard hubs, ...)
  10.k.1.0/24 ... free for later networks of the lab (tenant control planes, ...)

Machines with more than one NIC have the others on a second bridge, the lab's data network
(``data_bridge_name``), which holds no address of the lab's.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

NETNS_PREFIX = "mlab-"
MAX_SLOT = 250
MAX_MACHINES = 98  # BMC addresses .2 to .99
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
IPMI_PORT = 623
REDFISH_PORT = 8000


class PlanError(ValueError):
    """The requested lab cannot be laid out (bad name, too many machines, ...)."""


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise PlanError(
            f"lab name {name!r} must be 1-31 characters of a-z, 0-9 and '-', "
            "starting with a letter or digit"
        )
    return name


def netns_name(name: str) -> str:
    return NETNS_PREFIX + check_name(name)


def bridge_name(slot: int) -> str:
    # Interface names must be unique host-wide and at most 15 characters: "mlab250br" is 9.
    return f"mlab{slot}br"


def tap_name(slot: int, index: int) -> str:
    return f"mlab{slot}t{index}"  # at most "mlab250t97" (10 characters)


#: NICs a machine may have beyond its boot NIC (``nic_tap_name``'s last digit).
MAX_EXTRA_NICS = 9


def data_bridge_name(slot: int) -> str:
    """The lab's data network: a second bridge, with no address of the lab's, that the
    machines' further NICs sit on (a tenant's bond, VLANs and static addresses live there)."""
    return f"mlab{slot}db"  # at most "mlab250db" (9 characters)


def nic_tap_name(slot: int, index: int, nic: int) -> str:
    """Machine ``index``'s NIC number ``nic`` (1..9; 0 is the boot NIC, ``tap_name``)."""
    if not 1 <= nic <= MAX_EXTRA_NICS:
        raise PlanError(f"NIC {nic} outside 1..{MAX_EXTRA_NICS}")
    return f"mlab{slot}t{index}n{nic}"  # at most "mlab250t97n9" (12 characters)


def nic_mac(slot: int, index: int, nic: int) -> str:
    """The MAC of machine ``index``'s NIC ``nic`` (0: the boot NIC, ``machine_mac``)."""
    if not 0 <= nic <= MAX_EXTRA_NICS:
        raise PlanError(f"NIC {nic} outside 0..{MAX_EXTRA_NICS}")
    return f"52:54:00:{0x6C + nic:02x}:{slot:02x}:{index:02x}"


def subnet(slot: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"10.{slot}.0.0/24")


def lab_supernet(slot: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"10.{slot}.0.0/16")


def boot_address(slot: int) -> ipaddress.IPv4Address:
    return subnet(slot).network_address + 1


def bmc_address(slot: int, index: int) -> ipaddress.IPv4Address:
    if not 0 <= index < MAX_MACHINES:
        raise PlanError(f"machine index {index} outside 0..{MAX_MACHINES - 1}")
    return subnet(slot).network_address + 2 + index


def dhcp_range(slot: int) -> tuple[ipaddress.IPv4Address, ipaddress.IPv4Address]:
    base = subnet(slot).network_address
    return base + 100, base + 239


MAX_ATTACHED = 15  # addresses .240 to .254
SUFFIX_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,19}$")


def attached_netns_name(name: str, suffix: str) -> str:
    """``mlab-<lab>+<suffix>``: '+' cannot occur in a lab name, so the owner is unambiguous."""
    if not SUFFIX_RE.match(suffix):
        raise PlanError(f"namespace suffix {suffix!r} must be 1-20 characters of a-z, 0-9, '-'")
    return f"{netns_name(name)}+{suffix}"


def lab_of_netns(ns: str) -> str | None:
    """The lab a namespace belongs to (its own or an attached one), or None."""
    if not ns.startswith(NETNS_PREFIX):
        return None
    name = ns[len(NETNS_PREFIX) :].partition("+")[0]
    return name if NAME_RE.match(name) else None


def attached_veth_names(slot: int, index: int) -> tuple[str, str]:
    """(end on the lab bridge, end inside the attached namespace)."""
    return f"mlab{slot}v{index}", f"mlab{slot}p{index}"


def attached_address(slot: int, index: int) -> ipaddress.IPv4Address:
    if not 0 <= index < MAX_ATTACHED:
        raise PlanError(f"at most {MAX_ATTACHED} namespaces can be attached to a lab")
    return subnet(slot).network_address + 240 + index


def machine_mac(slot: int, index: int) -> str:
    # 52:54:00 is QEMU's prefix; slot and index make it unique across labs on the host.
    return nic_mac(slot, index, 0)


def machine_name(index: int) -> str:
    return f"m{index}"


@dataclass(frozen=True)
class MachinePlan:
    index: int
    name: str
    firmware: str  # "bios" or "uefi"
    tap: str
    mac: str
    bmc_address: str


def plan_machines(slot: int, machines: int, uefi: int) -> list[MachinePlan]:
    """Machines 0..N-1; the last ``uefi`` of them boot OVMF, the others SeaBIOS."""
    if not 1 <= slot <= MAX_SLOT:
        raise PlanError(f"slot {slot} outside 1..{MAX_SLOT}")
    if not 0 <= machines <= MAX_MACHINES:  # 0: the network alone
        raise PlanError(f"machines must be 0..{MAX_MACHINES}, not {machines}")
    if not 0 <= uefi <= machines:
        raise PlanError(f"uefi must be 0..{machines}, not {uefi}")
    return [
        MachinePlan(
            index=i,
            name=machine_name(i),
            firmware="uefi" if i >= machines - uefi else "bios",
            tap=tap_name(slot, i),
            mac=machine_mac(slot, i),
            bmc_address=str(bmc_address(slot, i)),
        )
        for i in range(machines)
    ]
