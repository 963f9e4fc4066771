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
