"""DMTF's Redfish-Service-Validator against the lab Redfish BMC (vm-lab/vmlab/redfish.py and
its BIOS, update and task resources), so the lab speaks standard Redfish and not a dialect
metald happens to accept. The DMTF schemas it checks against are test fixtures (no network at
test time): tests/fixtures/redfish-csdl (DSP8010, BSD 3-clause; see its LICENSE.md)."""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from bootassets.secureboot import new_key
from metald.bmc.base import BmcEndpoint
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import LabRedfish
from vmlab import redfish_events
from vmlab.redfish_update import make_image

CSDL = Path(__file__).parents[1] / "fixtures" / "redfish-csdl"
VALIDATOR = Path(sys.executable).with_name("rf_service_validator")


@pytest.mark.skipif(not VALIDATOR.exists(), reason="redfish-service-validator is not installed")
async def test_lab_bmc_passes_the_dmtf_validator(lab_redfish: LabRedfish, tmp_path: Path) -> None:
    # A finished update task, so that the Task resources are walked too.
    d = RedfishDriver(
        BmcEndpoint("127.0.0.1", lab_redfish.port, lab_redfish.username, lab_redfish.password),
        scheme="http",
    )
    try:
        task = await d.push_update(make_image("NIC.1", "1.22.0"), "NIC.1", "validator")
        end = time.monotonic() + 20
        while not task.done:
            assert time.monotonic() < end
            await asyncio.sleep(0.1)
            task = await d.update_task(task.uri)
        # metald's signing certificate in db, so that an enrolled one is walked too.
        _key, cert = new_key(tmp_path / "sbkey")
        assert await d.enroll_certificate("db", cert.read_text())
    finally:
        await d.close()
    # A log entry, so that the event log's entries are walked too.
    lab_redfish.app[redfish_events.EVENTS].add("Memory #0x01 Uncorrectable ECC | Asserted")
    schemas = tmp_path / "schemas"
    shutil.copytree(CSDL, schemas)  # the validator writes beside the schemas it reads
    proc = await asyncio.create_subprocess_exec(
        str(VALIDATOR),
        "--rhost", f"http://127.0.0.1:{lab_redfish.port}",
        "--user", lab_redfish.username,
        "--password", lab_redfish.password,
        "--authtype", "Basic",
        "--schema_directory", str(schemas),
        "--skipschema",
        "--logdir", str(tmp_path / "logs"),
        "--timeout", "10",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    text = out.decode(errors="replace")
    counts = re.search(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|", text)
    assert counts is not None, text[-4000:]
    passed, _warned, failed, _skipped = (int(x) for x in counts.groups())
    assert failed == 0 and proc.returncode == 0, text[-6000:]
    assert passed > 250, text[-4000:]  # it really walked the service:
    for path in (
        "TaskService/Tasks/1",
        "AccountService/Accounts/1",
        "SessionService/Sessions",
        "EventService/Subscriptions",
        "Managers/BMC/LogServices/SEL/Entries/1",
        "Systems/m0/SecureBoot",
        "Systems/m0/SecureBoot/SecureBootDatabases/PK/Certificates/1",
        "Systems/m0/SecureBoot/SecureBootDatabases/db/Certificates/2",
    ):
        assert f"Validating /redfish/v1/{path}..." in text, text[-4000:]
