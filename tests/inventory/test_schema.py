"""The payload schema refuses what it must, with errors that name the field."""

from __future__ import annotations

import copy

import pytest

from metald.errors import Conflict, Forbidden, Unprocessable
from metald.inventory.schema import (
    REPLAY_WINDOW,
    InventoryError,
    ReplayedInventory,
    WrongMachine,
    check_machine,
    check_replay,
    parse_payload,
)
from tests.inventory.conftest import BOOT_ID, payload


def test_valid_payload_parses(valid_payload):
    p = parse_payload(valid_payload)
    assert p.cpu.logical == 224
    assert p.nics[0].mac == "AA:BB:CC:00:11:22"
    assert p.raw.nvidia_smi_xml is None


@pytest.mark.parametrize(
    ("mutate", "names"),
    [
        (lambda d: d.update(surprise=1), "surprise: unknown field"),
        (lambda d: d["system"].update(colour="red"), "system.colour: unknown field"),
        (lambda d: d["nics"][0].update(mac="not-a-mac"), "nics[0].mac"),
        (lambda d: d["cpu"].update(logical="many"), "cpu.logical"),
        (lambda d: d["system"].update(product="x" * 300), "system.product"),
        (lambda d: d.update(boot_id="'; drop table machines"), "boot_id"),
        (lambda d: d.update(sequence=0), "sequence"),
        (lambda d: d.pop("cpu"), "cpu: Field required"),
        (lambda d: d["disks"][0].update(name="../etc"), "disks[0].name"),
        (
            lambda d: d.update(
                pci=[
                    {
                        "address": "0000:01:00.0",
                        "vendor": "10de",
                        "device": "0x20b2",
                        "class": "0x030200",
                    }
                ]
            ),
            "pci[0].vendor",
        ),
        (lambda d: d["raw"].update(nvidia_smi_xml="x" * (800 * 1024)), "raw.nvidia_smi_xml"),
        (lambda d: d.update(disks=[d["disks"][0]] * 257), "disks"),
    ],
)
def test_malformed_payload_is_refused_naming_the_field(valid_payload, mutate, names):
    data = copy.deepcopy(valid_payload)
    mutate(data)
    with pytest.raises(InventoryError) as exc:
        parse_payload(data)
    assert names in exc.value.detail
    assert isinstance(exc.value, Unprocessable) and exc.value.status == 422


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_unknown_schema_version_is_refused(valid_payload, version):
    valid_payload["schema_version"] = version
    with pytest.raises(InventoryError, match="schema_version: this metald reads version 1"):
        parse_payload(valid_payload)


def test_non_object_is_refused():
    with pytest.raises(InventoryError, match="JSON object"):
        parse_payload([1, 2])


def test_token_for_another_machine_is_refused(valid_payload):
    p = parse_payload(valid_payload)
    check_machine(p, "m-1")
    with pytest.raises(WrongMachine, match="token belongs to machine 'm-2'") as exc:
        check_machine(p, "m-2")
    assert isinstance(exc.value, Forbidden)
    # no machine id in the payload: the token alone decides
    check_machine(parse_payload(payload(machine_id=None)), "m-2")


def test_replay_of_the_same_post_is_refused():
    first = parse_payload(payload(sequence=1))
    state = check_replay(None, first)
    with pytest.raises(ReplayedInventory) as exc:
        check_replay(state, first)
    assert isinstance(exc.value, Conflict)
    state2 = check_replay(state.model_dump(), parse_payload(payload(sequence=2)))
    assert state2.sequence == 2
    with pytest.raises(ReplayedInventory, match="not newer"):
        check_replay(state2, parse_payload(payload(sequence=1)))


def test_posts_from_an_earlier_boot_are_refused():
    boots = [f"{i:08x}-0000-4000-8000-000000000000" for i in range(REPLAY_WINDOW + 2)]
    state = check_replay(None, parse_payload(payload(boot_id=BOOT_ID)))
    state = check_replay(state, parse_payload(payload(boot_id=boots[0], sequence=1)))
    with pytest.raises(ReplayedInventory, match="earlier boot"):
        check_replay(state, parse_payload(payload(boot_id=BOOT_ID, sequence=9)))
    for b in boots[1:]:
        state = check_replay(state, parse_payload(payload(boot_id=b, sequence=1)))
    assert len(state.previous_boots) == REPLAY_WINDOW
    assert state.boot_id == boots[-1]
