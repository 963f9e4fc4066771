"""Store behaviour on both backends: atomic transitions, racing writers, migrations."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlmodel import SQLModel, select

from metald import machines
from metald.errors import Conflict
from metald.lifecycle import State, Trigger
from metald.store import Store
from metald.store.db import current_revision, upgrade
from metald.store.models import Event, Machine


def test_migrations_match_models(store: Store) -> None:
    """The Alembic chain produces exactly the schema the models declare (no drift)."""
    with store.engine.connect() as conn:
        mc = MigrationContext.configure(conn, opts={"compare_type": False})
        diffs = compare_metadata(mc, SQLModel.metadata)
    assert diffs == []


def test_racing_writers_one_wins(store: Store) -> None:
    """Two writers read the same version and both try to move the machine: one wins, the
    other gets a conflict, and exactly one event is written."""
    with store.session() as s:
        m = machines.create_machine(s, macs=["02:00:00:00:01:01"], actor="t")
        machines.transition(s, m.id, Trigger.INSPECT, actor="t")
        machines.transition(s, m.id, Trigger.INSPECTED, actor="t")
        version = s.get(Machine, m.id).version  # type: ignore[union-attr]
    results: list[str] = []
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        with store.session() as s:
            barrier.wait()
            try:
                trig = Trigger.CLAIM if i % 2 else Trigger.MAINTENANCE_ON
                machines.transition(s, m.id, trig, actor=f"w{i}", expected_version=version)
                results.append("won")
            except Conflict:
                results.append("lost")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost"] * 7 + ["won"]
    with store.session() as s:
        row = s.get(Machine, m.id)
        assert row.version == version + 1  # type: ignore[union-attr]
        evs = s.exec(
            select(Event).where(Event.machine_id == m.id, Event.from_state == State.READY.value)
        ).all()
        assert len(evs) == 1 and evs[0].to_state == row.state  # type: ignore[union-attr]


def test_duplicate_mac_refused_and_nothing_written(store: Store) -> None:
    with store.session() as s:
        machines.create_machine(s, macs=["02:00:00:00:02:01"], actor="t")
        n = len(s.exec(select(Machine)).all())
        with pytest.raises(Conflict, match="already belongs"):
            machines.create_machine(s, macs=["02-00-00-00-02-01"], actor="t")
        s.rollback()
        assert len(s.exec(select(Machine)).all()) == n


@pytest.mark.empty_db
def test_upgrade_keeps_data(db_url: str) -> None:
    """A database created at revision 0001 and holding data upgrades to head intact."""
    store = Store(db_url)
    try:
        upgrade(store.engine, "0001")
        assert current_revision(store.engine) == "0001"
        with store.engine.begin() as c:
            c.execute(
                sa.text(
                    "INSERT INTO tenants (id, name, cluster_kind, created_at) VALUES ('t1', 'acme', 'slurm', CURRENT_TIMESTAMP)"
                )
            )
            c.execute(
                sa.text(
                    "INSERT INTO machines (id, name, state, version, labels, gpu_count, state_changed_at, created_at, updated_at, tenant_id) "
                    "VALUES ('m1', 'node1', 'active', 7, '{\"gpu\": \"h100\"}', 8, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 't1')"
                )
            )
            c.execute(
                sa.text(
                    "INSERT INTO nics (id, machine_id, mac, pxe) VALUES ('n1', 'm1', '02:00:00:00:03:01', true)"
                )
            )
            c.execute(
                sa.text(
                    "INSERT INTO events (at, kind, machine_id, actor, to_state) VALUES (CURRENT_TIMESTAMP, 'machine.created', 'm1', 'test', 'discovered')"
                )
            )
        store.migrate()
        assert current_revision(store.engine) != "0001"
        with store.session() as s:
            m = s.get(Machine, "m1")
            assert m is not None
            assert (m.name, m.state, m.version, m.labels, m.gpu_count, m.tenant_id) == (
                "node1",
                "active",
                7,
                {"gpu": "h100"},
                8,
                "t1",
            )
            assert m.rack_position is None  # column added by 0002
            assert machines.find_by_mac(s, "02:00:00:00:03:01").id == "m1"  # type: ignore[union-attr]
            ev = s.exec(select(Event)).one()
            assert (ev.kind, ev.instance) == ("machine.created", None)
            # And the upgraded database is fully usable.
            machines.transition(s, "m1", Trigger.RELEASE, actor="t")
    finally:
        store.close()


def test_sqlite_is_wal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = Store(f"sqlite:///{tmp_path / 'x.db'}")
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    store.close()


@pytest.mark.empty_db
def test_upgrade_gives_agent_tokens_their_machine(db_url: str) -> None:
    """0011 fills api_tokens.machine_id from an agent token's scope; revocation then finds the
    tokens issued before the upgrade."""
    from metald.auth import authenticate, hash_token, revoke_machine_tokens

    store = Store(db_url)
    try:
        upgrade(store.engine, "0010")
        with store.engine.begin() as c:
            for tid, role, scope, secret in (
                ("a1", "agent", '["m1"]', "mtd_agent-one"),
                ("a2", "agent", '["m2"]', "mtd_agent-two"),
                ("o1", "orchestrator", '["t1"]', "mtd_orch"),
            ):
                c.execute(
                    sa.text(
                        "INSERT INTO api_tokens (id, name, role, scope, token_hash, created_at) "
                        "VALUES (:id, :id, :role, :scope, :hash, CURRENT_TIMESTAMP)"
                    ),
                    {"id": tid, "role": role, "scope": scope, "hash": hash_token(secret)},
                )
        store.migrate()
        with store.engine.connect() as c:
            rows = dict(c.execute(sa.text("SELECT id, machine_id FROM api_tokens")).all())
        assert rows == {"a1": "m1", "a2": "m2", "o1": None}
        with store.session() as s:
            assert revoke_machine_tokens(s, "m1") == 1
            assert authenticate(s, "mtd_agent-one") is None
            assert authenticate(s, "mtd_agent-two") is not None
    finally:
        store.close()
