"""The lab Redfish BMC's BIOS settings (what sushy-emulator's fake driver lacks).

``Bios`` holds the current attributes; ``Bios/Settings`` the pending ones a client PATCHes,
applied at the next reset through this BMC (as real firmware applies them at the next boot).
(The firmware inventory and its updates are ``redfish_update``'s.)
Values are checked against a small attribute registry: an unknown name or a wrong type is a
400, as on real BMCs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

#: name -> (type, allowed values or None). A few settings GPU servers are provisioned with.
REGISTRY: dict[str, tuple[type, tuple[str, ...] | None]] = {
    "ProcVirtualization": (str, ("Enabled", "Disabled")),
    "SriovGlobalEnable": (str, ("Enabled", "Disabled")),
    "LogicalProc": (str, ("Enabled", "Disabled")),
    "SysProfile": (str, ("PerfOptimized", "PerfPerWattOptimized", "Custom")),
    "NumaNodesPerSocket": (int, None),
}
DEFAULTS: dict[str, Any] = {
    "ProcVirtualization": "Enabled",
    "SriovGlobalEnable": "Disabled",
    "LogicalProc": "Enabled",
    "SysProfile": "PerfPerWattOptimized",
    "NumaNodesPerSocket": 1,
}


@dataclass
class BiosState:
    firmware: str  # "bios" or "uefi"
    current: dict[str, Any] = field(default_factory=lambda: dict(DEFAULTS))
    pending: dict[str, Any] = field(default_factory=dict)

    def reboot(self) -> None:
        """Apply the pending settings (the firmware reads them as the machine starts)."""
        self.current.update(self.pending)
        self.pending.clear()


BIOS = web.AppKey("bios", BiosState)


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(body, status=status, headers={"OData-Version": "4.0"})


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"code": "Base.1.8.PropertyValueNotInList", "message": message}}, status)


def _bios_path(request: web.Request) -> str:
    return f"/redfish/v1/Systems/{request.match_info['system_id']}/Bios"


async def get_bios(request: web.Request) -> web.Response:
    state, path = request.app[BIOS], _bios_path(request)
    return _json(
        {
            "@odata.type": "#Bios.v1_1_0.Bios",
            "@odata.id": path,
            "Id": "Bios",
            "Name": "BIOS Configuration Current Settings",
            "AttributeRegistry": "BiosAttributeRegistry.v1_0_0",
            "Attributes": state.current,
            "@Redfish.Settings": {
                "@odata.type": "#Settings.v1_3_0.Settings",
                "SettingsObject": {"@odata.id": f"{path}/Settings"},
            },
        }
    )


async def get_settings(request: web.Request) -> web.Response:
    state = request.app[BIOS]
    return _json(
        {
            "@odata.type": "#Bios.v1_1_0.Bios",
            "@odata.id": f"{_bios_path(request)}/Settings",
            "Id": "Settings",
            "Name": "BIOS Configuration Pending Settings",
            "Attributes": state.pending,
        }
    )


async def patch_settings(request: web.Request) -> web.Response:
    state = request.app[BIOS]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the request body is not valid JSON")
    attrs = body.get("Attributes") if isinstance(body, dict) else None
    if not isinstance(attrs, dict) or not attrs:
        return _error(400, "PATCH {'Attributes': {...}}")
    for name, value in attrs.items():
        spec = REGISTRY.get(name)
        if spec is None:
            return _error(400, f"unknown BIOS attribute {name!r}")
        kind, allowed = spec
        if type(value) is not kind or (allowed is not None and value not in allowed):
            return _error(400, f"BIOS attribute {name}: {value!r} is not allowed")
    state.pending.update(attrs)
    return web.Response(status=204, headers={"OData-Version": "4.0"})


def install(app: web.Application, system: str, firmware: str) -> None:
    """Add the BIOS resources under ``system`` (a route pattern)."""
    app[BIOS] = BiosState(firmware)
    app.router.add_get(system + "/Bios", get_bios)
    app.router.add_get(system + "/Bios/Settings", get_settings)
    app.router.add_patch(system + "/Bios/Settings", patch_settings)
