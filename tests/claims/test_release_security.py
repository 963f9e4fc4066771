"""Release, wipe and agent tokens against a hostile tenant (issue 11): the tenant's node keeps
running after release and holds its lease; it must not be able to end the wipe of its own
machine, nor use an agent token outside the phase and boot it was minted for; a machine
marked broken during a claim leaves with the claim and reaches ready only wiped."""

from __future__ import annotations

from typing import Any

from sqlmodel import col, select

from api.app import CTX_KEY
from metald.auth import issue_token
from metald.boot.machine_hooks import StoreBootHooks
from metald.config import EnrollConfig
from metald.enrollment import enrollment_boot_hooks
from metald.provision import netboot
from metald.store.models import ApiToken, Event, Machine, Nic
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import DISK_SPEC, add_ready, boot_token, wipe_evidence
from tests.dhcp_leases import add_lease

NODE_IP = "10.0.0.42"


def _machine(store, machine_id: str) -> Machine:  # type: ignore[no-untyped-def]
    with store.session() as s:
        m = s.get(Machine, machine_id)
        assert m is not None
        return m


def _events(store, machine_id: str, kind: str) -> list[Event]:  # type: ignore[no-untyped-def]
    with store.session() as s:
        return list(
            s.exec(
                select(Event)
                .where(Event.machine_id == machine_id, Event.kind == kind)
                .order_by(col(Event.id))
            ).all()
        )


def _bearer(secret: str | None) -> dict[str, str]:
    assert secret
    return {"Authorization": f"Bearer {secret}"}


async def _claimed_machine(client, tokens, store, bmc: FakeBmc | None) -> tuple[str, str, str]:  # type: ignore[no-untyped-def]
    """One machine claimed for tenant A and provisioned, with a NIC whose lease its node holds.
    Returns (claim id, machine id, MAC)."""
    ctx = client.server.app[CTX_KEY]
    if bmc is not None:
        use_services(ctx, bmc=bmc)
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("admin"),
    )
    image_id = (await r.json())["id"]
    (mid,) = add_ready(store, 1, gpu_model="NVIDIA B200", prefix="sec")
    mac = "52:54:00:5e:c0:01"
    with store.session() as s:
        s.add(Nic(machine_id=mid, mac=mac, pxe=True))
        s.commit()
    add_lease(store, mac, NODE_IP)
    r = await client.post(
        "/api/v1/claims",
        json={
            "tenant_id": tokens.tenant_a,
            "count": 1,
            "selector": {"gpu_model": "NVIDIA B200"},
            "image_id": image_id,
        },
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 201, await r.text()
    claim = await r.json()
    await drain_steps(client)
    deploy = _bearer(boot_token(store, mid))
    r = await client.post(
        "/api/v1/agent/progress", json={"phase": "verify", "done": True}, headers=deploy
    )
    assert (await r.json())["state"] == "provisioned"
    return claim["id"], mid, mac


def _hooks(store) -> StoreBootHooks:  # type: ignore[no-untyped-def]
    return enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=True)


