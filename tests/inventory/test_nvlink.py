"""NVLink fabric facts from real GB200/GB300 ``nvidia-smi -q -x`` captures and the labelled
edits of the failure cases (tests/fixtures/gpu/SOURCES.md), and InfiniBand ports in the
payload."""

from __future__ import annotations

import pytest

from metald.inventory import normalize, parse_payload
from metald.inventory.nvlink import parse_fabric
from metald.inventory.schema import InventoryError
from tests.inventory.conftest import fixture_text, payload

GB200 = "nvidia-smi-q-x_4x-gb200_arm64_drv580.173.02"
DOMAIN = "00000001-0000-0000-0000-000000000001.2"


def test_gb200_tray_is_ready_in_its_domain() -> None:
    nv = parse_fabric(fixture_text(f"{GB200}.xml"))
    assert nv is not None
    assert (nv.domain, nv.ready, nv.problems) == (DOMAIN, True, [])
    assert (nv.gpus_attached, nv.gpus_reported) == (4, 4)
    assert (nv.chassis_serial, nv.slot_number, nv.tray_index) == ("1820000000001", 14, 4)
    assert sorted(g.module_id or 0 for g in nv.gpus) == [1, 2, 3, 4]
    assert {g.peer_type for g in nv.gpus} == {"Switch Connected"}


def test_gb300_tray() -> None:
    nv = parse_fabric(fixture_text("nvidia-smi-q-x_4x-gb300_drv580.173.02.xml"))
    assert nv is not None and nv.ready
    assert nv.domain == "00000001-0000-0000-0000-000000000001.32766"


def test_fabric_registration_in_progress_is_not_ready() -> None:
    nv = parse_fabric(fixture_text(f"{GB200}.EDITED-fabric-in-progress.xml"))
    assert nv is not None
    assert (nv.domain, nv.ready) == (None, False)
    assert len(nv.problems) == 4
    assert "fabric registration In Progress, not Completed" in nv.problems[0]


def test_a_missing_gpu_keeps_the_domain_but_is_not_ready() -> None:
    nv = parse_fabric(fixture_text(f"{GB200}.EDITED-gpu-missing.xml"))
    assert nv is not None
    assert (nv.domain, nv.ready, nv.gpus_reported) == (DOMAIN, False, 3)
    assert nv.problems == [
        "the driver attached 4 GPU(s) but nvidia-smi lists 3: a GPU is missing (fallen off "
        "the bus, or not seated)"
    ]


def test_completed_with_an_error_and_a_zero_uuid_is_no_domain_for_that_gpu() -> None:
    nv = parse_fabric(fixture_text(f"{GB200}.EDITED-fabric-insufficient-resources.xml"))
    assert nv is not None
    assert (nv.domain, nv.ready) == (DOMAIN, False)  # the other three still agree
    assert nv.problems == [
        "00000000:29:00.0: fabric registration completed with status Insufficient Resources"
    ]


def test_gpus_without_a_fabric_have_no_nvlink_facts() -> None:
    assert parse_fabric(fixture_text("nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml")) is None
    with pytest.raises(ValueError):
        parse_fabric('<!DOCTYPE x [<!ENTITY a "b">]><nvidia_smi_log/>')


def test_normalize_sets_the_machine_columns() -> None:
    inv = normalize(parse_payload(payload(raw={"nvidia_smi_xml": fixture_text(f"{GB200}.xml")})))
    assert inv.machine_fields()["nvlink_domain"] == DOMAIN
    assert inv.machine_fields()["nvlink_ready"] is True
    assert inv.gpu_count == 4 and inv.gpu_model == "NVIDIA GB200"
    bad = fixture_text(f"{GB200}.EDITED-fabric-in-progress.xml")
    fields = normalize(parse_payload(payload(raw={"nvidia_smi_xml": bad}))).machine_fields()
    assert (fields["nvlink_domain"], fields["nvlink_ready"]) == (None, False)


def test_infiniband_ports_are_reported_and_checked() -> None:
    ports = [
        {
            "device": "mlx5_0",
            "port": 1,
            "port_guid": "0x0002C90300000A01",
            "link_layer": "InfiniBand",
            "state": "4: ACTIVE",
            "rate": "400 Gb/sec (4X NDR)",
        }
    ]
    inv = normalize(parse_payload(payload(infiniband=ports)))
    assert inv.infiniband[0].port_guid == "0x0002c90300000a01"
    for bad in ({"port_guid": "fe80::1"}, {"port": 0}, {"device": "a b"}):
        with pytest.raises(InventoryError):
            parse_payload(payload(infiniband=[{**ports[0], **bad}]))
