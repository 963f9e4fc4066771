"""Tenant fabric partitions: PKey allocation, port GUIDs from inventory, the claim events, the
fabric route and ``metalctl tenants fabric``, and the OpenSM fragment checked by OpenSM itself
(opensm against an ibsim-simulated InfiniBand fabric, in a network namespace of this test)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from sqlmodel import col, select

from metald.store.models import Event, Machine, Tenant
from metald.tenants import fabric, ipam
from netconfig import netns
from tests.claims.helpers import add_ready


def test_pkeys_are_the_lowest_free_in_range_and_never_held_twice() -> None:
    assert ipam.allocate_pkey([]) == 0x0001
    assert ipam.allocate_pkey([1, 2, None, 4]) == 3
    with pytest.raises(ipam.IpamExhausted):
        ipam.allocate_pkey(range(1, 0x7FFF))
    with pytest.raises(ValueError):
        ipam.allocate_pkey([], 0, 5)  # 0x0000 is no partition
    with pytest.raises(ValueError):
        ipam.allocate_pkey([], 1, 0x7FFF)  # the default partition is nobody's


def test_port_guids_from_inventory_are_normalised_and_checked() -> None:
    inv = {
        "infiniband": [
            {"port_guid": "0x0002C90300001234"},
            {"port_guid": "0002:c903:0000:1235"},
            {"port_guid": "0x0002c90300001234"},  # twice: once
            {"port_guid": "0x12; rm -rf /"},  # not a GUID: dropped
            "nonsense",
        ]
    }
    assert fabric.port_guids(inv) == ["0x0002c90300001234", "0x0002c90300001235"]
    assert fabric.port_guids(None) == [] and fabric.port_guids({"infiniband": "x"}) == []


def test_partitions_fragment() -> None:
    text = fabric.partitions_conf("acme corp", 0x12, 100, {"m1": ["0x0002c90300001234"], "m2": []})
    assert text.splitlines() == [
        "# metald tenant acme corp: PKey 0x0012, VLAN 100, 2 machine(s), 1 port(s)",
        "# machine m2: no InfiniBand port GUID in its inventory",
        "acme_corp_0012=0x0012, ipoib, defmember=full : 0x0002c90300001234=full ;",
    ]
    assert fabric.partitions_conf("x", 1, None, {}).endswith(
        "x_0001=0x0001, ipoib, defmember=full : ;\n"
    )
    with pytest.raises(ValueError):
        fabric.partitions_conf("x", 0x7FFF, None, {})


async def test_tenants_get_pkeys_and_claim_events_carry_the_fabric(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    admin, orch = tokens.header("admin"), tokens.header("orchestrator")
    r = await client.post("/api/v1/tenants", json={"name": "initech"}, headers=admin)
    assert r.status == 201, await r.text()
    new_id = (await r.json())["id"]
    with store.session() as s:
        pkeys = {t.name: t.pkey for t in s.exec(select(Tenant))}
    assert pkeys["initech"] is not None and pkeys["initech"] >= 1
    # acme (seeded before PKeys existed) gets the next free one when it is first asked for.
    r = await client.get(f"/api/v1/tenants/{tokens.tenant_a}/fabric", headers=orch)
    assert r.status == 200, await r.text()
    fab = await r.json()
    assert fab["pkey"] not in (None, pkeys["initech"])
    r = await client.get(f"/api/v1/tenants/{new_id}/fabric", headers=orch)
    assert r.status == 404  # not this orchestrator's tenant

    ids = add_ready(store, 2, labels={"pool": "ib"})
    with store.session() as s:
        m = s.get(Machine, ids[0])
        assert m is not None
        m.inventory = {"schema_version": 1, "infiniband": [{"port_guid": "0x0002c90300000a01"}]}
        s.add(m)
        s.commit()
    r = await client.post(
        "/api/v1/images",
        json={"name": "n", "kind": "stateless", "kernel": "n/vmlinuz", "initrd": "n/initrd"},
        headers=tokens.header("technician"),
    )
    image = (await r.json())["id"]
    r = await client.post(
        "/api/v1/claims",
        json={
            "tenant_id": tokens.tenant_a,
            "count": 2,
            "selector": {"labels": {"pool": "ib"}},
            "image_id": image,
        },
        headers=orch,
    )
    assert r.status == 201, await r.text()
    with store.session() as s:
        ev = s.exec(
            select(Event).where(Event.kind == "claim.created").order_by(col(Event.id))
        ).all()
    assert ev, "no claim.created event"
    net = ev[-1].data["network"]
    assert net["pkey"] == fab["pkey"] and "vlan" in net
    guids = {p["machine_id"]: p["port_guids"] for p in net["ports"]}
    assert guids == {ids[0]: ["0x0002c90300000a01"], ids[1]: []}
    r = await client.get(f"/api/v1/tenants/{tokens.tenant_a}/fabric", headers=orch)
    conf = (await r.json())["partitions_conf"]
    assert f"=0x{fab['pkey']:04x}, ipoib, defmember=full : 0x0002c90300000a01=full ;" in conf


IBSIM_NET = """Switch 8 "Switch1"
[1] "Hca1"[1]
[2] "Hca2"[1]
[3] "Hca3"[1]