async def test_the_tenant_cannot_end_the_wipe_of_its_own_machine(api) -> None:  # type: ignore[no-untyped-def]
    """Release moves the machine to wiping at once, but its boot is armed only after the BMC
    reported it off: until then the tenant's node, still running and holding its lease, gets
    the wipe script without a token. A forged done from any token not of that boot is 403; a
    done without evidence for the recorded disks is 409; neither makes it ready."""
    client, tokens, store = api
    bmc = FakeBmc(power_state="on")
    claim_id, mid, mac = await _claimed_machine(client, tokens, store, bmc=None)
    hooks = _hooks(store)

    r = await client.post(
        f"/api/v1/claims/{claim_id}/release", headers=tokens.header("orchestrator")
    )
    assert r.status == 200
    assert _machine(store, mid).state == "wiping"
    # The BMC step has not run (no BMC yet): the tenant's node asks for its script.
    target = await hooks.boot_target(mac, client=NODE_IP)
    assert target.action.value == "wipe" and "metald.token" not in target.kernel_args
    (refetch,) = _events(store, mid, "boot.script_refetched")
    assert refetch.data and refetch.data["client"] == NODE_IP

    # A token metald did not hand out with the wipe boot's script (here one an admin issued
    # for the machine, in its wipe phase) cannot end the wipe: 403 problem+json.
    with store.session() as s:
        _row, forged = issue_token(s, name="forged", role="agent", scope=[mid])
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers=_bearer(forged),
    )
    assert r.status == 403, await r.text()
    assert r.headers["Content-Type"].startswith("application/problem+json")
    assert "wipe boot metald started" in (await r.json())["detail"]
    assert _machine(store, mid).state == "wiping"

    # Now metald takes the machine: off (confirmed), PXE, armed, on.
    use_services(client.server.app[CTX_KEY], bmc=bmc)
    assert await netboot.boot_from_network(store, bmc, mid, actor="t")
    assert [c[1:] for c in bmc.calls] == [
        ("power", "status"),
        ("power", "off"),
        ("power", "status"),
        ("boot", "pxe"),
        ("power", "on"),
    ]
    # The first script of that boot carries the wipe token; the second does not.
    first = await hooks.boot_target(mac, client=NODE_IP)
    wipe = _bearer(first.kernel_args["metald.token"])
    again = await hooks.boot_target(mac, client=NODE_IP)
    assert "metald.token" not in again.kernel_args
    assert len(_events(store, mid, "boot.script_refetched")) == 2

    # Even the right token needs evidence: none, one disk short, a wrong size: 409.
    for disks, phrase in (
        (None, "no per-disk evidence"),
        (wipe_evidence()[:1], "/dev/nvme1n1 (3840755982336 bytes, recorded at inspection)"),
        ([{**d, "size_bytes": 1 << 30} for d in wipe_evidence()], "inspection recorded"),
        ([{**d, "reads": []} for d in wipe_evidence()], "no zero read of its first"),
    ):
        body: dict[str, Any] = {"phase": "wipe", "done": True}
        if disks is not None:
            body["disks"] = disks
        r = await client.post("/api/v1/agent/progress", json=body, headers=wipe)
        assert r.status == 409, await r.text()
        assert phrase in (await r.json())["detail"]
        assert _machine(store, mid).state == "wiping"
    assert len(_events(store, mid, "wipe.refused")) == 5

    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers=wipe,
    )
    assert r.status == 200 and (await r.json())["state"] == "ready"
    m = _machine(store, mid)
    assert (m.tenant_id, m.claim_id, m.wipe_required) == (None, None, False)
    (accepted,) = [
        e
        for e in _events(store, mid, "provision.progress")
        if (e.data or {}).get("done") and (e.data or {}).get("phase") == "wipe"
    ]
    assert [d["device"] for d in accepted.data["disks"]] == ["/dev/nvme0n1", "/dev/nvme1n1"]  # type: ignore[index]


