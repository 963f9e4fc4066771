"""What ``POST /api/v1/bmcs`` accepts as an address, and that a failed registration leaves no
client session open."""

from __future__ import annotations

import pytest

from metald.bmc.base import SystemIdentity
from metald.bmc.service import BmcService
from tests.bmc.peers import Sushy
from tests.bmc.test_api_bmc import bmc_api  # noqa: F401 - fixture

BAD = [
    ("ftp://10.0.0.5", "scheme metald does not speak"),
    ("https://admin:pw@10.0.0.5", "no path, user"),
    ("https://10.0.0.5/redfish/v1", "no path, user"),
    ("10.0.0.5:0", "not 1-65535"),
    ("10.0.0.5:http", "not 1-65535"),
    ("bmc_1!", "not a host name or IP"),
    ("1.2.3.4.5", "not a host name or IP"),
    ("[fd00::5", "[IPv6]:port"),
]


@pytest.mark.parametrize(("address", "why"), BAD)
async def test_bad_addresses_get_422_saying_what_to_write(bmc_api, address: str, why: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, tokens = bmc_api
    body = {"address": address, "username": "admin", "password": "pw", "protocol": "redfish"}
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 422, await r.text()
    assert r.content_type == "application/problem+json"
    detail = (await r.json())["detail"]
    assert why in detail and 'write a host name or IP ("10.0.0.5"' in detail
    assert "pw" not in detail.replace("pw@", "")  # the password is not echoed


async def test_ipmi_has_no_url_and_a_port_is_given_once(bmc_api) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    client, tokens = bmc_api
    tech = tokens.header("technician")
    body = {"address": "http://10.0.0.5", "username": "a", "password": "p", "protocol": "ipmi"}
    r = await client.post("/api/v1/bmcs", json=body, headers=tech)
    assert r.status == 422 and "IPMI has none" in (await r.json())["detail"]
    body = {"address": "10.0.0.5:623", "port": 624, "username": "a", "password": "p"}
    r = await client.post("/api/v1/bmcs", json=body, headers=tech)
    assert r.status == 422 and "give the port once" in (await r.json())["detail"]


async def test_a_url_with_a_port_registers(bmc_api, sushy: Sushy) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """``http://host:port`` was a 500 (the port ended up twice in the driver's URL)."""
    client, tokens = bmc_api
    body = {
        "address": f"http://127.0.0.1:{sushy.port}",
        "username": "admin",
        "password": "unused",
        "protocol": "redfish",
    }
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 201, await r.text()
    out = await r.json()
    assert (out["address"], out["port"], out["protocol"]) == (
        "http://127.0.0.1",
        sushy.port,
        "redfish",
    )
    assert out["system_uuid"] == sushy.system_uuid


class ExplodingDriver:
    """identify() fails with something that is not a BmcError (a bug, a cancel)."""

    protocol = "redfish"
    made: list[ExplodingDriver] = []

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.closed = False
        ExplodingDriver.made.append(self)

    async def identify(self) -> SystemIdentity:
        if self.fail:
            raise ValueError("the driver tripped over something")
        return SystemIdentity(system_uuid="u-x", serial=None, macs=[])

    async def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("where", ["identify", "insert"])
async def test_every_failed_registration_closes_its_driver(
    bmc_api,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:  # type: ignore[no-untyped-def]
    from api.app import CTX_KEY

    client, tokens = bmc_api
    svc: BmcService = client.app[CTX_KEY].services.bmc
    ExplodingDriver.made.clear()
    monkeypatch.setattr(
        svc.control, "make_driver", lambda proto, ep: ExplodingDriver(where == "identify")
    )
    if where == "insert":

        def refuse(*_a: object) -> None:
            raise RuntimeError("the store refused")

        monkeypatch.setattr(svc.registry, "_insert", refuse)
    body = {"address": "10.0.0.5", "username": "a", "password": "p", "protocol": "redfish"}
    r = await client.post("/api/v1/bmcs", json=body, headers=tokens.header("technician"))
    assert r.status == 500  # an unexpected error stays an error...
    assert [d.closed for d in ExplodingDriver.made] == [True]  # ...but leaks no session
