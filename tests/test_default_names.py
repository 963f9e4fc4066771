"""Default machine names (issue 31 item 12: machines without a name showed "-" everywhere):
named at enlistment after their rack position, else a readable generated name that their
serial replaces once the inventory gives it; unique, and usable in paths like any name."""

from __future__ import annotations

import uuid

from metald import machines
from metald.config import EnrollConfig
from metald.enrollment import enrollment_boot_hooks
from metald.naming import generated_name
from tests.test_enrollment import MAC, payload


async def test_a_machine_is_named_at_enlistment_and_after_its_serial(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig())
    await hooks.client_seen(MAC, arch="bios", network="rack1", relay_agent=None)  # no position
    target = await hooks.boot_target(MAC)
    mid = target.machine_id
    r = await client.get(f"/api/v1/machines/{mid}", headers=tokens.header("technician"))
    name = (await r.json())["name"]
    assert name == generated_name(mid)
    # The generated name works wherever a name does.
    r = await client.get(f"/api/v1/machines/{name}", headers=tokens.header("technician"))
    assert r.status == 200 and (await r.json())["id"] == mid
    agent = {"Authorization": f"Bearer {target.kernel_args['metald.token']}"}
    r = await client.post(
        "/api/v1/agent/inventory",
        json=payload(mid, boot_id=str(uuid.uuid4())),
        headers=agent,
    )
    assert r.status == 200, await r.text()
    r = await client.get("/api/v1/machines/abc1234", headers=tokens.header("technician"))
    assert r.status == 200 and (await r.json())["id"] == mid  # its serial, ABC1234


async def test_a_rack_position_names_it_and_a_taken_one_gets_a_generated_name(store) -> None:  # type: ignore[no-untyped-def]
    with store.session() as s:
        a = machines.create_machine(
            s, macs=["52:54:00:01:00:01"], actor="t", rack="r07", rack_position="u12"
        )
        b = machines.create_machine(
            s, macs=["52:54:00:01:00:02"], actor="t", rack="r07", rack_position="u12"
        )
        c = machines.create_machine(s, macs=["52:54:00:01:00:03"], actor="t")
        d = machines.create_machine(s, macs=["52:54:00:01:00:04"], actor="t", name="by-hand")
        assert a.name == "r07-u12"
        assert b.name == generated_name(b.id)  # was unnamed ("-" everywhere)
        assert c.name == generated_name(c.id)
        assert d.name == "by-hand"
        # A name given by hand is never replaced by the serial.
        assert not machines.is_generated_name(d) and machines.is_generated_name(c)


def test_migration_0034_names_the_machines_enlisted_before(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Machines enlisted unnamed before 0034: after their rack position, else their serial,
    else a generated name; a taken name is not taken twice."""
    from sqlalchemy import text

    from metald.store import Store

    store = Store(f"sqlite:///{tmp_path / 'm.db'}")
    try:
        store.migrate("0033")
        with store.engine.begin() as conn:
            rows = [
                ("a", "r07", "u1", None, None),  # -> r07-u1
                ("b", None, None, "CZ123", None),  # -> cz123
                ("c", None, None, None, None),  # -> generated
                ("d", "r07", "u1", None, None),  # r07-u1 is a's: generated
                ("e", None, None, None, "kept"),  # named by hand: kept
            ]
            for mid, rack, pos, serial, name in rows:
                conn.execute(
                    text(
                        "INSERT INTO machines (id, name, state, labels, rack, rack_position, "
                        "serial, gpu_count, version, state_changed_at, created_at, updated_at) "
                        "VALUES (:id, :name, 'discovered', '{}', :rack, :pos, :serial, 0, 1, "
                        "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                    ),
                    {"id": mid, "name": name, "rack": rack, "pos": pos, "serial": serial},
                )
        store.migrate("head")
        with store.engine.begin() as conn:
            names = dict(conn.execute(text("SELECT id, name FROM machines")).all())
        assert names == {
            "a": "r07-u1",
            "b": "cz123",
            "c": generated_name("c"),
            "d": generated_name("d"),
            "e": "kept",
        }
    finally:
        store.close()
