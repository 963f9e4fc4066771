"""The node image's mesh and guard shell (bootassets/node/metald-node) against metald's own
rendering: one guard, one listen port. The functions run for real under busybox sh; applying
views to live WireGuard devices is tests/tenants/test_mesh_netns.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from metald.tenants import mesh
from netconfig import guard
from tests.bootassets.conftest import ROOT

SCRIPT = ROOT / "bootassets/node/metald-node"

pytestmark = pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox")


def node_sh(tmp_path: Path, body: str) -> str:
    env = dict(os.environ, METALD_NODE_LIB="1", METALD_NODE_STATE=str(tmp_path))
    r = subprocess.run(
        ["busybox", "sh", "-c", f". {SCRIPT}\n{body}\n"], env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_node_renders_metalds_guard(tmp_path: Path) -> None:
    for ifs in (["eth0"], ["eth0", "ens1f0"]):
        literal = "{ " + ", ".join(f'"{i}"' for i in ifs) + " }"
        shell = node_sh(tmp_path, f"guard_rules '{literal}'")
        assert shell == guard.render(ifs, mesh_port=mesh.NODE_LISTEN_PORT)
        # an installed OS's guard (metald-node join) leaves its SSH port open
        shell = node_sh(tmp_path, f"guard_rules '{literal}' '22, 8443'")
        assert shell == guard.render(ifs, mesh_port=mesh.NODE_LISTEN_PORT, tcp_ports=[22, 8443])
        assert "tcp dport { 22, 8443 } accept" in shell


def test_the_node_listens_where_metald_tells_peers_to_dial() -> None:
    assert re.search(r"^MESH_PORT=(\d+)$", SCRIPT.read_text(), re.M).group(1) == str(  # type: ignore[union-attr]
        mesh.NODE_LISTEN_PORT
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nftables"
)
def test_sources_update_is_metalds_and_nft_takes_it(tmp_path: Path) -> None:
    from netconfig import netns

    ns = f"mtg{os.getpid() % 100000}"
    netns.create(ns)
    try:
        guard.apply(ns, guard.render(["lo"], mesh_port=mesh.NODE_LISTEN_PORT))
        body = "nft() { cat >/dev/null; }\nmesh_set_sources 10.0.0.1 10.0.0.9\ncat $STATE/mesh-guard.nft"
        out = node_sh(tmp_path, body)
        assert out == guard.render_sources(["10.0.0.1", "10.0.0.9"])
        guard.apply(ns, out)
        listed = subprocess.run(
            [
                "nsenter",
                f"--net={netns.path(ns)}",
                "nft",
                "list",
                "set",
                "inet",
                guard.TABLE,
                guard.SOURCES,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "10.0.0.1, 10.0.0.9" in listed
        guard.apply(ns, guard.render_sources([]))  # an empty view empties it
        listed = subprocess.run(
            [
                "nsenter",
                f"--net={netns.path(ns)}",
                "nft",
                "list",
                "set",
                "inet",
                guard.TABLE,
                guard.SOURCES,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "10.0.0" not in listed
    finally:
        netns.delete(ns)
