"""Linking a BMC registered before its machine, when the machine's inventory arrives
(``BmcRegistry.link_by_identity``), on a real store (SQLite and PostgreSQL).

It must read only the BMC rows that can match, not every unlinked BMC: in an enrollment storm
with the BMCs registered first, reading them all made each inventory cost O(unlinked BMCs) and
the storm quadratic (bench/fleet.py: 28 ms of metald CPU per machine at 1,000 against 15 ms
without BMCs).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy import event

from metald.bmc.registry import uuid_sources, uuid_variants
from metald.bmc.service import BmcService
from metald.config import BmcConfig
from metald.machines import create_machine
from metald.secrets import SecretBox
from metald.store.db import Store
from metald.store.models import Bmc, Machine
from tests.conftest import LAB_BMC_NETWORKS

OTHERS = 150


@pytest.fixture
async def svc(store: Store, tmp_path: Path):
    box = SecretBox.from_file(tmp_path / "state" / "secrets.key")
    service = BmcService(
        store, box, BmcConfig(networks=LAB_BMC_NETWORKS, power_sync_interval_s=0), instance="test"
    )
    service.box = box
    yield service
    await service.stop()


def _bmcs(store: Store, box: SecretBox, rows: list[dict]) -> list[str]:
    with store.session() as s:
        out = []
        for i, cols in enumerate(rows):
            b = Bmc(
                address="192.0.2.1", port=1000 + i, protocol="ipmi", username="u",
                password_enc=box.encrypt("p"), **cols,
            )  # fmt: skip
            s.add(b)
            out.append(b.id)
        s.commit()
        return out


def _machine(store: Store, mac: str, **cols: str) -> str:
    with store.session() as s:
        m = create_machine(s, macs=[mac], actor="test", commit=False)
        for k, v in cols.items():
            setattr(m, k, v)
        s.add(m)
        s.commit()
        return m.id


def _others() -> list[dict]:
    return [
        {"system_uuid": str(uuid.uuid4()), "serial": f"OTHER{i}", "macs": [f"02:00:00:00:{i >> 8:02x}:{i & 255:02x}"]}
        for i in range(OTHERS)
    ]  # fmt: skip


def test_every_stored_reading_is_a_source() -> None:
    for _ in range(500):
        s = str(uuid.uuid4())
        for stored in (s, s.upper()):
            for reading in uuid_variants(stored):
                assert stored.lower() in uuid_sources(reading)
                assert stored.lower() in uuid_sources(reading.upper())
    assert uuid_sources("not-a-uuid") == {"not-a-uuid"}
    assert uuid_sources(None) == set()


@pytest.mark.parametrize("how", ["as-read", "reversed", "mixed-endian", "serial", "mac"])
async def test_links_the_matching_bmc_reading_only_candidates(svc: BmcService, store: Store, how: str) -> None:  # fmt: skip
    sys_uuid = str(uuid.uuid4())
    stored = {
        "as-read": {"system_uuid": sys_uuid.upper()},
        # A BMC whose GUID bytes came the other way round: one of its readings is the UUID.
        "reversed": {"system_uuid": str(uuid.UUID(bytes=bytes(reversed(uuid.UUID(sys_uuid).bytes))))},
        "mixed-endian": {"system_uuid": str(uuid.UUID(bytes=bytes(reversed(uuid.UUID(sys_uuid).bytes_le))))},
        "serial": {"serial": "SER-42"},
        "mac": {"macs": ["aa:bb:cc:00:00:01", "b0:7b:25:00:00:07"]},
    }[how]  # fmt: skip
    assert sys_uuid in uuid_variants(stored.get("system_uuid")) or how in ("serial", "mac")
    ids = _bmcs(store, svc.box, [*_others(), stored])
    mid = _machine(store, "b0:7b:25:00:00:07", system_uuid=sys_uuid, serial="SER-42")
    loaded: list[str] = []

    def on_load(target: Bmc, _ctx: object) -> None:
        loaded.append(target.id)

    event.listen(Bmc, "load", on_load)
    try:
        linked = await svc.link_by_identity(mid)
    finally:
        event.remove(Bmc, "load", on_load)
    assert linked is not None and linked["id"] == ids[-1]
    # Only the candidate (and the check that the machine has no BMC yet) was read, not the
    # unlinked others.
    assert set(loaded) <= {ids[-1]}, f"{len(loaded)} BMC rows read to link one"
    with store.session() as s:
        assert s.get(Bmc, ids[-1]).machine_id == mid
        assert all(s.get(Bmc, i).machine_id is None for i in ids[:-1])


async def test_no_match_links_nothing(svc: BmcService, store: Store) -> None:
    _bmcs(store, svc.box, _others())
    mid = _machine(store, "b0:7b:25:00:00:09", system_uuid=str(uuid.uuid4()), serial="NONE")
    assert await svc.link_by_identity(mid) is None


def test_the_identity_lookups_have_indexes(store: Store) -> None:
    """Every first inventory looks its BMC up by lower(system_uuid), then by serial (0040):
    without these indexes each lookup scanned every unlinked BMC row, so at 10,000 BMCs
    registered ahead of their machines (bench/fleet.py) PostgreSQL's CPU per machine grew with
    the fleet."""
    from sqlalchemy import text

    with store.engine.connect() as c:
        if c.dialect.name == "postgresql":
            q = "SELECT indexname FROM pg_indexes WHERE tablename = 'bmcs'"
        else:
            q = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'bmcs'"
        names = {r[0] for r in c.execute(text(q))}
    assert {"ix_bmcs_system_uuid_lower", "ix_bmcs_serial"} <= names, names


async def test_a_uuid_match_wins_over_a_mac_match(svc: BmcService, store: Store) -> None:
    """identity_match prefers the system UUID to a MAC: the lookups run in that order, so a
    BMC that merely lists one of the machine's MACs never takes the link from the BMC that
    reports the machine's own UUID (one OR of the three returned both, in table order)."""
    sys_uuid = str(uuid.uuid4())
    ids = _bmcs(store, svc.box, [{"macs": ["b0:7b:25:00:00:0a"]}, {"system_uuid": sys_uuid}])
    mid = _machine(store, "b0:7b:25:00:00:0a", system_uuid=sys_uuid)
    linked = await svc.link_by_identity(mid)
    assert linked is not None and linked["id"] == ids[1]


