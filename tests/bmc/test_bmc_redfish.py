"""The ``redfish`` driver against sushy-tools' sushy-emulator (fake systems driver), with and
without basic auth, and over TLS with a pinned CA."""

from __future__ import annotations

import base64

import aiohttp
import pytest

from metald.bmc.base import (
    BmcAuthError,
    BmcEndpoint,
    BmcUnreachable,
    BmcUnsupported,
    BootDevice,
    BootTarget,
    PowerAction,
    PowerState,
)
from metald.bmc.redfish import RedfishDriver
from tests.bmc.peers import PASSWORD, SessionRedfish, Sushy


def _driver(peer: Sushy, password: str | None = None, **kw: object) -> RedfishDriver:
    ep = BmcEndpoint(
        "127.0.0.1",
        peer.port,
        peer.username or "admin",
        password or peer.password or "unused",
        **kw,
    )  # type: ignore[arg-type]
    return RedfishDriver(ep, scheme="http", request_timeout_s=5.0)


async def _system_json(peer: Sushy, scheme: str = "http", ssl: object = None) -> dict:
    """Read the system straight from the emulator, independent of the driver."""
    headers = {}
    if peer.username:
        token = base64.b64encode(f"{peer.username}:{peer.password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    async with aiohttp.ClientSession(headers=headers) as http:
        base = f"{scheme}://127.0.0.1:{peer.port}"
        async with http.get(f"{base}/redfish/v1/Systems/{peer.system_uuid}", ssl=ssl) as r:
            assert r.status == 200
            return await r.json()


@pytest.mark.parametrize("peer_name", ["sushy", "sushy_auth"])
async def test_power_boot_and_identity(peer_name: str, request: pytest.FixtureRequest) -> None:
    peer: Sushy = request.getfixturevalue(peer_name)
    d = _driver(peer)
    try:
        ident = await d.identify()
        assert ident.system_uuid == peer.system_uuid
        assert ident.macs == [peer.mac]
        assert "ForceOff" in ident.extra["reset_types"]
        assert await d.get_power() is PowerState.OFF
        await d.set_power(PowerAction.ON)
        assert await d.get_power() is PowerState.ON
        assert (await _system_json(peer))["PowerState"] == "On"
        # sushy offers no PowerCycle: the driver picks ForceRestart, which it does advertise.
        await d.set_power(PowerAction.CYCLE)
        assert (await _system_json(peer))["PowerState"] == "On"
        await d.set_power(PowerAction.OFF)
        assert (await _system_json(peer))["PowerState"] == "Off"

        await d.set_boot_device(BootDevice(BootTarget.PXE, persistent=False, uefi=True))
        boot = (await _system_json(peer))["Boot"]
        assert boot["BootSourceOverrideTarget"] == "Pxe"
        assert boot["BootSourceOverrideMode"] == "UEFI"
        await d.set_boot_device(BootDevice(BootTarget.DISK, persistent=True, uefi=False))
        boot = (await _system_json(peer))["Boot"]
        assert boot["BootSourceOverrideTarget"] == "Hdd"
        assert boot["BootSourceOverrideMode"] == "Legacy"
    finally:
        await d.close()


async def test_sensors_read_thermal(sushy: Sushy) -> None:
    d = _driver(sushy)
    try:
        sensors = await d.sensors()
        with pytest.raises(BmcUnsupported, match="log service"):
            await d.event_log()
    finally:
        await d.close()
    kinds = {s.kind for s in sensors}
    assert {"temperature", "fan"} <= kinds
    temp = next(s for s in sensors if s.kind == "temperature")
    assert isinstance(temp.value, int | float) and temp.unit == "C"


async def test_wrong_password_is_an_auth_error(sushy_auth: Sushy) -> None:
    d = _driver(sushy_auth, password="not-the-password")
    try:
        with pytest.raises(BmcAuthError, match="401") as ei:
            await d.get_power()
    finally:
        await d.close()
    assert "not-the-password" not in str(ei.value)


async def test_tls_with_pinned_ca_verify_off_and_untrusted(sushy_tls: tuple[Sushy, str]) -> None:
    peer, ca_pem = sushy_tls
    assert peer.username and peer.password

    def drv(**kw: object) -> RedfishDriver:
        ep = BmcEndpoint("127.0.0.1", peer.port, peer.username, peer.password, **kw)  # type: ignore[arg-type]
        return RedfishDriver(ep, scheme="https", request_timeout_s=5.0)

    pinned, off, system_store = drv(ca_cert=ca_pem), drv(verify_tls=False), drv()
    try:
        assert await pinned.get_power() is PowerState.OFF
        assert await off.get_power() is PowerState.OFF
        with pytest.raises(BmcUnreachable, match="certificate"):
            await system_store.get_power()
    finally:
        for d in (pinned, off, system_store):
            await d.close()


async def test_closed_port_is_unreachable() -> None:
    import socket

    from tests.bmc.peers import free_port

    port = free_port(socket.SOCK_STREAM)
    d = RedfishDriver(BmcEndpoint("127.0.0.1", port, "a", "b"), scheme="http")
    try:
        with pytest.raises(BmcUnreachable):
            await d.get_power()
    finally:
        await d.close()


async def test_sessions_202_tasks_and_advertised_reset_types(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    """sushy-emulator has no SessionService and never answers 202: a small service does."""
    peer = SessionRedfish()
    server = await aiohttp_server(peer.app())
    d = RedfishDriver(BmcEndpoint("127.0.0.1", server.port, "admin", PASSWORD), scheme="http")
    d.task_poll_s = 0.01
    try:
        assert await d.get_power() is PowerState.OFF
        await d.set_power(PowerAction.CYCLE)  # PowerCycle is advertised: preferred
        assert await d.get_power() is PowerState.ON  # the task ran to Completed first
        with pytest.raises(BmcUnsupported, match="offers only On, PowerCycle"):
            await d.set_power(PowerAction.OFF)
        peer.tokens.clear()  # the session expired on the BMC: one new login, then on
        await d.set_power(PowerAction.ON)
    finally:
        await d.close()
    assert peer.resets == ["PowerCycle", "On"]
    assert peer.logins == 2 and peer.deleted == 1


async def test_session_login_with_wrong_password_is_auth_error(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    server = await aiohttp_server(SessionRedfish().app())
    d = RedfishDriver(BmcEndpoint("127.0.0.1", server.port, "admin", "nope-123"), scheme="http")
    try:
        with pytest.raises(BmcAuthError, match="login refused"):
            await d.get_power()
    finally:
        await d.close()
