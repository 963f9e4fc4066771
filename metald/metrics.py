"""Prometheus metrics. One registry per daemon process; every module registers on it here.

Modules create their collectors at import time against ``REGISTRY`` (counters such as
``metald_dhcp_packets_dropped_total{reason=...}``); ``/metrics`` renders it.

Three kinds live here:

- counters and histograms the code keeps up to date as things happen (requests, transitions,
  phase durations);
- gauges of what the store holds (machines by state, leases per network, claims, BMC health,
  hub handshakes, instance heartbeats, event rows). They are refreshed at scrape time from one
  query each (``metald.usecases.gauges``), so they cost nothing between scrapes and every instance sharing
  one database reports the same numbers (aggregate them with ``max``, not ``sum``);
- the process and platform collectors of prometheus_client and ``metald_build_info``.

The ``route`` label is the same on every request metric: the route's OpenAPI path template
(``/api/v1/machines/{id}``), never the raw path, so its cardinality is the number of routes.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from metald import __version__

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

build_info = Info("metald_build", "metald's version and the Python it runs on", registry=REGISTRY)
build_info.info({"version": __version__, "python": platform.python_version()})

api_requests = Counter(
    "metald_api_requests_total",
    "HTTP API requests",
    ["method", "route", "status"],
    registry=REGISTRY,
)
api_latency = Histogram(
    "metald_api_request_seconds",
    "HTTP API request latency",
    ["method", "route"],
    registry=REGISTRY,
)
machines_by_state = Gauge(
    "metald_machines", "Machines by lifecycle state", ["state"], registry=REGISTRY
)
transitions = Counter(
    "metald_machine_transitions_total",
    "Lifecycle transitions applied",
    ["trigger"],
    registry=REGISTRY,
)
#: How long a machine spent in a working phase (inspecting, provisioning, wiping, ...), by the
#: state it went to (``outcome``): observed when the machine leaves the phase.
phase_seconds = Histogram(
    "metald_machine_phase_seconds",
    "Time machines spent in a working state, observed when they leave it",
    ["phase", "outcome"],
    buckets=(5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, float("inf")),
    registry=REGISTRY,
)
#: The states whose duration ``phase_seconds`` records.
TIMED_PHASES = frozenset({"inspecting", "provisioning", "joining", "releasing", "wiping"})

dhcp_pool_size = Gauge(
    "metald_dhcp_pool_addresses",
    "Addresses in each provisioning network's dynamic pool",
    ["network"],
    registry=REGISTRY,
)
dhcp_pool_used = Gauge(
    "metald_dhcp_pool_used",
    "Addresses of each network's pool held by an unexpired offered or bound lease",
    ["network"],
    registry=REGISTRY,
)
claims_by_state = Gauge("metald_claims", "Claims by state", ["state"], registry=REGISTRY)
bmcs_by_health = Gauge("metald_bmcs", "BMCs by health", ["health"], registry=REGISTRY)
hub_peers = Gauge(
    "metald_hub_peers", "Nodes on each tenant's WireGuard hub", ["tenant"], registry=REGISTRY
)
hub_handshake_age = Gauge(
    "metald_hub_handshake_age_seconds",
    "Age of the stalest peer handshake on each tenant's hub (peers that never shook hands "
    "are counted in metald_hub_peers_without_handshake)",
    ["tenant"],
    registry=REGISTRY,
)
hub_peers_silent = Gauge(
    "metald_hub_peers_without_handshake",
    "Nodes on each tenant's hub that have never completed a handshake",
    ["tenant"],
    registry=REGISTRY,
)
event_rows = Gauge(
    "metald_event_rows",
    "Rows in the event log (span of its ids: the log is append-only and pruned oldest first)",
    registry=REGISTRY,
)
instance_heartbeat_age = Gauge(
    "metald_instance_heartbeat_age_seconds",
    "Seconds since each running fleet instance last wrote its heartbeat (database clock)",
    ["instance"],
    registry=REGISTRY,
)
machine_pushes = Counter(
    "metald_machine_pushes_total",
    "Requests a machine sent on its own (a BMC's pushed event, a node's report), by outcome: "
    "accepted, refused (secret or token), limited-key / limited-source / limited-total (429)",
    ["route", "outcome"],
    registry=REGISTRY,
)
scrape_errors = Counter(
    "metald_scrape_errors_total",
    "Scrapes whose store gauges could not be refreshed (the gauges keep their last values)",
    registry=REGISTRY,
)


def _initialise_transitions() -> None:
    from metald.lifecycle import Trigger

    for trigger in Trigger:
        transitions.labels(trigger.value)


_initialise_transitions()

CLAIM_STATES = ("pending", "allocated", "released", "failed")
BMC_HEALTH = ("ok", "auth-failed", "unreachable", "error", "unknown")


def observe_phase(src: str, dst: str, seconds: float) -> None:
    """A machine left ``src`` for ``dst`` after ``seconds`` there (timed phases only)."""
    if src in TIMED_PHASES and src != dst:
        phase_seconds.labels(src, dst).observe(max(seconds, 0.0))


def set_counts(
    gauge: Gauge, counts: Mapping[str, float], known: Iterable[str] = (), *, clear: bool = True
) -> None:
    """Set a one-label gauge from ``counts``: every ``known`` value is present (0 when absent),
    and with ``clear`` a value that disappeared (a removed network, a deleted tenant) goes too."""
    if clear:
        gauge.clear()
    for key in known:
        gauge.labels(key).set(counts.get(key, 0))
    for key, value in counts.items():
        gauge.labels(key).set(value)


def render() -> bytes:
    return generate_latest(REGISTRY)
