"""The topology API on the simulated NVL72 fleet: the ibnetdiscover upload sets the leaves, the
NVLink domain view lists members and free trays, a packed claim over HTTP lands in one domain
and its topology (Slurm topology.conf, IMEX nodes_config) is served, an unplaceable one is a
422 with free_per_domain, and power domains are set by PATCH."""

from __future__ import annotations

import pytest

from tests.claims import nvl72
from tests.claims.helpers import DISK_SPEC

IBNET = nvl72.ROOT / "tests/fixtures/ib/ibnetdiscover_ibsim-4xnvl72-2-leaves.txt"


async def test_topology_api_on_the_simulated_fleet(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    ids = nvl72.add_fleet(store, IBNET.read_text())
    tech, orch = tokens.header("technician"), tokens.header("orchestrator")

    r = await client.put("/api/v1/ib-fabric", json={"ibnetdiscover": "nonsense"}, headers=tech)
    assert r.status == 422 and "ibnetdiscover" in (await r.json())["detail"]
    r = await client.put(
        "/api/v1/ib-fabric", json={"ibnetdiscover": IBNET.read_text()}, headers=orch
    )
    assert r.status == 403  # orchestrators do not describe the fabric
    r = await client.put(
        "/api/v1/ib-fabric", json={"ibnetdiscover": IBNET.read_text()}, headers=tech
    )
    assert r.status == 200, await r.text()
    body = await r.json()
    assert (body["links"], body["switches"], body["machines_changed"]) == (72, 2, 72)
    r = await client.get("/api/v1/ib-fabric", headers=tech)
    assert [(x["leaf"], x["size"], x["free"]) for x in (await r.json())["items"]] == [
        ("leaf-a", 36, 36),
        ("leaf-b", 36, 36),
    ]

    r = await client.get("/api/v1/nvlink-domains", headers=tech)
    doms = (await r.json())["items"]
    assert [(d["domain"], d["size"], d["free"]) for d in doms] == [
        (nvl72.domain_id(i), 18, 18) for i in range(4)
    ]
    assert doms[0]["racks"] == ["rack0"] and doms[0]["chassis"] == ["1820000000001"]
    assert [m["slot_number"] for m in doms[0]["members"]] == list(range(1, 19))

    t0 = ids[nvl72.tray(0, 0)]
    r = await client.get(f"/api/v1/machines/{t0}/topology", headers=tech)
    topo = await r.json()
    assert (topo["nvlink_domain"], topo["nvlink_ready"], topo["ib_leaf"]) == (
        nvl72.domain_id(0),
        True,
        "leaf-a",
    )
    assert topo["infiniband"][0]["switch_name"] == "leaf-a"
    assert len(topo["nvlink"]["gpus"]) == 4
    r = await client.patch(f"/api/v1/machines/{t0}", json={"power_domain": "feed-b"}, headers=tech)
    assert r.status == 200 and (await r.json())["power_domain"] == "feed-b"

    r = await client.post(
        "/api/v1/images", json={"name": "node", "kind": "disk", **DISK_SPEC}, headers=tech
    )
    image = (await r.json())["id"]
    claim = {"tenant_id": tokens.tenant_a, "image_id": image}
    r = await client.post(
        "/api/v1/claims",
        json={**claim, "count": 16, "placement": {"pack": "nvlink-domain"}},
        headers=orch,
    )
    assert r.status == 201, await r.text()
    c = await r.json()
    assert c["placement"] == {"pack": "nvlink-domain"}
    assert {m["nvlink_domain"] for m in c["machines"]} == {nvl72.domain_id(0)}
    r = await client.get(f"/api/v1/claims/{c['id']}/topology", headers=orch)
    t = await r.json()
    assert t["slurm_topology_tree"].count("Nodes=") == 1  # one NVLink switch, one leaf
    assert "SwitchName=ib-leaf-a Switches=nvl-00000001-1-leaf-a" in t["slurm_topology_tree"]
    assert t["slurm_topology_block"].splitlines()[1].startswith("BlockName=nvl-00000001-1 ")
    assert t["imex_nodes_config"] == [] and len(t["unaddressed"]) == 16  # none joined yet
    assert t["nodes"][0]["features"][:2] == ["nvl-00000001-1", "ib-leaf-a"]

    r = await client.post(
        "/api/v1/claims",
        json={**claim, "count": 19, "placement": {"pack": "nvlink-domain"}},
        headers=orch,
    )
    assert r.status == 422
    p = await r.json()
    assert p["free_per_domain"] == {nvl72.domain_id(0): 2, **{
        nvl72.domain_id(i): 18 for i in (1, 2, 3)
    }}  # fmt: skip
    assert "cannot place 19 machine(s) into one nvlink-domain" in p["detail"]
    r = await client.post(
        "/api/v1/claims",
        json={**claim, "count": 10, "placement": {"pack": "rack", "group_size": 3}},
        headers=orch,
    )
    assert r.status == 422 and "multiple of placement.group_size" in (await r.json())["detail"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the API test covers both
async def test_metalctl_topology_commands(api, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """metalctl nvlink-domains, ib-fabric upload/list and claims topology against the API."""
    import argparse

    from metald.metalctl import claims as ctl_claims
    from metald.metalctl import topology as ctl

    client, tokens, store = api
    nvl72.add_fleet(store, IBNET.read_text())
    calls = []

    class Client:  # metalctl's client is synchronous: record calls, answer from the app
        def __init__(self) -> None:
            self.answers: dict[tuple[str, str], object] = {}

        def call(self, method: str, path: str, body: object = None) -> object:
            calls.append((method, path, body))
            return self.answers[(method, path)]

    tech = tokens.header("technician")
    c = Client()
    r = await client.put(
        "/api/v1/ib-fabric", json={"ibnetdiscover": IBNET.read_text()}, headers=tech
    )
    c.answers[("PUT", "/api/v1/ib-fabric")] = await r.json()
    f = tmp_path / "ibnet.txt"
    f.write_text(IBNET.read_text())
    ns = argparse.Namespace(output=None, json=False, file=str(f))
    ctl.ib_upload(ns, c)  # type: ignore[arg-type]
    assert calls[-1][2] == {"ibnetdiscover": IBNET.read_text()}
    assert "72 host ports on 2 switches; 72 machine(s) changed leaf; leaf-a: 36, leaf-b: 36" in (
        capsys.readouterr().out
    )
    r = await client.get("/api/v1/nvlink-domains", headers=tech)
    c.answers[("GET", "/api/v1/nvlink-domains")] = await r.json()
    ctl.nvlink_domains(argparse.Namespace(output=None, json=False, domain=None), c)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "DOMAIN" in out and nvl72.domain_id(3) in out and "rack3" in out
    ctl.nvlink_domains(argparse.Namespace(output=None, json=False, domain="00000002"), c)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.startswith(f"domain {nvl72.domain_id(1)}: 18 trays, 18 free, racks rack1")
    assert "nvl1-t17" in out and "leaf-a" in out
    assert ctl_claims.topology is ctl  # claims topology prints through this module
