"""The NVLink link matrix (metald.inventory.nvlinkmatrix) from real ``nvidia-smi nvlink -s``
and ``nvidia-smi topo -m`` output (tests/fixtures/gpu/SOURCES.md): parsed, joined into the
inventory, sent by the agent, and shown per machine by GET /api/v1/machines/{id}/topology."""

from __future__ import annotations

from pathlib import Path

from metald.inventory import normalize, parse_payload
from metald.inventory.normalize import inventory_document
from metald.inventory.nvlinkmatrix import links_facts, parse_nvlink_status, parse_topo_matrix
from metald.lifecycle import State
from metald.store.models import Machine
from tests.inventory.conftest import FIXTURES, payload
from tests.inventory.receiver import Receiver
from tests.inventory.test_agent import BUSYBOX, run_agent, xe9680
from tests.inventory.test_agent import busybox_bin as busybox_bin  # the fixture

A6000_NVLINK = FIXTURES / "nvidia-smi-nvlink-s_3x-rtx-a6000.txt"
A6000_TOPO = FIXTURES / "nvidia-smi-topo-m_3x-rtx-a6000.txt"
H100_TOPO = FIXTURES / "nvidia-smi-topo-m_8x-h100_9-nics.GPU-ROWS.txt"
DGX1_TOPO = FIXTURES / "nvidia-smi-topo-m_8x-v100-dgx1_hybrid-cube-mesh.FIRST-7-ROWS.txt"
H200_BUNDLE = FIXTURES / "nvgpu-exporter-capture_linux-x86_64__nvidia-h200__590.48.01.txt"


def section(bundle: Path, command: str) -> str:
    """One command's output from a capture bundle (``# $ <command>`` headers)."""
    text = bundle.read_text()
    return text.split(f"# $ {command}\n", 1)[1].split("\n# $ ", 1)[0]


def test_nvlink_status_of_two_bridged_gpus_and_one_without_links() -> None:
    g0, g1, g2 = parse_nvlink_status(A6000_NVLINK.read_text())
    assert (g0.index, g0.name, g0.uuid) == (0, "NVIDIA RTX A6000", "GPU-5baec991-de63-c196-1766-04c38407e133")  # fmt: skip
    assert (g0.links, g0.active, g0.gbps_per_link, g0.total_gbps) == (4, 4, 14.062, 56.248)
    assert g1.active == 4 and not g1.all_inactive
    assert (g2.index, g2.links, g2.active, g2.all_inactive, g2.total_gbps) == (2, 0, 0, True, 0.0)


def test_an_h200s_eighteen_links() -> None:
    (g,) = parse_nvlink_status(section(H200_BUNDLE, "nvidia-smi nvlink -s"))
    assert (g.name, g.links, g.active, g.gbps_per_link) == ("NVIDIA H200", 18, 18, 26.562)
    assert g.total_gbps == round(18 * 26.562, 3)


def test_inactive_links_are_listed() -> None:
    """EDITED, not a capture: the H200's output with links 16 and 17 printed as nvidia-smi
    prints a link that is down ("<inactive>")."""
    text = section(H200_BUNDLE, "nvidia-smi nvlink -s")
    text = text.replace("Link 16: 26.562 GB/s", "Link 16: <inactive>")
    text = text.replace("Link 17: 26.562 GB/s", "Link 17: <inactive>")
    (g,) = parse_nvlink_status(text)
    assert (g.links, g.active, g.inactive) == (18, 16, [16, 17])


def test_topo_matrix_of_the_bridged_pair() -> None:
    facts = links_facts(A6000_NVLINK.read_text(), A6000_TOPO.read_text())
    assert facts is not None and facts.matrix is not None
    assert facts.matrix.devices == ["GPU0", "GPU1", "GPU2"]
    assert facts.matrix.cells["GPU0"] == {"GPU0": "X", "GPU1": "NV4", "GPU2": "NODE"}
    assert [(p.a, p.b, p.links) for p in facts.pairs] == [("GPU0", "GPU1", 4)]
    assert facts.matrix.cpu_affinity["GPU2"] == "0-31,64-95"
    assert facts.matrix.numa_affinity["GPU1"] == "0"
    # nvlink -s agrees: the two bridged GPUs have their 4 links, the third none
    assert [g.active for g in facts.gpus] == [4, 4, 0]


def test_an_hgx_h100_all_to_all_with_one_nic_per_gpu() -> None:
    facts = links_facts(None, H100_TOPO.read_text())
    assert facts is not None and facts.matrix is not None
    assert len(facts.pairs) == 28 and {p.links for p in facts.pairs} == {18}  # NVSwitch
    assert facts.nearest_nics == {f"GPU{i}": [f"NIC{8 - i}"] for i in range(8)}
    assert facts.matrix.numa_affinity["GPU4"] == "1"
    assert facts.matrix.cpu_affinity["GPU7"] == "80-159"


