"""The console shows the fabric: the Topology page lists NVLink domains with their trays and
the InfiniBand leaves, and a machine's page its NVLink domain, per-GPU fabric registration,
RDMA ports with their switch, and power domain (the simulated NVL72 fleet; plain HTTP, the
browser and axe checks of every page are in test_pages.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import requests

from metald import topology
from metald.inventory.ibnet import parse_ibnetdiscover
from tests.claims import nvl72
from tests.ui.conftest import serve

IBNET = nvl72.ROOT / "tests/fixtures/ib/ibnetdiscover_ibsim-4xnvl72-2-leaves.txt"


def _fleet(_cfg: Any, store: Any, _tokens: Any) -> None:
    nvl72.add_fleet(store, IBNET.read_text())
    with store.session() as s:
        topology.replace_links(s, parse_ibnetdiscover(IBNET.read_text()))
        s.commit()


def test_topology_page_and_machine_section(tmp_path: Path) -> None:
    with serve(tmp_path, _fleet) as app:
        assert app.tokens is not None
        http = requests.Session()
        r = http.post(
            app.base + "/ui/login", data={"token": app.tokens.admin}, allow_redirects=False
        )
        assert r.status_code == 303, r.text
        page = http.get(app.base + "/ui/topology", timeout=30).text
        for d in range(4):
            assert f"<code>{nvl72.domain_id(d)}</code>: 18 of 18 free" in page
        assert "<td>leaf-a</td><td>36</td><td>36</td>" in page
        assert 'href="/ui/topology"' in page  # in the navigation
        mid = next(
            m["id"]
            for m in http.get(
                app.base + "/api/v1/machines",
                params={"limit": 200},
                headers={"Authorization": f"Bearer {app.tokens.admin}"},
                timeout=30,
            ).json()["items"]
            if m["name"] == nvl72.tray(2, 5)
        )
        page = http.get(app.base + f"/ui/machines/{mid}", timeout=30).text
        assert 'id="topology"' in page
        assert f"<code>{nvl72.domain_id(2)}</code> (ready)" in page
        assert "1820000000003 / 6" in page  # chassis serial and slot of the tray
        assert page.count("<td>Completed</td><td>Success</td>") == 4
        assert "leaf-b port 6" in page


def _matrix_machine(_cfg: Any, store: Any, _tokens: Any) -> None:
    from metald.inventory import normalize, parse_payload
    from metald.inventory.normalize import inventory_document
    from metald.lifecycle import State
    from metald.store.models import Machine
    from tests.inventory.conftest import FIXTURES, payload

    raw = {
        "nvidia_smi_nvlink": (FIXTURES / "nvidia-smi-nvlink-s_3x-rtx-a6000.txt").read_text(),
        "nvidia_smi_topo": (FIXTURES / "nvidia-smi-topo-m_3x-rtx-a6000.txt").read_text(),
    }
    p = parse_payload(payload(raw=raw))
    norm = normalize(p)
    with store.session() as s:
        m = Machine(name="a6000-box", state=State.READY.value, inventory=inventory_document(p, norm), **norm.machine_fields())  # fmt: skip
        s.add(m)
        s.commit()


def test_a_machine_page_shows_its_nvlink_link_matrix(tmp_path: Path) -> None:
    with serve(tmp_path, _matrix_machine) as app:
        assert app.tokens is not None
        http = requests.Session()
        r = http.post(
            app.base + "/ui/login", data={"token": app.tokens.admin}, allow_redirects=False
        )
        assert r.status_code == 303, r.text
        items = http.get(
            app.base + "/api/v1/machines",
            headers={"Authorization": f"Bearer {app.tokens.admin}"},
            timeout=30,
        ).json()["items"]
        mid = next(m["id"] for m in items if m["name"] == "a6000-box")
        page = http.get(app.base + f"/ui/machines/{mid}", timeout=30).text
        assert "GPU link matrix" in page
        row = '<tr><th scope="row">GPU0</th><td>X</td><td>NV4</td><td>NODE</td><td>0-31,64-95</td><td>0</td></tr>'
        assert row in page, page[page.find("GPU link matrix") :][:2000]
        assert "<td>2</td><td>NVIDIA RTX A6000</td><td>0 of 0</td><td>all</td>" in page
        assert "<td>4 of 4</td>" in page
