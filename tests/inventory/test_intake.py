"""The endpoint's one call: a sequence of posts as an agent (and an attacker) would send them."""

from __future__ import annotations

import copy

import pytest

from metald.inventory.intake import validate_inventory
from metald.inventory.schema import InventoryError, ReplayedInventory, WrongMachine
from tests.inventory.conftest import payload

NEW_BOOT = "11111111-2222-4333-8444-555555555555"


def test_first_post_then_replay_then_reinspection_with_a_change():
    first = payload()
    a = validate_inventory(first, token_machine_id="m-1", stored=None)
    assert a.machine_fields["serial"] == "HSR8X04"
    assert a.changes == []
    stored = a.document

    # the same body again (captured and replayed): refused, stored document unchanged
    before = copy.deepcopy(stored)
    with pytest.raises(ReplayedInventory):
        validate_inventory(first, token_machine_id="m-1", stored=stored)
    assert stored == before

    # another machine's token, or junk: refused
    with pytest.raises(WrongMachine):
        validate_inventory(payload(sequence=2), token_machine_id="m-2", stored=stored)
    with pytest.raises(InventoryError):
        validate_inventory(
            {**payload(sequence=2), "extra": 1}, token_machine_id="m-1", stored=stored
        )

    # re-inspection after a reboot, one NVMe gone
    again = validate_inventory(
        payload(boot_id=NEW_BOOT, disks=[]), token_machine_id="m-1", stored=stored
    )
    assert any("nvme0n1" in c and "removed" in c for c in again.changes)
    assert again.document["agent"]["previous_boots"] == [first["boot_id"]]
    # and the first boot's post cannot come back
    with pytest.raises(ReplayedInventory, match="earlier boot"):
        validate_inventory(payload(sequence=5), token_machine_id="m-1", stored=again.document)