async def test_without_a_bmc_only_a_technician_returns_it_to_ready(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    claim_id, mid, mac = await _claimed_machine(client, tokens, store, bmc=FakeBmc())
    use_services(client.server.app[CTX_KEY], bmc=FakeBmc(fail="absent"))
    r = await client.post(
        f"/api/v1/claims/{claim_id}/release", headers=tokens.header("orchestrator")
    )
    assert r.status == 200
    await drain_steps(client)
    assert _events(store, mid, "provision.no-bmc")
    # Nothing armed: the script never carries a token, so no agent can report the wipe done.
    assert "metald.token" not in (await _hooks(store).boot_target(mac, client=NODE_IP)).kernel_args
    assert boot_token(store, mid) is None
    assert _machine(store, mid).state == "wiping"

    body = {"reason": "disks shredded on the bench, ticket 4711"}
    r = await client.post(
        f"/api/v1/machines/{mid}/confirm-wipe", json=body, headers=tokens.header("orchestrator")
    )
    assert r.status == 403
    r = await client.post(
        f"/api/v1/machines/{mid}/confirm-wipe", json={}, headers=tokens.header("technician")
    )
    assert r.status == 422  # a reason is required
    r = await client.post(
        f"/api/v1/machines/{mid}/confirm-wipe", json=body, headers=tokens.header("technician")
    )
    assert r.status == 200 and (await r.json())["state"] == "ready", await r.text()
    r = await client.post(
        f"/api/v1/machines/{mid}/confirm-wipe", json=body, headers=tokens.header("technician")
    )
    assert r.status == 409  # ready now, and it owes no wipe: nothing to confirm
    (ev,) = _events(store, mid, "machine.wipe-confirmed")
    assert ev.actor == "technician:technician" and ev.reason == body["reason"]
    assert ev.data and ev.data["claim_id"] == claim_id
    m = _machine(store, mid)
    assert (m.tenant_id, m.claim_id, m.wipe_required) == (None, None, False)


async def test_a_discovery_token_is_worthless_once_the_machine_is_claimed(api) -> None:  # type: ignore[no-untyped-def]
    """Agent tokens are bound to the phase they were minted for: the claim revokes the
    discovery image's token, and a token of another phase is refused by the endpoint even
    where it is live (no join token is issued)."""
    client, tokens, store = api
    (mid,) = add_ready(store, 1, gpu_model="NVIDIA B200", prefix="disc")
    with store.session() as s:
        _row, discovery = issue_token(s, name="disc", role="agent", scope=[mid])
    r = await client.post(
        f"/api/v1/tenants/{tokens.tenant_a}/hub",
        json={"endpoint_host": "10.99.0.1"},
        headers=tokens.header("admin"),
    )
    assert r.status == 201
    r = await client.post(
        "/api/v1/images",
        json={"name": "node", "kind": "disk", **DISK_SPEC},
        headers=tokens.header("admin"),
    )
    r = await client.post(
        "/api/v1/claims",
        json={
            "tenant_id": tokens.tenant_a,
            "count": 1,
            "selector": {"gpu_model": "NVIDIA B200"},
            "image_id": (await r.json())["id"],
        },
        headers=tokens.header("orchestrator"),
    )
    assert r.status == 201
    claim_id = (await r.json())["id"]
    r = await client.get("/api/v1/agent/provision", headers=_bearer(discovery))
    assert r.status == 401  # revoked when the machine left the inspect phase
    # A live token of the inspect phase (minted by hand here) is refused by the phase check.
    with store.session() as s:
        _row, stale = issue_token(s, name="stale", role="agent", scope=[mid], phase="inspect")
    r = await client.get("/api/v1/agent/provision", headers=_bearer(stale))
    assert r.status == 409 and "minted for the inspect phase" in (await r.json())["detail"]
    r = await client.post(
        "/api/v1/agent/progress", json={"phase": "write", "percent": 1}, headers=_bearer(stale)
    )
    assert r.status == 409
    with store.session() as s:
        from metald.store.models import JoinToken

        assert not s.exec(select(JoinToken).where(JoinToken.machine_id == mid)).all()
    # The provisioning token in turn dies with the release (phase wipe).
    provision = _bearer(boot_token(store, mid))
    assert (await client.get("/api/v1/agent/provision", headers=provision)).status == 200
    r = await client.post(
        f"/api/v1/claims/{claim_id}/release", headers=tokens.header("orchestrator")
    )
    assert r.status == 200
    assert (await client.get("/api/v1/agent/provision", headers=provision)).status == 401


async def test_a_machine_broken_during_a_claim_leaves_with_it_and_must_be_wiped(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    bmc = FakeBmc()
    claim_id, mid, mac = await _claimed_machine(client, tokens, store, bmc=bmc)
    tech = tokens.header("technician")

    async def act(action: str) -> Any:
        return await client.post(
            f"/api/v1/machines/{mid}/actions", json={"action": action}, headers=tech
        )

    assert (await (await act("mark-broken")).json())["state"] == "broken"
    r = await act("repair")
    assert r.status == 409 and "belongs to a tenant" in (await r.json())["detail"]
    r = await act("retire")
    assert r.status == 409

    r = await client.post(
        f"/api/v1/claims/{claim_id}/release", headers=tokens.header("orchestrator")
    )
    assert (await r.json())["state"] == "released"
    m = _machine(store, mid)
    assert (m.state, m.tenant_id, m.wipe_required) == ("broken", None, True)
    assert _events(store, mid, "machine.detached")
    with store.session() as s:
        live = s.exec(
            select(ApiToken).where(ApiToken.machine_id == mid, col(ApiToken.revoked_at).is_(None))
        ).all()
        assert not live

    assert (await (await act("repair")).json())["state"] == "maintenance"
    r = await act("maintenance-off")
    assert r.status == 409 and "has not been wiped" in (await r.json())["detail"]
    r = await act("inspect")
    assert r.status == 409  # re-inspection does not launder it either
    assert _machine(store, mid).state == "maintenance"

    bmc.calls.clear()
    r = await client.post(f"/api/v1/machines/{mid}/wipe", json={}, headers=tech)
    assert r.status == 200 and (await r.json())["state"] == "wiping", await r.text()
    await drain_steps(client)
    assert (mid, "power", "on") in bmc.calls
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "done": True, "disks": wipe_evidence()},
        headers=_bearer(boot_token(store, mid)),
    )
    assert (await r.json())["state"] == "ready"
    assert _machine(store, mid).claim_id is None


