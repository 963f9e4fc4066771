"""Sizes as people read them (issue 31 item 14: "vda: 0.0 TB" for a 2 GB disk), in the
console and in ``metalctl``; default machine names (item 12)."""

from __future__ import annotations

import uuid

from metald.metalctl.machines import _details, row
from metald.naming import generated_name, name_from_serial
from metald.units import disk_size, mib


def test_disks_in_decimal_units_memory_in_binary() -> None:
    assert disk_size(2_000_000_000) == "2.0 GB"
    assert disk_size(3_840_000_000_000) == "3.84 TB"
    assert disk_size(960_000_000_000) == "960 GB"
    assert disk_size(512) == "512 B"
    assert disk_size(None) == ""
    assert mib(524288) == "512 GiB"
    assert mib(1536 * 1024) == "1.5 TiB"
    assert mib(2048) == "2.0 GiB"


def test_metalctl_shows_memory_and_disks_in_human_units() -> None:
    m = {
        "id": "0" * 36,
        "name": "n1",
        "state": "ready",
        "memory_mb": 524288,
        "labels": {},
        "nics": [],
        "allowed_actions": [],
        "inventory": {"normalized": {"disks": [{"name": "vda", "size_bytes": 2_000_000_000}]}},
    }
    assert row(m)["mem"] == "512 GiB"
    text = _details(m)
    assert "memory:         512 GiB" in text
    assert "disks:          vda 2.0 GB" in text


def test_generated_names_are_readable_stable_and_never_an_id_prefix() -> None:
    ids = [str(uuid.uuid4()) for _ in range(2000)]
    names = {generated_name(i) for i in ids}
    assert len(names) == len(ids)  # 44 bits: no collision among 2,000
    for i in ids[:50]:
        name = generated_name(i)
        assert name == generated_name(i)  # a function of the id: metald can tell it apart
        adjective, noun, digits = name.split("-")
        assert adjective.isalpha() and noun.isalpha() and len(digits) == 6
    assert name_from_serial("CZ2D1234AB") == "cz2d1234ab"
    assert name_from_serial("deadbeef12") == "sn-deadbeef12"  # would read as an id prefix
    assert name_from_serial("1234567890") == "sn-1234567890"
    assert name_from_serial("x") is None
    assert name_from_serial("Serial Number / 42 ") == "serial-number-42"
