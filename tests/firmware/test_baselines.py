"""The pure comparison of recorded firmware versions with a baseline (metald.firmware.baselines)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from metald.firmware.baselines import BaselineSpec, Component, compare, component_for, direction

SHA = "a" * 64


def _c(id: str, version: str, **kw: object) -> Component:
    return Component.model_validate({"id": id, "version": version, **kw})


def test_exact_items_and_classes_by_glob() -> None:
    base = [_c("BIOS", "2.19.1"), _c("GPU*", "96.00.89"), _c("BMC", "1.4.0")]
    have = {"BIOS": "2.19.1", "GPU0": "96.00.89", "GPU1": "96.00.61", "BMC": "1.4.0 "}
    got = {(f.component, f.item): f for f in compare(base, have)}
    assert got["BIOS", "BIOS"].status == "ok"
    assert got["GPU*", "GPU0"].status == "ok"
    off = got["GPU*", "GPU1"]
    assert (off.status, off.want, off.have, off.direction) == (
        "differs",
        "96.00.89",
        "96.00.61",
        "older",
    )
    assert got["BMC", "BMC"].status == "ok"  # surrounding blanks are not a difference


def test_missing_and_unknown() -> None:
    base = [_c("NIC.*", "22.36.1010")]
    assert [f.status for f in compare(base, {"BIOS": "1"})] == ["missing"]
    assert [f.status for f in compare(base, {})] == ["unknown"]
    assert [f.status for f in compare(base, None)] == ["unknown"]


def test_glob_is_case_insensitive_and_exact_id_wins() -> None:
    base = [_c("nic.*", "1"), _c("NIC.1", "2")]
    assert component_for(base, "NIC.1") == base[1]
    assert component_for(base, "NIC.2") == base[0]
    assert component_for(base, "BIOS") is None


def test_direction_is_a_hint_only() -> None:
    assert direction("1.10.0", "1.9.0") == "newer"
    assert direction("U46 v2.10", "U46 v2.12") == "older"
    assert direction("abc", "def") is None
    # Different text that reads the same as numbers still differs (status), no direction.
    assert compare([_c("X", "1.0")], {"X": "1.00"})[0].status == "differs"


def test_spec_refusals() -> None:
    with pytest.raises(ValidationError, match="listed twice"):
        BaselineSpec(components=[_c("BIOS", "1"), _c("bios", "2")])
    with pytest.raises(ValidationError, match="both url and sha256"):
        BaselineSpec(components=[_c("BIOS", "1", url="http://x/y.bin")])
    with pytest.raises(ValidationError, match="http://, https:// or file://"):
        _c("BIOS", "1", url="ftp://x/y.bin", sha256=SHA)
    with pytest.raises(ValidationError):
        _c("BIOS", "1", url="http://x/y.bin", sha256="zz")
    with pytest.raises(ValidationError):
        _c("BIOS", "1", apply="reboot-the-rack")
    ok = _c("BIOS", "1", url="http://x/y.bin", sha256=SHA.upper(), apply="host-reset")
    assert ok.sha256 == SHA and ok.updatable()


versions = st.dictionaries(
    st.sampled_from(["BIOS", "BMC", "GPU0", "GPU1", "NIC.1"]), st.sampled_from(["1", "2", "3"])
)


@given(versions, st.sampled_from(["1", "2", "3"]))
def test_compliant_exactly_when_every_matched_item_has_the_version(
    have: dict[str, str], want: str
) -> None:
    base = [_c("GPU*", want), _c("BIOS", want)]
    findings = compare(base, have)
    gpus = [k for k in have if k.startswith("GPU")]
    expect_ok = (
        bool(have)
        and bool(gpus)
        and "BIOS" in have
        and all(have[k] == want for k in [*gpus, "BIOS"])
    )
    assert all(f.status == "ok" for f in findings) is expect_ok
    # Every matched item is reported once; nothing outside the baseline is.
    items = [f.item for f in findings if f.item is not None]
    assert sorted(items) == sorted(i for i in have if i.startswith("GPU") or i == "BIOS")
