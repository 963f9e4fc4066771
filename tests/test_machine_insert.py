"""A machine enrolled by its DHCP sighting is written with Core INSERTs (``insert_machine``,
no ORM unit of work: half that transaction's cost in a power-on storm), and so is the agent
token its boot script carries (``issue_agent_token``). Each row must be the one the ORM writes
for the same machine or token, column for column (JSON's ``null`` in the empty JSON columns
included), so nothing that reads them can tell how one was created."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import text

from metald import machines
from metald.arch import from_firmware
from metald.auth import Role, hash_token, issue_agent_token, issue_token, lookup
from metald.store.models import Machine

#: Differ by nature between two machines: who they are and when they were made.
OWN = {"id", "name", "state_changed_at", "created_at", "updated_at"}


def _rows(s: Any) -> dict[str, dict[str, Any]]:
    rows = s.connection().execute(text("SELECT * FROM machines")).mappings()
    return {r["id"]: {k: v for k, v in r.items() if k not in OWN} for r in rows}


async def test_the_core_insert_writes_the_row_the_orm_writes(store) -> None:  # type: ignore[no-untyped-def]
    with store.session() as s:
        orm = Machine(
            state="discovered",
            labels={"pool": "a"},
            rack="r07",
            rack_position="swp3",
            firmware="uefi-x64",
            arch=from_firmware("uefi-x64"),
        )
        s.add(orm)
        s.flush()
        core = machines.insert_machine(
            s,
            macs=["52:54:00:0a:00:01"],
            actor="t",
            labels={"pool": "a"},
            rack="r07",
            rack_position="swp3",
            firmware="uefi-x64",
        )
        s.commit()
        rows = _rows(s)
        assert rows[core] == rows[orm.id]
        m = machines.get_machine(s, core)
        assert (m.name, m.state, m.version) == ("r07-swp3", "discovered", 1)
        assert m.inventory is None and m.boot_intent is None and m.firmware_versions == {}


async def test_a_sighting_reads_the_machine_of_a_mac(store) -> None:  # type: ignore[no-untyped-def]
    with store.session() as s:
        assert machines.sighting_by_mac(s, "52:54:00:0a:00:02") is None
        mid = machines.insert_machine(
            s, macs=["52:54:00:0A:00:02"], actor="t", rack_position="swp4", firmware="bios"
        )
        s.commit()
        row = machines.sighting_by_mac(s, "52-54-00-0a-00-02")
        assert (row.id, row.rack_position, row.firmware, row.arch) == (
            mid,
            "swp4",
            "bios",
            "amd64",
        )


async def test_an_agent_tokens_core_insert_writes_the_row_issue_token_writes(store) -> None:  # type: ignore[no-untyped-def]
    """The boot script's agent token (``issue_agent_token``, Core) against ``issue_token``'s
    ORM row for the same machine, phase and boot; and it authenticates as such."""
    with store.session() as s:
        mid = machines.insert_machine(s, macs=["52:54:00:0a:00:03"], actor="t")
        orm, _ = issue_token(
            s,
            name="agent-x",
            role=Role.AGENT,
            scope=[mid],
            created_by="metald:t",
            ttl=timedelta(seconds=60),
            commit=False,
            phase="inspect",
            boot="b1",
        )
        secret = issue_agent_token(
            s,
            mid,
            name="agent-x",
            created_by="metald:t",
            ttl=timedelta(seconds=60),
            phase="inspect",
            boot="b1",
        )
        s.commit()
        own = {"id", "token_hash", "created_at", "expires_at"}
        rows = {
            r["token_hash"]: {k: v for k, v in r.items() if k not in own}
            for r in s.connection().execute(text("SELECT * FROM api_tokens")).mappings()
        }
        assert rows[hash_token(secret)] == rows[orm.token_hash]
        p = lookup(s, secret)
        assert p is not None
        assert (p.role, p.scope, p.phase, p.boot, p.first_use) == (
            Role.AGENT,
            frozenset({mid}),
            "inspect",
            "b1",
            True,
        )
