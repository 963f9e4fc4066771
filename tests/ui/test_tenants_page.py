"""The tenants page reads hubs, peers and nodes of every listed tenant in three statements
(not one hub call and one machines call per tenant), with the API's hub fields and the
caller's scope."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import select

from api.routes_tenants import _hub_out
from metald.auth import authenticate
from metald.config import Config
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Tenant, WgPeer
from metald.tenants import clusters
from metald.usecases.console import tenant_details
from tests.conftest import seed
from tests.ui.conftest import serve


@contextmanager
def statements() -> Iterator[list[str]]:
    seen: list[str] = []

    def count(_conn, _cursor, sql, *_a) -> None:  # type: ignore[no-untyped-def]
        seen.append(sql)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", count)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the SQL is portable
def test_hubs_peers_and_nodes_of_all_tenants_in_three_statements(cfg: Config, store: Store) -> None:
    tokens = seed(store)
    box = SecretBox.from_file(cfg.secrets_key_path)
    with store.session() as s:
        extra = [
            clusters.add_tenant(
                s,
                name=f"t{i}",
                cluster_kind="slurm",
                control_plane=None,
                vlan_range=(100, 4000),
                actor="test",
            )
            for i in range(6)
        ]
        for i, tid in enumerate([tokens.tenant_a, tokens.tenant_b, *(t.id for t in extra)]):
            clusters.setup_hub(s, box, tid, endpoint_host=f"192.0.2.{i + 1}")
        s.add(
            WgPeer(
                tenant_id=tokens.tenant_a,
                machine_id=tokens.machine_a,
                public_key="cGVlcg==",
                address="10.0.0.9",
            )
        )
        s.commit()
        ids = [t.id for t in s.exec(select(Tenant))]
        admin = authenticate(s, tokens.admin)
        orch = authenticate(s, tokens.orchestrator)
        assert admin is not None and orch is not None
        with statements() as seen:
            d = tenant_details(s, admin, ids)
        assert len(seen) == 3, seen
        for tid in ids:
            api = _hub_out(s, s.get(Tenant, tid))
            hub = d.hubs[tid]
            assert (hub["ifname"], hub["endpoint"], hub["address"]) == (
                api.ifname,
                api.endpoint,
                api.address,
            )
            assert [(p["machine_id"], p["address"]) for p in hub["peers"]] == [
                (p.machine_id, p.address) for p in api.peers
            ]
            assert "private_key_enc" not in hub
        assert [n["id"] for n in d.nodes[tokens.tenant_a]] == [tokens.machine_a]
        assert [n["id"] for n in d.nodes[tokens.tenant_b]] == [tokens.machine_b]
        # An orchestrator's nodes are only its tenants' machines, whatever ids it passes.
        mine = tenant_details(s, orch, ids)
        assert set(mine.nodes) == {tokens.tenant_a}


def test_the_tenants_page_costs_the_same_with_more_tenants(tmp_path: Path) -> None:
    """The page's statements do not grow with the number of tenants (it was one hub call and
    one machines call per tenant)."""
    with serve(tmp_path, None) as app:
        assert app.tokens is not None
        http = requests.Session()
        r = http.post(
            app.base + "/ui/login", data={"token": app.tokens.admin}, allow_redirects=False
        )
        assert r.status_code == 303, r.text

        def cost() -> int:
            with statements() as seen:
                r = http.get(app.base + "/ui/tenants", timeout=10)
            assert r.status_code == 200, r.text
            return len(seen)

        cost()  # the first request warms caches
        before = cost()
        box = SecretBox.from_file(app.tmp_path / "state" / "secrets.key")
        with app.store.session() as s:
            for i in range(5):
                t = clusters.add_tenant(
                    s,
                    name=f"more{i}",
                    cluster_kind="slurm",
                    control_plane=None,
                    vlan_range=(100, 4000),
                    actor="test",
                )
                clusters.setup_hub(s, box, t.id, endpoint_host=f"192.0.2.{50 + i}")
        page = http.get(app.base + "/ui/tenants", timeout=10).text
        assert all(f"more{i}" in page for i in range(5))
        assert cost() == before