def test_a_dgx1_hybrid_cube_mesh_from_a_page_that_lost_its_tabs() -> None:
    facts = links_facts(None, DGX1_TOPO.read_text())
    assert facts is not None and facts.matrix is not None
    assert facts.matrix.devices[-2:] == ["mlx5_0", "mlx5_1"]
    # the hybrid cube mesh: 16 GPU pairs; GPU0's six links to GPU1, 2 (two each), 3, 4
    assert len(facts.pairs) == 16
    gpu0 = {p.b: p.links for p in facts.pairs if p.a == "GPU0"}
    assert gpu0 == {"GPU1": 2, "GPU2": 2, "GPU3": 1, "GPU4": 1}
    assert facts.nearest_nics == {"GPU2": ["mlx5_0", "mlx5_1"], "GPU3": ["mlx5_0", "mlx5_1"]}


def test_the_underline_escape_and_a_single_gpu() -> None:
    m = parse_topo_matrix(section(H200_BUNDLE, "nvidia-smi topo -m"))
    assert m is not None and m.devices == ["GPU0"] and m.cells == {"GPU0": {"GPU0": "X"}}
    # the agent drops the ESC byte: "[4mGPU0" must still be a header
    m = parse_topo_matrix(section(H200_BUNDLE, "nvidia-smi topo -m").replace("\x1b", ""))
    assert m is not None and m.cpu_affinity == {"GPU0": "0-23"}


def test_nothing_to_parse() -> None:
    assert links_facts(None, None) is None
    assert links_facts("", "No devices were found\n") is None
    assert parse_topo_matrix("garbage\n\twith tabs\n") is None


def test_the_inventory_keeps_the_matrix() -> None:
    raw = {"nvidia_smi_nvlink": A6000_NVLINK.read_text(), "nvidia_smi_topo": A6000_TOPO.read_text()}
    inv = normalize(parse_payload(payload(raw=raw)))
    assert inv.nvlink_links is not None
    assert [(p.a, p.b, p.links) for p in inv.nvlink_links.pairs] == [("GPU0", "GPU1", 4)]
    assert normalize(parse_payload(payload())).nvlink_links is None


async def test_the_agent_sends_both_views(tmp_path, busybox_bin, aiohttp_server) -> None:  # noqa: F811
    if BUSYBOX is None:
        return
    rec = Receiver(actions=[{"action": "poweroff"}])
    server = await aiohttp_server(rec.app())
    tool = busybox_bin / "nvidia-smi"
    tool.write_text(
        f"#!{BUSYBOX} sh\n"
        f'case "$1" in nvlink) cat "{A6000_NVLINK}" ;; topo) cat "{A6000_TOPO}" ;; *) exit 9 ;; esac\n'
    )
    tool.chmod(0o755)
    rc, log = await run_agent(xe9680(tmp_path / "root"), busybox_bin, server.port)
    assert rc == 0, log
    p = parse_payload(rec.posts[0]["body"])
    assert p.raw.nvidia_smi_nvlink == A6000_NVLINK.read_text().rstrip("\n")
    assert p.raw.nvidia_smi_topo is not None and "GPU0\t X \tNV4" in p.raw.nvidia_smi_topo
    assert [g.active for g in normalize(p).nvlink_links.gpus] == [4, 4, 0]  # type: ignore[union-attr]


async def test_the_machine_topology_shows_the_matrix(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    raw = {"nvidia_smi_nvlink": A6000_NVLINK.read_text(), "nvidia_smi_topo": H100_TOPO.read_text()}
    p = parse_payload(payload(raw=raw))
    norm = normalize(p)
    with store.session() as s:
        m = Machine(state=State.READY.value, inventory=inventory_document(p, norm), **norm.machine_fields())  # fmt: skip
        s.add(m)
        s.commit()
        mid = m.id
    r = await client.get(f"/api/v1/machines/{mid}/topology", headers=tokens.header("technician"))
    assert r.status == 200, await r.text()
    links = (await r.json())["nvlink_links"]
    assert len(links["pairs"]) == 28
    assert links["matrix"]["cells"]["GPU0"]["NIC8"] == "PIX"
    assert links["gpus"][2]["all_inactive"] is True


async def test_metalctl_machines_topology_prints_the_matrix(api, capsys) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from metald.metalctl import topology as ctl

    client, tokens, store = api
    raw = {"nvidia_smi_nvlink": A6000_NVLINK.read_text(), "nvidia_smi_topo": A6000_TOPO.read_text()}
    p = parse_payload(payload(raw=raw))
    norm = normalize(p)
    with store.session() as s:
        m = Machine(name="a6000-box", state=State.READY.value, inventory=inventory_document(p, norm), **norm.machine_fields())  # fmt: skip
        s.add(m)
        s.commit()
        mid = m.id
    r = await client.get(f"/api/v1/machines/{mid}/topology", headers=tokens.header("technician"))
    answer = await r.json()

    class Client:  # metalctl's client is synchronous: answer from the app's reply
        def call(self, method: str, path: str, body: object = None) -> object:
            assert (method, path) == ("GET", f"/api/v1/machines/{mid}/topology")
            return answer

    ctl.machine_topology(argparse.Namespace(id=mid, output=None), Client())  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert f"machine {mid} (a6000-box)" in out
    lines = out.splitlines()
    assert "GPU0  X     NV4   NODE" in lines, out
    assert any(ln.split()[:2] == ["2", "NVIDIA"] and "0/0" in ln and "all" in ln for ln in lines), (
        out
    )
    assert any(ln.startswith("0 ") and "4/4" in ln and "56.248" in ln for ln in lines), out