class Killed(BaseException):
    """The instance died (kill -9) right after a commit: nothing after it runs."""


async def test_an_instance_killed_after_accepting_the_inventory_leaves_it_linked(
    svc: BmcService, store: Store
) -> None:
    """The inventory is accepted and the BMC registered ahead of its machine is linked in one
    transaction. They were two: an instance killed between them (bench/fleet.py kills one in
    the middle of the enrollment) left ~3 % of its machines ready without their BMC, which
    ``enroll.require_bmc`` never hands to a tenant and nothing can power; the agent's retry is
    refused (the machine is no longer inspecting). Fails on the old code."""
    from metald.auth import Principal, Role, lookup
    from metald.claims.workflow import ClaimWorkflow
    from metald.config import EnrollConfig
    from metald.usecases.agent import Agent
    from tests.test_enrollment import enrolled_via_hooks, payload

    *_, bmc_id = _bmcs(
        store, svc.box, [*_others(), {"system_uuid": "4c4c4544-0042-4310-8033-b4c04f303934"}]
    )
    _hooks, target = await enrolled_via_hooks(store)
    mid = target.machine_id
    with store.session() as s:
        p = lookup(s, target.kernel_args["metald.token"])
    assert p is not None and p.role is Role.AGENT and p.phase == "inspect"

    class DiesAfterCommit:
        async def run(self, fn, *args):  # type: ignore[no-untyped-def]
            await store.run(fn, *args)
            raise Killed

    agent = Agent(
        store,
        DiesAfterCommit(),
        "test",
        lambda: None,
        enroll=EnrollConfig(),
        progress_interval_s=5.0,
        join_token_ttl_s=600,
        bmc=svc,
        workflow=ClaimWorkflow.__new__(ClaimWorkflow),  # not reached by an inventory
    )
    with pytest.raises(Killed):
        await agent.post_inventory(
            Principal(p.token_id, p.name, p.role, p.scope, p.phase, p.boot),
            payload(mid, boot_id=str(uuid.uuid4())),
            actor="agent:test",
        )
    with store.session() as s:
        assert s.get(Machine, mid).state != "inspecting"  # type: ignore[union-attr]
        assert s.get(Bmc, bmc_id).machine_id == mid  # type: ignore[union-attr]
