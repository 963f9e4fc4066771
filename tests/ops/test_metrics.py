"""/metrics: process and build collectors, the store gauges refreshed at scrape, and one
``route`` label (the OpenAPI template) on every request metric."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metald import metrics
from tests.api_helpers import live_api
from tests.ops.fleet_data import NETWORK, populate


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples, name: str, **labels: str) -> float:  # type: ignore[no-untyped-def]
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.mark.asyncio
async def test_store_gauges_process_and_build(aiohttp_client, store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The registry is the process's: count what this test adds.
    before = _samples(metrics.render().decode())
    phase_key = (
        "metald_machine_phase_seconds_count",
        (("outcome", "ready"), ("phase", "inspecting")),
    )
    live = await live_api(aiohttp_client, store, tmp_path)
    live.ctx.cfg.boot.networks = [NETWORK]
    populate(store, live.tokens)
    r = await live.client.get(
        f"/api/v1/machines/{live.tokens.machine_a}", headers=live.tokens.header("admin")
    )
    assert r.status == 200
    text = await (await live.client.get("/metrics")).text()
    s = _samples(text)

    assert (
        _value(
            s,
            "metald_build_info",
            version=__import__("metald").__version__,
            python=__import__("platform").python_version(),
        )
        == 1
    )
    assert _value(s, "process_resident_memory_bytes") > 0
    assert "python_info" in {k[0] for k in s}
    assert _value(s, "metald_machines", state="claimed") == 2
    assert _value(s, "metald_machines", state="wipe-failed") == 0
    # Three unexpired offered/bound leases inside the pool of 10: expired, released, outside
    # the pool and unconfigured networks do not count.
    assert _value(s, "metald_dhcp_pool_addresses", network="prov") == 10
    assert _value(s, "metald_dhcp_pool_used", network="prov") == 3
    assert ("metald_dhcp_pool_used", (("network", "gone"),)) not in s
    assert _value(s, "metald_bmcs", health="ok") == 2
    assert _value(s, "metald_bmcs", health="unreachable") == 1
    assert _value(s, "metald_bmcs", health="auth-failed") == 0
    assert _value(s, "metald_claims", state="allocated") == 1
    assert _value(s, "metald_hub_peers", tenant="acme") == 2
    assert _value(s, "metald_hub_peers_without_handshake", tenant="acme") == 1
    assert 85 <= _value(s, "metald_hub_handshake_age_seconds", tenant="acme") < 3600
    assert 25 <= _value(s, "metald_instance_heartbeat_age_seconds", instance="alive") < 3600
    assert ("metald_instance_heartbeat_age_seconds", (("instance", "stopped"),)) not in s
    assert _value(s, "metald_event_rows") >= 9  # seed: three machines, three transitions each
    # seed() took three machines through inspecting: the phase histogram saw them leave it.
    assert s[phase_key] - before.get(phase_key, 0) == 3


@pytest.mark.asyncio
async def test_route_label_is_the_template_on_every_request_metric(
    aiohttp_client, store, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    live = await live_api(aiohttp_client, store, tmp_path)
    for mid in (live.tokens.machine_a, live.tokens.machine_b):
        r = await live.client.get(f"/api/v1/machines/{mid}", headers=live.tokens.header("admin"))
        assert r.status == 200
    text = await (await live.client.get("/metrics")).text()
    routes: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.startswith("metald_api_"):
            for smp in fam.samples:
                if "route" in smp.labels:
                    routes.setdefault(smp.name, set()).add(smp.labels["route"])
                    assert not any(
                        m in smp.labels["route"]
                        for m in (live.tokens.machine_a, live.tokens.machine_b)
                    )
                    assert smp.labels["route"].startswith("/")
    assert {"metald_api_requests_total", "metald_api_request_seconds_count"} <= set(routes)
    # Every request metric names the same routes, in the same form.
    assert len({frozenset(v) for v in routes.values()}) == 1
    assert "/api/v1/machines/{id}" in routes["metald_api_request_seconds_count"]
