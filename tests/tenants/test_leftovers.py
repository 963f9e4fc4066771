"""What a killed metald leaves of its tenant hubs is taken down by ``clear_leftovers`` (the lab
calls it when it goes down, so a failed test leaves no hub namespace or process behind)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from metald.tenants.runtime import clear_leftovers, ns_name
from netconfig import netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")


def test_a_killed_metalds_hub_namespace_and_process_are_taken_down(tmp_path: Path) -> None:
    tenant_id = str(uuid.uuid4())
    workdir = tmp_path / "tenants" / tenant_id
    workdir.mkdir(parents=True)
    ns = ns_name(tenant_id)
    netns.create(ns)
    hub = subprocess.Popen(["sleep", "60"])  # stands in for the hub's wireguard-go
    (workdir / "wg.pid").write_text(str(hub.pid))
    try:
        assert clear_leftovers(tmp_path) == [ns]
        assert hub.wait(timeout=10) != 0  # terminated
        assert not Path(netns.path(ns)).exists()
        assert not (workdir / "wg.pid").exists()
    finally:
        if hub.poll() is None:
            hub.kill()
        if Path(netns.path(ns)).exists():
            netns.delete(ns)