Hca 1 "Hca1"
[1] "Switch1"[1]

Hca 1 "Hca2"
[1] "Switch1"[2]

Hca 1 "Hca3"
[1] "Switch1"[3]
"""
SIM_SO = "/usr/lib/x86_64-linux-gnu/umad2sim/libumad2sim.so"
needs_opensm = pytest.mark.skipif(
    os.geteuid() != 0
    or not (shutil.which("opensm") and shutil.which("ibsim") and Path(SIM_SO).exists()),
    reason="needs root, opensm and ibsim-utils (scripts/bootstrap installs them)",
)


def _opensm(ns: str, workdir: Path, partitions: Path, log: Path) -> str:
    """One OpenSM sweep (-o) over the simulated fabric; its log."""
    env = dict(os.environ, LD_PRELOAD=SIM_SO, OSM_TMP_DIR=str(workdir), OSM_CACHE_DIR=str(workdir))
    subprocess.run(
        [
            "nsenter",
            f"--net={netns.path(ns)}",
            "opensm",
            "-o",
            "-P",
            str(partitions),
            "-f",
            str(log),
            "-D",
            "0x0f",
        ],
        env=env,
        cwd=workdir,
        capture_output=True,
        timeout=120,
        check=True,
    )
    return log.read_text(errors="replace")


@needs_opensm
def test_opensm_accepts_the_fragment_and_applies_the_partition(tmp_path: Path) -> None:
    ns = f"mtib{os.getpid() % 100000}"
    netns.create(ns)  # ibsim's sockets are abstract: per network namespace, nobody else's
    (tmp_path / "net").write_text(IBSIM_NET)
    sim = subprocess.Popen(
        ["nsenter", f"--net={netns.path(ns)}", "ibsim", "-s", str(tmp_path / "net")],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while (
            b"sim:"
            not in subprocess.run(
                ["nsenter", f"--net={netns.path(ns)}", "ss", "-xl"], capture_output=True
            ).stdout
        ):
            assert time.monotonic() < deadline and sim.poll() is None, "ibsim did not start"
            time.sleep(0.05)
        # First sweep: learn the simulated HCAs' node and port GUIDs.
        (tmp_path / "default.conf").write_text("Default=0x7fff, ipoib : ALL=full ;\n")
        _opensm(ns, tmp_path, tmp_path / "default.conf", tmp_path / "first.log")
        cas = dict(
            (name, (node, port))
            for node, port, name in re.findall(
                r"CA Ports:\S+ SystemGUID:\S+ NodeGUID:([0-9A-F]{16}) PortGUID:([0-9A-F]{16}) \S+ \S+ \S+ \{(Hca\d)\}",
                (tmp_path / "opensm-subnet.lst").read_text(),
            )
        )
        assert set(cas) == {"Hca1", "Hca2", "Hca3"}
        members = {
            "m1": fabric.port_guids({"infiniband": [{"port_guid": cas["Hca1"][1]}]}),
            "m2": fabric.port_guids({"infiniband": [{"port_guid": cas["Hca2"][1]}]}),
        }
        conf = tmp_path / "partitions.conf"
        conf.write_text(
            "Default=0x7fff, ipoib : ALL=full ;\n"
            + fabric.partitions_conf("acme", 0x0012, 100, members)
        )
        log = _opensm(ns, tmp_path, conf, tmp_path / "second.log")
        assert "PARSE ERROR" not in log and "not found" not in log, log[-2000:]
        updated = set(
            re.findall(r"pkey 0x8012 was (?:inserted|updated) for node 0x([0-9a-f]{16}) port", log)
        )
        assert updated == {cas["Hca1"][0].lower(), cas["Hca2"][0].lower()}  # not Hca3's
        # The checker is real: a broken fragment is refused with a parse error.
        conf.write_text(
            conf.read_text().replace(" : ", " ; ", 1).replace("acme_0012=", "acme 0012=")
        )
        assert "PARSE ERROR" in _opensm(ns, tmp_path, conf, tmp_path / "third.log")
    finally:
        sim.kill()
        sim.wait()
        netns.delete(ns)


def test_metalctl_prints_the_fragment(capsys: pytest.CaptureFixture[str]) -> None:
    from metald.metalctl import tenants

    class FakeClient:
        def call(self, method: str, path: str, body: object = None) -> dict:
            assert (method, path) == ("GET", "/api/v1/tenants/t1/fabric")
            return {"partitions_conf": "acme_0012=0x0012, ipoib, defmember=full : ;\n", "pkey": 18}

    import argparse

    tenants.fabric(argparse.Namespace(id="t1", json=False, output=None), FakeClient())  # type: ignore[arg-type]
    assert capsys.readouterr().out == "acme_0012=0x0012, ipoib, defmember=full : ;\n"
