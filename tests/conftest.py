"""Shared fixtures: both database backends, a configured app, and tokens for every role."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from metald.config import Config, load_config
from metald.secrets import SecretBox
from metald.store import Store
from vmlab.pg import PgServer, pg_bindir

IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    if pg_bindir() is None:
        pytest.fail("PostgreSQL is not installed; run scripts/bootstrap (make test does)")
    server = PgServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database migrated to head, made once a session (WAL folded in at close)."""
    path = tmp_path_factory.mktemp("db-template") / "metald.db"
    s = Store(f"sqlite:///{path}")
    try:
        s.migrate()
    finally:
        s.close()
    return path


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database on each backend, already migrated to head: a copy of one migrated
    database per session (running all migrations for every test cost more than most tests).
    A test marked ``empty_db`` gets an empty one (tests of the migrations themselves). A
    PostgreSQL one is dropped after its test (a thousand left behind made the session's end
    remove ~10 GB at once)."""
    empty = request.node.get_closest_marker("empty_db") is not None
    if request.param == "sqlite":
        path = tmp_path / "metald.db"
        if not empty:
            shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        yield f"sqlite:///{path}"
        return
    server = request.getfixturevalue("pg_server")
    url = server.new_database(template=None if empty else server.migrated_template())
    yield url
    server.drop_database(url)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    s.migrate()
    try:
        yield s
    finally:
        s.close()


#: The tests' simulated BMCs (ipmi_sim, sushy-emulator, fakes) listen on loopback: their
#: configs allow it explicitly ([bmc] networks, docs/security.md); the default refuses it.
LAB_BMC_NETWORKS = ["127.0.0.0/8", "0.0.0.0/0", "::/0"]
LAB_BMC_ENV = {
    "METALD_BMC__NETWORKS": '["127.0.0.0/8", "0.0.0.0/0", "::/0"]',
    "METALD_BMC__VERIFY_S": "5",
}
LAB_BMC_TOML = 'networks = ["127.0.0.0/8", "0.0.0.0/0", "::/0"]\n'


@pytest.fixture
def cfg(tmp_path: Path, db_url: str) -> Config:
    return load_config(
        None,
        environ={
            "METALD_STATE_DIR": str(tmp_path / "state"),
            "METALD_STORE__URL": db_url,
            **LAB_BMC_ENV,
        },
    )


@dataclass
class Tokens:
    admin: str
    technician: str
    orchestrator: str
    orchestrator_other: str
    agent: str
    tenant_a: str
    tenant_b: str
    machine_a: str  # allocated to tenant A
    machine_b: str  # allocated to tenant B
    machine_free: str  # ready, unallocated

    def header(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {getattr(self, role)}"}


def seed(store: Store) -> Tokens:
    """Two tenants, three machines (A's, B's, free) and one token per role and scope."""
    from metald import machines
    from metald.auth import issue_token
    from metald.lifecycle import Trigger
    from metald.store.models import Tenant

    with store.session() as s:
        ta, tb = Tenant(name="acme"), Tenant(name="globex")
        s.add(ta)
        s.add(tb)
        s.commit()
        ids = []
        for i, tenant in enumerate([ta, tb, None]):
            m = machines.create_machine(
                s, macs=[f"52:54:00:00:00:{i + 1:02x}"], actor="test", name=f"node{i}"
            )
            machines.transition(s, m.id, Trigger.INSPECT, actor="test")
            machines.transition(
                s,
                m.id,
                Trigger.INSPECTED,
                actor="test",
                updates={
                    "inventory": {"schema_version": 1},
                    "gpu_model": "NVIDIA H100 80GB HBM3",
                    "gpu_count": 8 - i,
                },
            )
            if tenant is not None:
                machines.transition(
                    s, m.id, Trigger.CLAIM, actor="test", updates={"tenant_id": tenant.id}
                )
            ids.append(m.id)
        toks = {}
        for role, scope in [
            ("admin", []),
            ("technician", []),
            ("orchestrator", [ta.id]),
            ("orchestrator_other", [tb.id]),
            ("agent", [ids[0]]),
        ]:
            _row, secret = issue_token(
                s, name=role.replace("_", "-"), role=role.split("_")[0], scope=scope
            )
            toks[role] = secret
        return Tokens(
            **toks,
            tenant_a=ta.id,
            tenant_b=tb.id,
            machine_a=ids[0],
            machine_b=ids[1],
            machine_free=ids[2],
        )


@pytest.fixture
async def api(cfg: Config, store: Store, aiohttp_client):  # type: ignore[no-untyped-def]
    """(client, tokens, store) for an app on each backend."""
    from api.app import create_app
    from api.context import AppContext
    from metald.events import EventBus

    ctx = AppContext(
        cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path), bus=EventBus()
    )
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    return client, tokens, store


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IS_ROOT:
        return
    skip = pytest.mark.skip(
        reason="needs root (network namespaces, tap devices, QEMU); CI runs as root"
    )
    for item in items:
        if "root" in item.keywords or "lab" in item.keywords:
            item.add_marker(skip)
