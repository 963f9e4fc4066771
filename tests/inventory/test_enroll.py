"""Enrollment rules and the re-inspection diff."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from metald.inventory import (
    EnrollmentRule,
    apply_rules,
    diff,
    inventory_document,
    normalize,
    parse_payload,
)
from tests.inventory.conftest import payload
from vmlab.inventory import nvidia_gpus


def inv_with(gpu_device: int = 0x2330, gpus: int = 8, **over):
    pci = nvidia_gpus(range(1, gpus + 1), device=f"0x{gpu_device:04x}")
    return normalize(parse_payload(payload(pci=pci, **over)))


RULES = [
    EnrollmentRule(labels={"site": "ams1"}),
    EnrollmentRule.model_validate(
        {"match": {"gpu_model": "nvidia h100*"}, "labels": {"pool": "training"}, "min_gpu_count": 8}
    ),
    EnrollmentRule.model_validate(
        {"match": {"gpu_family": "L40S"}, "labels": {"pool": "inference"}}
    ),
    EnrollmentRule.model_validate({"match": {"rack_position": "leaf-r12/*"}, "rack": "r12"}),
    EnrollmentRule.model_validate(
        {
            "match": {"vendor": "Dell*", "product": "PowerEdge XE9680"},
            "labels": {"chassis": "xe9680"},
        }
    ),
]


def test_rules_set_labels_and_rack():
    labels, rack = apply_rules(RULES, inv_with(), "leaf-r12/Ethernet3")
    assert labels == {"site": "ams1", "pool": "training", "chassis": "xe9680"}
    assert rack == "r12"


def test_rules_that_do_not_match_leave_nothing():
    labels, rack = apply_rules(
        RULES,
        inv_with(gpu_device=0x26B9, gpus=4, system={"vendor": "Supermicro"}),
        "leaf-r13/Ethernet1",
    )
    assert labels == {"site": "ams1", "pool": "inference"}
    assert rack is None
    # 4 H100s fall short of min_gpu_count
    labels, _ = apply_rules(RULES, inv_with(gpus=4), None)
    assert "pool" not in labels


def test_rack_position_falls_back_to_lldp():
    lldp = "lldp.eno1.chassis.name=leaf-r12\nlldp.eno1.port.ifname=Ethernet9\n"
    _, rack = apply_rules(RULES, inv_with(raw={"lldpctl": lldp}), None)
    assert rack == "r12"


def test_later_rules_override_earlier_labels():
    rules = [
        EnrollmentRule(labels={"pool": "a"}),
        EnrollmentRule(labels={"pool": "b"}, rack="x"),
        EnrollmentRule(labels={}),
    ]
    assert apply_rules(rules, inv_with(), None) == ({"pool": "b"}, "x")


def test_rule_keys_are_checked():
    with pytest.raises(ValidationError):
        EnrollmentRule.model_validate({"match": {"colour": "red"}})
    with pytest.raises(ValidationError):
        EnrollmentRule.model_validate({"labels": {}, "typo": 1})


def test_diff_names_what_changed():
    old = inv_with()
    new_payload = payload(
        pci=nvidia_gpus(range(1, 8)),
        disks=[{"name": "nvme1n1", "size_bytes": 1000, "model": "X", "serial": "S9"}],
        memory={"online_bytes": 1 << 40},
    )
    new = normalize(parse_payload(new_payload))
    changes = diff(old, new)
    assert "gpu_count: 8 -> 7" in changes
    assert "memory_mb: 2097152 -> 1048576" in changes
    assert any(c.startswith("gpu 0000:08:00.0") and c.endswith("removed") for c in changes)
    assert any("nvme0n1" in c and "removed" in c for c in changes)
    assert any("nvme1n1" in c and "added" in c for c in changes)


def test_diff_of_identical_and_first_inventories_is_empty():
    inv = inv_with()
    assert diff(inv, inv_with()) == []
    assert diff(None, inv) == []
    # stored documents work as well as normalised objects
    doc = inventory_document(parse_payload(payload()), inv)
    assert diff(doc, inv) == []
    assert doc["payload"]["schema_version"] == 1
