"""Boot-plane counters on metald's one registry (rendered at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter

from metald.metrics import REGISTRY

dhcp_packets = Counter(
    "metald_dhcp_packets_total",
    "DHCP packets received, by message type",
    ["type"],
    registry=REGISTRY,
)
dhcp_replies = Counter(
    "metald_dhcp_replies_total", "DHCP replies sent, by message type", ["type"], registry=REGISTRY
)
dhcp_dropped = Counter(
    "metald_dhcp_dropped_total",
    "DHCP packets dropped as malformed or unanswerable, by reason",
    ["reason"],
    registry=REGISTRY,
)
dhcp_ignored = Counter(
    "metald_dhcp_ignored_total",
    "Well-formed DHCP packets deliberately not answered, by reason",
    ["reason"],
    registry=REGISTRY,
)
tftp_transfers = Counter(
    "metald_tftp_transfers_total", "TFTP transfers, by result", ["result"], registry=REGISTRY
)
tftp_dropped = Counter(
    "metald_tftp_dropped_total", "TFTP packets dropped, by reason", ["reason"], registry=REGISTRY
)
ra_sent = Counter(
    "metald_ra_sent_total", "IPv6 Router Advertisements sent", ["trigger"], registry=REGISTRY
)
http_boot = Counter(
    "metald_http_boot_scripts_total",
    "iPXE scripts served, by action",
    ["action"],
    registry=REGISTRY,
)


_children: dict[tuple[int, str], object] = {}


def inc(counter: Counter, label: str) -> None:
    """``counter.labels(label).inc()`` with the child cached: labels() costs several
    microseconds a call, which the DHCP hot path pays a few times per packet."""
    child = _children.get((id(counter), label))
    if child is None:
        child = _children[(id(counter), label)] = counter.labels(label)
    child.inc()  # type: ignore[attr-defined]


def _initialise() -> None:
    """Create the children whose label values are known in advance, at zero: a counter that
    has never moved is then a series (rate() is 0, not absent), which is what dashboards and
    alert rules expect, and a typo in a query shows up as a missing series."""
    from metald.boot.hooks import BootAction

    # RFC 2132 message types, lower-cased as the DHCP server labels them (that module imports
    # this one, so the names are spelled here).
    for name in ("discover", "offer", "request", "decline", "ack", "nak", "release", "inform"):
        dhcp_packets.labels(name)
        dhcp_replies.labels(name)
    for action in BootAction:
        http_boot.labels(action.value)
    http_boot.labels("refused")
    for result in ("ok", "timeout"):
        tftp_transfers.labels(result)
    # The reasons a storm shows first (metald.boot.dhcp.server): none of them means a bug.
    for reason in ("not-a-request", "no-network", "send-queue-full"):
        dhcp_dropped.labels(reason)
    for reason in ("hook-backlog", "lease-conflict"):
        dhcp_ignored.labels(reason)
    # No "unknown-tid": a transfer's socket is connected to its client, so a packet from
    # anywhere else is refused by the kernel (Udp NoPorts), never read.
    tftp_dropped.labels("repeated-request")
    for trigger in ("periodic", "solicited"):
        ra_sent.labels(trigger)


_initialise()
