"""A claim's own OS configuration through the API, on both backends: the tenant's user-data
(served byte for byte to the machine's own agent token only, never shown again, never in
events or logs), metald's vendor-data beside it, static addresses from metald's pools (taken
with the claim, given back with the machines) and a storage layout checked per machine."""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

import pytest
from sqlmodel import select

from api.app import CTX_KEY
from metald.auth import issue_token
from metald.claims.allocation import claim_replacement
from metald.config import NetworkPoolConfig
from metald.lifecycle import State
from metald.provision import netboot
from metald.store.models import Claim, ClaimUserData, Event, IpAllocation, Machine, Nic
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DEPLOY, DISK_SPEC, inventory

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGJ0ZXN0a2V5 ops@example"
SECRET = "s3cr3t-tenant-password-7f1c"
USER_DATA = (
    "#cloud-config\n"
    "write_files:\n"
    "  - path: /etc/tenant-marker\n"
    f"    content: {SECRET}\n"
    "package_update: false\n"
    "packages: [htop]\n"
)
GIB = 1 << 30
NETWORK = {
    "bonds": [
        {"name": "bond0", "mode": "active-backup", "nics": [{"role": "data:0"}, {"role": "data:1"}]}
    ],
    "vlans": [{"link": "bond0", "network": "tenant", "default_route": True}],
    "pxe_dhcp": False,
}
STORAGE = {
    "root": {"raid": 1, "disks": [{"size": ">= 100"}, {"size": ">= 100"}]},
    "volumes": [{"name": "scratch", "raid": 0, "disks": "rest", "fs": "xfs", "mount": "/scratch"}],
}


