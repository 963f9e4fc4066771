"""Prometheus metrics. One registry per daemon process; every module registers on it here.

Modules create their collectors at import time against ``REGISTRY`` (counters such as
``metald_dhcp_packets_dropped_total{reason=...}``); ``/metrics`` renders it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)

api_requests = Counter(
    "metald_api_requests_total",
    "HTTP API requests",
    ["method", "route", "status"],
    registry=REGISTRY,
)
api_latency = Histogram(
    "metald_api_request_seconds", "HTTP API request latency", ["route"], registry=REGISTRY
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


def render() -> bytes:
    return generate_latest(REGISTRY)
