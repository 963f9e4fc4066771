"""The issue's proof on a simulated fleet: 4 GB200 NVL72 domains x 18 trays (inventories from
the real GB200 capture) and an ibsim fabric of two leaves (its ibnetdiscover output sets the
machines' leaves). Claims of 16, 4x9 and 18 trays are packed as asked, an unplaceable one says
how many are free per domain, a leaf pack stays under one leaf, a spread claim covers the
power domains evenly, and a tray whose fabric is not ready is never packed by NVLink."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlmodel import select

from metald import topology
from metald.claims.allocation import Selector, create_claim
from metald.claims.placement import Placement, Unplaceable
from metald.inventory.ibnet import parse_ibnetdiscover
from metald.store import Store
from metald.store.models import Machine
from netconfig import netns
from tests.claims import nvl72
from tests.claims.helpers import DEPLOY, add_image, add_tenant

#: Placement's SQL is the claims' (tested on both backends there and in the first test here):
#: the rest run on SQLite only, to keep make test short.
SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
IBNET = nvl72.ROOT / "tests/fixtures/ib/ibnetdiscover_ibsim-4xnvl72-2-leaves.txt"


def _fleet(store: Store) -> None:
    nvl72.add_fleet(store, IBNET.read_text())
    with store.session() as s:
        out = topology.replace_links(s, parse_ibnetdiscover(IBNET.read_text()))
        s.commit()
    assert out["machines_changed"] == 72 and out["unmatched_ports"] == []
    assert [(x["leaf"], len(x["machines"])) for x in out["leaves"]] == [
        ("leaf-a", 36),
        ("leaf-b", 36),
    ]


def _claim(store: Store, tenant: str, image: str, count: int, **placement: object) -> list[Machine]:
    with store.session() as s:
        c, _ = create_claim(
            s, tenant, count, Selector(gpu_model="NVIDIA GB200"), image, None, "test",
            deploy=DEPLOY, placement=Placement.from_dict(dict(placement), count),
        )  # fmt: skip
        return list(s.exec(select(Machine).where(Machine.claim_id == c.id)).all())


def _domains(ms: list[Machine]) -> Counter[str | None]:
    return Counter(m.nvlink_domain for m in ms)


def test_claims_of_16_4x9_and_18_are_packed_as_asked(store: Store) -> None:
    _fleet(store)
    tenant, image = add_tenant(store, "acme"), add_image(store)
    d = [nvl72.domain_id(i) for i in range(4)]
    # Sorted by name the domains are d0 < d1 < d2 < d3 (uuids 00000001.., 00000002.., ...).
    a = _claim(store, tenant, image, 16, pack="nvlink-domain")
    assert _domains(a) == {d[0]: 16}  # all four whole: the first by name
    b = _claim(store, tenant, image, 36, pack="nvlink-domain", group_size=9)
    # Two groups in each of two whole domains, not one group in the 2 left of d0 (impossible)
    # nor one per domain in three or four domains: d3 stays whole.
    assert _domains(b) == {d[1]: 18, d[2]: 18}
    assert all(n % 9 == 0 for n in _domains(b).values())  # whole groups of 9 per domain
    c = _claim(store, tenant, image, 18, pack="nvlink-domain")
    assert _domains(c) == {d[3]: 18}
    e = _claim(store, tenant, image, 2, pack="nvlink-domain")
    assert _domains(e) == {d[0]: 2}
    with pytest.raises(Unplaceable) as err:
        _claim(store, tenant, image, 1, pack="nvlink-domain")
    assert "no free machine that matches has a nvlink-domain" in str(err.value)


@SQLITE_ONLY
def test_an_unplaceable_claim_says_free_per_domain(store: Store) -> None:
    _fleet(store)
    tenant, image = add_tenant(store, "acme"), add_image(store)
    for _ in range(4):
        _claim(store, tenant, image, 10, pack="nvlink-domain")
    with pytest.raises(Unplaceable) as err:
        _claim(store, tenant, image, 9, pack="nvlink-domain")
    free = {nvl72.domain_id(i): 8 for i in range(4)}
    assert err.value.extra["free_per_domain"] == free
    assert "cannot place 9 machine(s) into one nvlink-domain: free per nvlink-domain: " in str(
        err.value
    )
    # Nothing was written: 32 are still free, and an unplaced claim of 32 still fits.
    assert len(_claim(store, tenant, image, 32)) == 32


@SQLITE_ONLY
def test_leaf_pack_and_power_domain_spread(store: Store) -> None:
    _fleet(store)
    tenant, image = add_tenant(store, "acme"), add_image(store)
    ms = _claim(store, tenant, image, 36, pack="ib-leaf")
    assert Counter(m.ib_leaf for m in ms) == {"leaf-a": 36}
    ms = _claim(store, tenant, image, 8, spread="power-domain")
    per = Counter(m.power_domain for m in ms)
    assert len(per) == 4 and set(per.values()) == {2}  # rack2/3 x pdu0/1, two each


@SQLITE_ONLY
def test_a_tray_with_an_unready_fabric_is_not_packed_by_nvlink(store: Store) -> None:
    _fleet(store)
    missing = nvl72.GB200_XML.with_name(nvl72.GB200_XML.stem + ".EDITED-gpu-missing.xml")
    doc, norm = nvl72.tray_inventory(0, 0, None, missing)
    with store.session() as s:
        m = s.exec(select(Machine).where(Machine.name == nvl72.tray(0, 0))).one()
        for k, v in {**norm.machine_fields(), "inventory": doc}.items():
            setattr(m, k, v)
        s.add(m)
        s.commit()
    assert (m.nvlink_domain, m.nvlink_ready) == (nvl72.domain_id(0), False)
    tenant, image = add_tenant(store, "acme"), add_image(store)
    with pytest.raises(Unplaceable) as err:
        _claim(store, tenant, image, 72, pack="nvlink-domain", group_size=18)
    assert err.value.extra["free_per_domain"][nvl72.domain_id(0)] == 17
    ms = _claim(store, tenant, image, 54, pack="nvlink-domain", group_size=18)
    assert nvl72.domain_id(0) not in _domains(ms)
    with store.session() as s:
        (view,) = [x for x in topology.nvlink_domains(s) if x["domain"] == nvl72.domain_id(0)]
    assert (view["size"], view["free"], view["degraded"]) == (18, 17, [nvl72.tray(0, 0)])


SIM_SO = "/usr/lib/x86_64-linux-gnu/umad2sim/libumad2sim.so"


@pytest.mark.root
@pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ibsim") and shutil.which("ibnetdiscover"))
    or not Path(SIM_SO).exists(),
    reason="needs root and ibsim-utils, infiniband-diags",
)  # fmt: skip
def test_the_fixture_is_what_ibsim_gives_for_the_net(tmp_path: Path) -> None:
    """ibnetdiscover over the live ibsim fabric of nvl72.ibsim_net() equals the committed
    fixture (but for its timestamp line), so the fleet tests read what the simulator shows."""
    ns = f"mtnv{os.getpid() % 100000}"
    netns.create(ns)  # ibsim's sockets are abstract: per network namespace, nobody else's
    (tmp_path / "net").write_text(nvl72.ibsim_net())
    sim = subprocess.Popen(
        netns.exec_argv(ns, ["ibsim", "-s", str(tmp_path / "net")]),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while (
            b"sim:"
            not in subprocess.run(netns.exec_argv(ns, ["ss", "-xl"]), capture_output=True).stdout
        ):
            assert time.monotonic() < deadline and sim.poll() is None, "ibsim did not start"
            time.sleep(0.05)
        out = subprocess.run(
            netns.exec_argv(ns, ["ibnetdiscover"]),
            env=dict(os.environ, LD_PRELOAD=SIM_SO),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        sim.kill()
        sim.wait()
        netns.delete(ns)

    def strip(t: str) -> str:
        return re.sub(r"^# Topology file: generated on .*$", "", t, flags=re.M)

    assert strip(out) == strip(IBNET.read_text())


@SQLITE_ONLY
def test_a_packed_claims_replacement_comes_from_its_domain(store: Store) -> None:
    """Fails on the old code: a replacement was any free machine matching the selector."""
    from metald.claims.allocation import claim_replacement
    from metald.store.models import Claim

    _fleet(store)
    tenant, image = add_tenant(store, "acme"), add_image(store)
    ms = _claim(store, tenant, image, 17, pack="nvlink-domain")
    assert _domains(ms) == {nvl72.domain_id(0): 17}
    with store.session() as s:
        claim = s.get(Claim, ms[0].claim_id)
        assert claim is not None
        got = claim_replacement(s, claim, "test", reason="test", deploy=DEPLOY)
        assert got is not None and got.nvlink_domain == nvl72.domain_id(0)
        s.commit()
        again = claim_replacement(s, claim, "test", reason="test", deploy=DEPLOY)
        assert again is None  # d0 is full; d1-d3 have 54 free trays, in other domains


@SQLITE_ONLY
def test_an_inventory_post_is_matched_with_the_uploaded_fabric(store: Store) -> None:
    """The leaf is set when the agent posts (after the fabric was uploaded), and the NVLink
    columns from its nvidia-smi capture."""
    from metald import enrollment, machines
    from metald.config import EnrollConfig
    from metald.lifecycle import Trigger
    from vmlab.inventory import payload

    with store.session() as s:
        topology.replace_links(s, parse_ibnetdiscover(IBNET.read_text()))
        m = machines.create_machine(s, macs=["52:54:00:12:34:56"], actor="t")
        machines.transition(s, m.id, Trigger.INSPECT, actor="t")
        guid = nvl72.ca_port_guids(IBNET.read_text())[nvl72.tray(3, 4)]
        body = payload(
            machine_id=m.id,
            raw={"nvidia_smi_xml": nvl72.GB200_XML.read_text()},
            infiniband=[{"device": "mlx5_0", "port": 1, "port_guid": guid}],
        )
        got = enrollment.accept_inventory(s, m.id, body, actor="agent", cfg=EnrollConfig())
        assert (got.ib_leaf, got.nvlink_ready) == ("leaf-b", True)
        assert got.nvlink_domain == "00000001-0000-0000-0000-000000000001.2"