def _agent(store, machine_id: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with store.session() as s:
        _row, secret = issue_token(s, name="agent", role="agent", scope=[machine_id])
    return {"Authorization": f"Bearer {secret}"}


def _add_machines(store, n: int, pool: str, label: str = "") -> list[str]:  # type: ignore[no-untyped-def]
    """Ready machines with 3 NICs (PXE + 2 data) and 4 disks (2 x 200 GiB, 2 x 1 TiB)."""
    ids = []
    with store.session() as s:
        for i in range(n):
            inv = inventory(
                {"sda": 200 * GIB, "sdb": 200 * GIB, "nvme0n1": 1024 * GIB, "nvme1n1": 1024 * GIB}
            )
            tag = zlib.crc32(pool.encode()) & 0xFF
            macs = [f"52:54:00:{tag:02x}:{i:02x}:{k:02x}" for k in range(3)]
            inv["payload"]["nics"] = [
                {"name": f"en{k}", "mac": mac, "pci_address": f"0000:0{k}:00.0"}
                for k, mac in enumerate(macs)
            ]
            m = Machine(
                name=f"{pool}{i}",
                state=State.READY.value,
                gpu_model="NVIDIA H100",
                gpu_count=8,
                memory_mb=1 << 20,
                labels={"pool": label or pool},
                inventory=inv,
            )
            s.add(m)
            s.flush()
            s.add(Nic(machine_id=m.id, mac=macs[0], name="en0", pxe=True))
            ids.append(m.id)
        s.commit()
    return ids


async def _setup(client, tokens) -> str:  # type: ignore[no-untyped-def]
    ctx = client.server.app[CTX_KEY]
    use_services(ctx, bmc=FakeBmc(power_state="off"))
    ctx.cfg.provision.networks = {
        "tenant": NetworkPoolConfig(
            cidr="10.20.0.0/29", gateway="10.20.0.1", dns=["10.20.0.1"], vlan=42, mtu=9000
        )
    }
    r = await client.post(
        "/api/v1/images",
        json={"name": "deb12", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("admin"),
    )
    assert r.status == 201, await r.text()
    return str((await r.json())["id"])


def _body(tenant: str, image: str, pool: str, **extra: Any) -> dict[str, Any]:
    return {
        "tenant_id": tenant,
        "count": 1,
        "selector": {"labels": {"pool": pool}},
        "image_id": image,
        "ssh_authorized_keys": [KEY],
        **extra,
    }


async def test_user_data_network_storage_served_to_the_machine_only(  # type: ignore[no-untyped-def]
    api, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    client, tokens, store = api
    image = await _setup(client, tokens)
    (a,) = _add_machines(store, 1, "a")
    (b,) = _add_machines(store, 1, "b")
    orch_a, orch_b = tokens.header("orchestrator"), tokens.header("orchestrator_other")
    r = await client.post(
        "/api/v1/claims",
        headers=orch_a,
        json=_body(
            tokens.tenant_a,
            image,
            "a",
            user_data=USER_DATA,
            meta_data={"rack": "r1"},
            network=NETWORK,
            storage=STORAGE,
        ),
    )
    assert r.status == 201, await r.text()
    claim_a = await r.json()
    assert SECRET not in json.dumps(claim_a)
    assert claim_a["user_data"]["form"] == "cloud-config"
    assert claim_a["user_data"]["size"] == len(USER_DATA)
    assert claim_a["addresses"] == {
        a: [{"network": "tenant", "interface": "bond0.42", "address": "10.20.0.2"}]
    }
    other_ud = "#!/bin/sh\necho tenant-b > /root/b\n"
    r = await client.post(
        "/api/v1/claims",
        headers=orch_b,
        json=_body(tokens.tenant_b, image, "b", user_data=other_ud),
    )
    assert r.status == 201, await r.text()
    claim_b = await r.json()
    await drain_steps(client)

    # The machine's own agent token gets the user-data byte for byte, metald's beside it.
    r = await client.get("/api/v1/agent/provision", headers=_agent(store, a))
    todo = await r.json()
    seed = todo["nocloud"]
    assert seed["user-data"] == USER_DATA
    vendor = json.loads(seed["vendor-data"].split("\n", 1)[1])
    assert vendor["ssh_authorized_keys"] == [KEY] and vendor["hostname"] == "a0"
    meta = json.loads(seed["meta-data"])
    assert meta == {"rack": "r1", "instance-id": a, "local-hostname": "a0"}
    net = json.loads(seed["network-config"])
    assert net["bonds"]["bond0"]["interfaces"] == ["en1", "en2"]
    assert net["vlans"]["bond0.42"]["addresses"] == ["10.20.0.2/29"]
    assert "en0" not in net["ethernets"] and "pxe0" not in net["ethernets"]
    assert todo["storage"]["root"] == ["sda", "sdb"] and todo["storage"]["root_raid"] == 1
    assert todo["storage"]["volumes"][0]["devices"] == ["nvme0n1", "nvme1n1"]

    # One machine's own user-data replaces the claim's for it (tenant B cannot set it).
    own = f"#cloud-config\nruncmd: [[echo, {SECRET}-own]]\n"
    path = f"/api/v1/claims/{claim_a['id']}/machines/{a}/user-data"
    r = await client.put(path, headers=orch_b, json={"user_data": "#!/bin/sh\n"})
    assert r.status == 404
    r = await client.put(path, headers=orch_a, json={"user_data": "#cloud-config\nruncmd: 1\n"})
    assert r.status == 422 and "runcmd" in (await r.json())["detail"]
    r = await client.put(path, headers=orch_a, json={"user_data": own})
    assert r.status == 200, await r.text()
    assert (await r.json())["user_data"]["machines"] == [a] and SECRET not in await r.text()
    r = await client.get("/api/v1/agent/provision", headers=_agent(store, a))
    assert (await r.json())["nocloud"]["user-data"] == own
    r = await client.put(path, headers=orch_a, json={"user_data": None})
    r = await client.get("/api/v1/agent/provision", headers=_agent(store, a))
    assert (await r.json())["nocloud"]["user-data"] == USER_DATA

    # Another claim's machine gets its own, never A's; A's claim is absent for tenant B.
    r = await client.get("/api/v1/agent/provision", headers=_agent(store, b))
    seed_b = (await r.json())["nocloud"]
    assert seed_b["user-data"] == other_ud and SECRET not in json.dumps(seed_b)
    r = await client.get(f"/api/v1/claims/{claim_a['id']}", headers=orch_b)
    assert r.status == 404
    for who in ("orchestrator", "technician", "admin"):
        r = await client.get(f"/api/v1/claims/{claim_a['id']}", headers=tokens.header(who))
        assert r.status == 200 and SECRET not in await r.text()
    r = await client.get("/api/v1/events?limit=500", headers=tokens.header("admin"))
    assert SECRET not in await r.text()
    with store.session() as s:
        for ev in s.exec(select(Event)):
            assert SECRET not in json.dumps(ev.data) + (ev.reason or "")
    assert SECRET not in caplog.text

    # A machine that joins the claim later (a remediation's replacement) takes its address
    # when it provisions.
    (late,) = _add_machines(store, 1, "late", label="a")
    with store.session() as s:
        c = s.get(Claim, claim_a["id"])
        assert claim_replacement(s, c, "test", reason="replacement", deploy=DEPLOY) is not None
        s.commit()
        assert netboot.start_provisioning(s, [late], actor="test") == [late]
    r = await client.get("/api/v1/agent/provision", headers=_agent(store, late))
    net = json.loads((await r.json())["nocloud"]["network-config"])
    assert net["vlans"]["bond0.42"]["addresses"] == ["10.20.0.3/29"]
    r = await client.get("/api/v1/agent/provision", headers=_agent(store, late))
    assert json.loads((await r.json())["nocloud"]["network-config"]) == net  # the same one

    # Release: the addresses go back to the pool.
    r = await client.post(f"/api/v1/claims/{claim_a['id']}/release", headers=orch_a)
    assert r.status == 200, await r.text()
    with store.session() as s:
        assert s.exec(select(IpAllocation)).all() == []
        # The released claim's user-data is erased; its digest stays.
        rows = s.exec(select(ClaimUserData).where(ClaimUserData.claim_id == claim_a["id"]))
        assert [(r.user_data, r.sha256) for r in rows] == [(None, claim_a["user_data"]["sha256"])]
    assert claim_b["addresses"] == {}


async def test_refusals_say_why_and_take_nothing(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    image = await _setup(client, tokens)
    ids = _add_machines(store, 2, "a")
    orch = tokens.header("orchestrator")

    async def refused(**extra: Any) -> str:
        r = await client.post(
            "/api/v1/claims", headers=orch, json=_body(tokens.tenant_a, image, "a", **extra)
        )
        assert r.status == 422, await r.text()
        return str((await r.json())["detail"])

    assert "packages: 'htop' is not of type 'array'" in await refused(
        user_data="#cloud-config\npackages: htop\n"
    )
    assert "must start with #cloud-config" in await refused(user_data="hello\n")
    assert "more than the 65536 allowed" in await refused(user_data="#!/bin/sh\n" + "#" * 70000)
    assert "may not set instance-id" in await refused(meta_data={"instance-id": "x"})
    detail = await refused(storage={"root": {"hints": {"serial": "NOPE"}}})
    assert "storage layout does not fit machine" in detail and "no disk matches" in detail
    detail = await refused(
        storage={
            "root": {"raid": 1},
            "volumes": [{"name": "scratch", "raid": 0, "disks": [{"size": 1024}]}],
        }
    )
    assert "volume scratch" in detail and "needs 2+ disks" in detail
    assert "no network 'storage'" in await refused(
        network={"ethernets": [{"nic": {"role": "data"}, "network": "storage"}]}
    )
    # The /29 has 5 addresses to hand out (gateway excluded): two machines x three VLANs fit
    # only partly, and nothing of the claim stays.
    req = {"vlans": [{"link": "en1", "id": i, "network": "tenant"} for i in (10, 11, 12)]}
    detail = await refused(count=2, network=req)
    assert "no free address left" in detail
    with store.session() as s:
        assert s.exec(select(IpAllocation)).all() == []
        assert {s.get(Machine, i).state for i in ids} == {"ready"}  # type: ignore[union-attr]

    # The same idempotency key with other user-data is another request: 409, nothing changes.
    again = _body(tokens.tenant_a, image, "a", user_data=USER_DATA, idempotency_key="k1")
    r = await client.post("/api/v1/claims", headers=orch, json=again)
    assert r.status == 201, await r.text()
    r = await client.post("/api/v1/claims", headers=orch, json=again)
    assert r.status == 201 and (await r.json())["replayed"]
    r = await client.post(
        "/api/v1/claims", headers=orch, json={**again, "user_data": "#!/bin/sh\n"}
    )
    assert r.status == 409 and "different request" in (await r.json())["detail"]


async def test_other_forms(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    image = await _setup(client, tokens)
    forms = {
        "script": "#!/bin/sh\ntouch /x\n",
        "multipart": 'Content-Type: multipart/mixed; boundary="B"\nMIME-Version: 1.0\n\n--B\n'
        "Content-Type: text/cloud-config\n\nruncmd: [[touch, /y]]\n--B--\n",
    }
    for form, ud in forms.items():
        (m,) = _add_machines(store, 1, form)
        r = await client.post(
            "/api/v1/claims",
            headers=tokens.header("orchestrator"),
            json=_body(tokens.tenant_a, image, form, user_data=ud),
        )
        assert r.status == 201, await r.text()
        assert (await r.json())["user_data"]["form"] == form
        await drain_steps(client)
        r = await client.get("/api/v1/agent/provision", headers=_agent(store, m))
        assert (await r.json())["nocloud"]["user-data"] == ud


async def test_concurrent_claims_never_share_an_address(api) -> None:  # type: ignore[no-untyped-def]
    """Six claims at once on one pool (on PostgreSQL: concurrent transactions): six different
    addresses; the loser of a race on one runs its whole claim again."""
    import asyncio

    client, tokens, store = api
    image = await _setup(client, tokens)
    _add_machines(store, 6, "c")
    net = {"ethernets": [{"nic": {"role": "data"}, "network": "tenant"}]}

    async def one(i: int) -> dict[str, Any]:
        r = await client.post(
            "/api/v1/claims",
            headers=tokens.header("orchestrator"),
            json=_body(tokens.tenant_a, image, "c", network=net, idempotency_key=f"k{i}"),
        )
        assert r.status == 201, await r.text()
        return dict(await r.json())

    claims = await asyncio.gather(*(one(i) for i in range(5)))
    got = [a["address"] for c in claims for addrs in c["addresses"].values() for a in addrs]
    assert sorted(got) == [f"10.20.0.{i}" for i in range(2, 7)]
    r = await client.post(
        "/api/v1/claims",
        headers=tokens.header("orchestrator"),
        json=_body(tokens.tenant_a, image, "c", network=net),
    )
    assert r.status == 422 and "no free address left" in (await r.json())["detail"]


def test_overlapping_pools_are_a_config_error() -> None:
    from pydantic import ValidationError

    from metald.config import ProvisionConfig

    with pytest.raises(ValidationError, match=r"networks.a \(10.0.0.0/24\) and .b .* overlap"):
        ProvisionConfig(networks={"a": {"cidr": "10.0.0.0/24"}, "b": {"cidr": "10.0.0.128/25"}})
    with pytest.raises(ValidationError, match="10.9.0.1 is not in 10.0.0.0/24"):
        ProvisionConfig(networks={"a": {"cidr": "10.0.0.0/24", "gateway": "10.9.0.1"}})
