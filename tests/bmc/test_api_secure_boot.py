"""UEFI Secure Boot through the BMC (issue 29, item 1): read, enabled with metald's certificate
enrolled in db, shown, and required by claims; against the lab's Redfish BMC in front of a real
QEMU, over real HTTP. An IPMI BMC (ipmi_sim) has no Secure Boot: 409."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from bootassets.secureboot import new_key
from metald.bmc.redfish import pem_fingerprint
from metald.claims.allocation import Selector, create_claim
from metald.errors import Unprocessable
from metald.store import Store
from metald.store.models import Event, Machine
from tests.api_helpers import link_redfish
from tests.bmc.peers import IpmiSim, LabRedfish
from tests.claims.helpers import DEPLOY, add_image, add_tenant
from vmlab.redfish_secureboot import SECURE_BOOT


@pytest.fixture(scope="module")
def signing_cert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _key, cert = new_key(tmp_path_factory.mktemp("sbkey"))
    return cert


@pytest.fixture
def bmc_settings(signing_cert: Path) -> dict[str, Any]:
    return {"secure_boot_cert": str(signing_cert)}


async def _events(store: Store, kind: str) -> list[Event]:
    return await store.run(lambda s: list(s.exec(select(Event).where(Event.kind == kind)).all()))


async def test_secure_boot_read_enabled_enrolled_and_shown(  # type: ignore[no-untyped-def]
    bmc_api, store: Store, lab_redfish: LabRedfish, signing_cert: Path
) -> None:
    client, tokens, _ = bmc_api
    tech, admin = tokens.header("technician"), tokens.header("admin")
    mid = await link_redfish(
        client, tokens, lab_redfish.port, username=lab_redfish.username,
        password=lab_redfish.password,
    )  # fmt: skip
    r = await client.get(f"/api/v1/machines/{mid}/secure-boot", headers=tech)
    assert r.status == 200, await r.text()
    out = await r.json()
    assert (out["enabled"], out["current_boot"], out["mode"]) == (False, False, "UserMode")
    assert out["certificates"]["db"] == [] and len(out["certificates"]["PK"]) == 1

    # A technician may read but not change it.
    body = {"enable": True, "enroll": True}
    r = await client.post(f"/api/v1/machines/{mid}/secure-boot", json=body, headers=tech)
    assert r.status == 403, await r.text()

    r = await client.post(f"/api/v1/machines/{mid}/secure-boot", json=body, headers=admin)
    assert r.status == 200, await r.text()
    out = await r.json()
    ours = pem_fingerprint(signing_cert.read_text())
    assert out["enrolled"] is True and out["certificates"]["db"] == [ours]
    # Enabled, but the running boot was not verified: that needs the next boot.
    assert out["enabled"] is True and out["current_boot"] is False
    sb = lab_redfish.app[SECURE_BOOT]
    assert sb.enable and [c.fingerprint for c in sb.dbs["db"]] == [ours]
    (ev,) = await _events(store, "bmc.secure-boot-set")
    assert ev.actor != "system" and ev.data["enrolled"] is True

    # Asking again enrolls nothing twice.
    r = await client.post(f"/api/v1/machines/{mid}/secure-boot", json=body, headers=admin)
    assert (await r.json())["enrolled"] is False and len(sb.dbs["db"]) == 1

    m = await store.run(lambda s: s.get(Machine, mid))
    assert not Selector(secure_boot=True).matches(m)  # not in force yet
    r = await client.post(f"/api/v1/machines/{mid}/power", json={"action": "on"}, headers=tech)
    assert r.status == 200, await r.text()  # the reboot puts it in force
    r = await client.get(f"/api/v1/machines/{mid}/secure-boot", headers=tech)
    assert (await r.json())["current_boot"] is True
    m = await store.run(lambda s: s.get(Machine, mid))
    assert Selector(secure_boot=True).matches(m)
    assert Selector.from_dict({"secure_boot": True}).secure_boot

    # Shown on the machine, in the API and the console.
    r = await client.get(f"/api/v1/machines/{mid}", headers=tech)
    shown = (await r.json())["secure_boot"]
    assert shown["enabled"] is True and shown["current_boot"] is True
    assert shown["certificates"]["db"] == [ours]
    origin = str(client.make_url("/")).rstrip("/")
    r = await client.post(
        "/ui/login", data={"token": tokens.technician}, headers={"Origin": origin},
        allow_redirects=False,
    )  # fmt: skip
    assert r.status == 303, await r.text()
    page = await (await client.get(f"/ui/machines/{mid}")).text()
    assert "<dt>Secure Boot</dt>" in page and "enforced, UserMode; db: 1 certificate(s)" in page
    changes = [e.data["after"] for e in await _events(store, "bmc.secure-boot")]
    assert changes[-1]["current_boot"] is True


async def test_secure_boot_enroll_without_a_certificate_configured_is_refused(  # type: ignore[no-untyped-def]
    bmc_api, lab_redfish: LabRedfish
) -> None:
    client, tokens, svc = bmc_api
    svc.cfg.secure_boot_cert = ""
    mid = await link_redfish(
        client, tokens, lab_redfish.port, username=lab_redfish.username,
        password=lab_redfish.password,
    )  # fmt: skip
    r = await client.post(
        f"/api/v1/machines/{mid}/secure-boot",
        json={"enable": True, "enroll": True},
        headers=tokens.header("admin"),
    )
    assert r.status == 422, await r.text()
    assert "bmc.secure_boot_cert" in (await r.json())["detail"]
    assert not lab_redfish.app[SECURE_BOOT].enable  # nothing was written


async def test_secure_boot_over_ipmi_is_a_clear_409(bmc_api, ipmi_sim: IpmiSim) -> None:  # type: ignore[no-untyped-def]
    client, tokens, _ = bmc_api
    mid = tokens.machine_free
    body = {
        "address": "127.0.0.1", "port": ipmi_sim.port, "protocol": "ipmi",
        "username": "admin", "password": ipmi_sim.password, "machine_id": mid,
    }  # fmt: skip
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 201, await r.text()
    for method, payload, who in (("GET", None, "technician"), ("POST", {"enable": True}, "admin")):
        r = await client.request(
            method, f"/api/v1/machines/{mid}/secure-boot", json=payload, headers=tokens.header(who)
        )
        assert r.status == 409, await r.text()
        problem = await r.json()
        assert r.content_type == "application/problem+json"
        assert "ipmi" in problem["detail"] and "Secure Boot" in problem["detail"]


def _set(store: Store, mid: str, record: dict[str, Any] | None) -> None:
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None
        m.secure_boot = record
        s.add(m)
        s.commit()


def test_secure_boot_claims_take_only_machines_it_is_enforced_on(store: Store) -> None:
    from tests.claims.helpers import add_ready

    on, pending, off, never = add_ready(store, 4)
    for mid, enabled, current in ((on, True, True), (pending, True, False), (off, False, False)):
        _set(store, mid, {"enabled": enabled, "current_boot": current, "mode": "UserMode"})
    tenant, image = add_tenant(store, "acme"), add_image(store)
    with store.session() as s, pytest.raises(Unprocessable) as refused:
        create_claim(s, tenant, 2, Selector(secure_boot=True), image, None, "t", deploy=DEPLOY)
    # The refusal says the selector's secure_boot is why, and what to do.
    assert "3 more ready machine(s) match all but secure_boot" in refused.value.detail
    assert "/secure-boot" in refused.value.detail
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant, 1, Selector.from_dict({"secure_boot": True}), image, None, "t",
            deploy=DEPLOY,
        )  # fmt: skip
        taken = s.exec(select(Machine.id).where(Machine.claim_id == claim.id)).all()
    assert taken == [on]


async def test_lab_bmc_secure_boot_refusals_and_setup_mode(lab_redfish: LabRedfish) -> None:
    """The lab BMC as a Redfish client sees it: a bad certificate or database is refused, and
    without a PK (DeletePK: SetupMode) an enabled Secure Boot is not in force after a reset."""
    import aiohttp

    base = f"http://127.0.0.1:{lab_redfish.port}/redfish/v1/Systems/m0"
    auth = aiohttp.encode_basic_auth(lab_redfish.username, lab_redfish.password)
    async with aiohttp.ClientSession(headers={"Authorization": auth}) as http:
        db = f"{base}/SecureBoot/SecureBootDatabases"
        body = {"CertificateString": "not a certificate", "CertificateType": "PEM"}
        async with http.post(f"{db}/db/Certificates", json=body) as r:
            assert r.status == 400 and "PEM" in (await r.json())["error"]["message"]
        async with http.get(f"{db}/nope/Certificates") as r:
            assert r.status == 404 and "error" in await r.json()
        async with http.patch(f"{base}/SecureBoot", json={"SecureBootMode": "UserMode"}) as r:
            assert r.status == 400
        reset = f"{base}/SecureBoot/Actions/SecureBoot.ResetKeys"
        async with http.post(reset, json={"ResetKeysType": "DeletePK"}) as r:
            assert r.status == 204
        async with http.patch(f"{base}/SecureBoot", json={"SecureBootEnable": True}) as r:
            assert (await r.json())["SecureBootMode"] == "SetupMode"
        power = f"{base}/Actions/ComputerSystem.Reset"
        async with http.post(power, json={"ResetType": "On"}) as r:
            assert r.status == 204
        async with http.get(f"{base}/SecureBoot") as r:
            assert (await r.json())["SecureBootCurrentBoot"] == "Disabled"
        async with http.post(reset, json={"ResetKeysType": "ResetAllKeysToDefault"}) as r:
            assert r.status == 204
        async with http.post(power, json={"ResetType": "ForceRestart"}) as r:
            assert r.status == 204
        async with http.get(f"{base}/SecureBoot") as r:
            got = await r.json()
        assert (got["SecureBootMode"], got["SecureBootCurrentBoot"]) == ("UserMode", "Enabled")