async def test_a_failed_wipe_does_not_return_to_ready_through_maintenance(api) -> None:  # type: ignore[no-untyped-def]
    client, tokens, store = api
    claim_id, mid, _mac = await _claimed_machine(client, tokens, store, bmc=FakeBmc())
    await client.post(f"/api/v1/claims/{claim_id}/release", headers=tokens.header("orchestrator"))
    await drain_steps(client)
    r = await client.post(
        "/api/v1/agent/progress",
        json={"phase": "wipe", "error": "nvme0n1: I/O error"},
        headers=_bearer(boot_token(store, mid)),
    )
    assert (await r.json())["state"] == "wipe-failed"
    tech = tokens.header("technician")
    for action, status in (("maintenance-on", 200), ("maintenance-off", 409)):
        r = await client.post(
            f"/api/v1/machines/{mid}/actions", json={"action": action}, headers=tech
        )
        assert r.status == status, (action, await r.text())
    assert _machine(store, mid).state == "maintenance"


async def test_unknown_macs_create_nothing(api) -> None:  # type: ignore[no-untyped-def]
    """A script request for a random MAC: refused in leased mode, token-less in any mode, and
    neither writes a machine, an event or a token."""
    client, _tokens, store = api

    def counts() -> tuple[int, int, int]:
        with store.session() as s:
            return tuple(  # type: ignore[return-value]
                len(s.exec(select(t)).all()) for t in (Machine, Event, ApiToken)
            )

    before = counts()
    from metald.boot.hooks import ScriptRefused

    try:
        await _hooks(store).boot_target("52:54:00:de:ad:01", client="10.0.0.99")
        raise AssertionError("not refused")
    except ScriptRefused:
        pass
    anyone = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=False)
    t = await anyone.boot_target("52:54:00:de:ad:02", client="10.0.0.99")
    assert t.action.value == "discovery" and "metald.token" not in t.kernel_args
    assert counts() == before
    # The lease holder of an unknown MAC is enrolled (metald's DHCP saw it).
    add_lease(store, "52:54:00:de:ad:03", "10.0.0.77")
    t = await _hooks(store).boot_target("52:54:00:de:ad:03", client="10.0.0.77")
    assert "metald.token" in t.kernel_args


async def test_a_forged_wipe_done_is_refused(api) -> None:  # type: ignore[no-untyped-def]
    """The plain forgery: a wiping machine's token that did not come with the wipe boot's
    script posts ``{"phase": "wipe", "done": true}``: 403 problem+json, still wiping."""
    client, tokens, store = api
    claim_id, mid, _mac = await _claimed_machine(client, tokens, store, bmc=FakeBmc())
    await client.post(f"/api/v1/claims/{claim_id}/release", headers=tokens.header("orchestrator"))
    await drain_steps(client)
    with store.session() as s:
        _row, forged = issue_token(s, name="agent", role="agent", scope=[mid])
    r = await client.post(
        "/api/v1/agent/progress", json={"phase": "wipe", "done": True}, headers=_bearer(forged)
    )
    assert r.status == 403
    assert r.headers["Content-Type"].startswith("application/problem+json")
    assert _machine(store, mid).state == "wiping"
