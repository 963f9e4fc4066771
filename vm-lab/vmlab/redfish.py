"""A minimal Redfish service for one lab machine (aiohttp), mapped onto MachineControl.

Served: the service root, the Systems collection with one ComputerSystem (power state, boot
override, reset action), its EthernetInterfaces (the machine's MAC, which lets a client match
this BMC to the host that PXE-boots), and one Manager with one VirtualMedia CD (``vmedia``:
InsertMedia fetches the image and puts it in the machine's CD drive over QMP; a ``Cd`` boot
override puts that drive first). Everything but the service root needs
HTTP basic auth with the machine's BMC credentials.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from . import (
    redfish_accounts,
    redfish_bios,
    redfish_events,
    redfish_secureboot,
    redfish_session,
    redfish_update,
)
from .power import MachineControl
from .vmedia import MediaError, VirtualCd

RESET_TYPES = ["On", "ForceOff", "GracefulShutdown", "ForceRestart", "PowerCycle", "Nmi"]
#: ResetType as the command log names it (the same words as the IPMI face's)
REDFISH_POWER = dict(zip(RESET_TYPES, ["on", "off", "soft", "reset", "cycle", "nmi"], strict=True))
BOOT_TARGETS = {"None": "none", "Pxe": "pxe", "Hdd": "hdd", "Cd": "cd"}
BOOT_ENABLED = {"Disabled": "disabled", "Once": "once", "Continuous": "continuous"}
ODATA_VERSION = "4.0"


@dataclass(frozen=True)
class SystemInfo:
    system_id: str
    uuid: str
    mac: str
    firmware: str  # "bios" or "uefi"
    memory_mb: int
    cpus: int
    serial_number: str
    username: str
    password: str
    #: Where the virtual CD's fetched image is kept; None: the BMC offers no VirtualMedia.
    media_dir: Path | None = None

    @property
    def boot_mode(self) -> str:
        return "UEFI" if self.firmware == "uefi" else "Legacy"


CONTROL = web.AppKey("control", MachineControl)
INFO = web.AppKey("info", SystemInfo)
CD = web.AppKey("cd", VirtualCd)
VMEDIA = "/redfish/v1/Managers/BMC/VirtualMedia"


def error(status: int, message_id: str, message: str) -> web.Response:
    body = {
        "error": {
            "code": f"Base.1.8.{message_id}",
            "message": message,
            "@Message.ExtendedInfo": [
                {
                    "@odata.type": "#Message.v1_1_1.Message",
                    "MessageId": f"Base.1.8.{message_id}",
                    "Message": message,
                    "Severity": "Warning",
                }
            ],
        }
    }
    return web.json_response(body, status=status, headers={"OData-Version": ODATA_VERSION})


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, headers={"OData-Version": ODATA_VERSION})


@web.middleware
async def basic_auth(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path.rstrip("/") in ("/redfish", "/redfish/v1", "/redfish/v1/$metadata"):
        return await handler(request)  # the service root is public, as the spec asks
    if redfish_session.is_login(request) or redfish_session.token_ok(request):
        return await handler(request)  # logging in, or a live session's token
    if not _credentials_ok(request.headers.get("Authorization", ""), request.app):
        response = error(401, "InsufficientPrivilege", "valid credentials are required")
        response.headers["WWW-Authenticate"] = 'Basic realm="vm-lab BMC"'
        return response
    return await handler(request)


def _credentials_ok(header: str, app: web.Application) -> bool:
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    return bool(sep) and app[redfish_accounts.ACCOUNT_STATE].check(user, password)


def _system_path(info: SystemInfo) -> str:
    return f"/redfish/v1/Systems/{info.system_id}"


async def redfish_version(request: web.Request) -> web.Response:
    return _json({"v1": "/redfish/v1/"})


async def service_root(request: web.Request) -> web.Response:
    info = request.app[INFO]
    return _json(
        {
            "@odata.type": "#ServiceRoot.v1_5_0.ServiceRoot",
            "@odata.id": "/redfish/v1/",
            "Id": "RootService",
            "Name": "vm-lab Redfish service",
            "RedfishVersion": "1.6.0",
            "UUID": info.uuid,
            "Systems": {"@odata.id": "/redfish/v1/Systems"},
            "Managers": {"@odata.id": "/redfish/v1/Managers"},
            "UpdateService": {"@odata.id": "/redfish/v1/UpdateService"},
            "Tasks": {"@odata.id": "/redfish/v1/TaskService"},
            "EventService": {"@odata.id": redfish_events.SERVICE},
            "SessionService": {"@odata.id": redfish_session.SERVICE},
            "AccountService": {"@odata.id": redfish_accounts.SERVICE},
            "Links": {"Sessions": {"@odata.id": redfish_session.SESSIONS}},
        }
    )


#: The DMTF schemas (namespace, file) the resources above are typed by, for ``$metadata``.
METADATA_REFERENCES = [
    ("ServiceRoot", "ServiceRoot_v1.xml"),
    ("ComputerSystemCollection", "ComputerSystemCollection_v1.xml"),
    ("ComputerSystem", "ComputerSystem_v1.xml"),
    ("EthernetInterfaceCollection", "EthernetInterfaceCollection_v1.xml"),
    ("EthernetInterface", "EthernetInterface_v1.xml"),
    ("ManagerCollection", "ManagerCollection_v1.xml"),
    ("Manager", "Manager_v1.xml"),
    ("VirtualMediaCollection", "VirtualMediaCollection_v1.xml"),
    ("VirtualMedia", "VirtualMedia_v1.xml"),
    ("Bios", "Bios_v1.xml"),
    ("UpdateService", "UpdateService_v1.xml"),
    ("SoftwareInventoryCollection", "SoftwareInventoryCollection_v1.xml"),
    ("SoftwareInventory", "SoftwareInventory_v1.xml"),
    ("TaskService", "TaskService_v1.xml"),
    ("TaskCollection", "TaskCollection_v1.xml"),
    ("Task", "Task_v1.xml"),
    ("SessionService", "SessionService_v1.xml"),
    ("SessionCollection", "SessionCollection_v1.xml"),
    ("Session", "Session_v1.xml"),
    ("AccountService", "AccountService_v1.xml"),
    ("ManagerAccountCollection", "ManagerAccountCollection_v1.xml"),
    ("ManagerAccount", "ManagerAccount_v1.xml"),
    ("RoleCollection", "RoleCollection_v1.xml"),
    ("Role", "Role_v1.xml"),
    ("EventService", "EventService_v1.xml"),
    ("EventDestinationCollection", "EventDestinationCollection_v1.xml"),
    ("EventDestination", "EventDestination_v1.xml"),
    ("Event", "Event_v1.xml"),
    ("LogServiceCollection", "LogServiceCollection_v1.xml"),
    ("LogService", "LogService_v1.xml"),
    ("LogEntryCollection", "LogEntryCollection_v1.xml"),
    ("LogEntry", "LogEntry_v1.xml"),
    ("Message", "Message_v1.xml"),
    ("Resource", "Resource_v1.xml"),
    ("Settings", "Settings_v1.xml"),
    ("SecureBoot", "SecureBoot_v1.xml"),
    ("SecureBootDatabaseCollection", "SecureBootDatabaseCollection_v1.xml"),
    ("SecureBootDatabase", "SecureBootDatabase_v1.xml"),
    ("CertificateCollection", "CertificateCollection_v1.xml"),
    ("Certificate", "Certificate_v1.xml"),
]


async def metadata(request: web.Request) -> web.Response:
    """The CSDL document naming the schemas the service's resources use (DSP0266)."""
    refs = "".join(
        f'  <edmx:Reference Uri="http://redfish.dmtf.org/schemas/v1/{f}">'
        f'<edmx:Include Namespace="{ns}"/></edmx:Reference>\n'
        for ns, f in METADATA_REFERENCES
    )
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<edmx:Edmx xmlns:edmx="http://docs.oasis-open.org/odata/ns/edmx" Version="4.0">\n'
        f"{refs}"
        '  <edmx:DataServices><Schema xmlns="http://docs.oasis-open.org/odata/ns/edm" '
        'Namespace="Service"><EntityContainer Name="Service" '
        'Extends="ServiceRoot.v1_5_0.ServiceContainer"/></Schema></edmx:DataServices>\n'
        "</edmx:Edmx>\n"
    )
    return web.Response(
        text=body, content_type="application/xml", headers={"OData-Version": ODATA_VERSION}
    )


async def systems(request: web.Request) -> web.Response:
    info = request.app[INFO]
    return _json(
        {
            "@odata.type": "#ComputerSystemCollection.ComputerSystemCollection",
            "@odata.id": "/redfish/v1/Systems",
            "Name": "Computer System Collection",
            "Members@odata.count": 1,
            "Members": [{"@odata.id": _system_path(info)}],
        }
    )


def not_found(request: web.Request) -> web.HTTPNotFound:
    body = error(404, "ResourceMissingAtURI", f"no resource at {request.path}")
    return web.HTTPNotFound(
        body=body.body, content_type="application/json", headers={"OData-Version": ODATA_VERSION}
    )


def _check_system(request: web.Request) -> None:
    if request.match_info["system_id"] != request.app[INFO].system_id:
        raise not_found(request)


async def get_system(request: web.Request) -> web.Response:
    _check_system(request)
    info = request.app[INFO]
    control = request.app[CONTROL]
    control.record(request.remote or "", "redfish", "read")
    on = await control.is_on()
    override = control.override
    path = _system_path(info)
    target = next(k for k, v in BOOT_TARGETS.items() if v == override.target)
    enabled = next(k for k, v in BOOT_ENABLED.items() if v == override.mode)
    return _json(
        {
            "@odata.type": "#ComputerSystem.v1_10_0.ComputerSystem",
            "@odata.id": path,
            "Id": info.system_id,
            "Name": info.system_id,
            "UUID": info.uuid,
            "Manufacturer": "vm-lab",
            "Model": f"vm-lab {info.firmware}",
            "SerialNumber": info.serial_number,
            "SystemType": "Physical",
            "PowerState": "On" if on else "Off",
            "Status": {"State": "Enabled", "Health": "OK"},
            "ProcessorSummary": {"Count": info.cpus},
            "MemorySummary": {"TotalSystemMemoryGiB": round(info.memory_mb / 1024, 2)},
            "Boot": {
                "BootSourceOverrideTarget": target,
                "BootSourceOverrideEnabled": enabled,
                "BootSourceOverrideMode": info.boot_mode,
                "BootSourceOverrideTarget@Redfish.AllowableValues": list(BOOT_TARGETS),
                "BootSourceOverrideMode@Redfish.AllowableValues": [info.boot_mode],
            },
            "EthernetInterfaces": {"@odata.id": f"{path}/EthernetInterfaces"},
            "Bios": {"@odata.id": f"{path}/Bios"},
            **(
                {"SecureBoot": {"@odata.id": f"{path}/SecureBoot"}}
                if redfish_secureboot.SECURE_BOOT in request.app
                else {}
            ),
            "Actions": {
                "#ComputerSystem.Reset": {
                    "target": f"{path}/Actions/ComputerSystem.Reset",
                    "ResetType@Redfish.AllowableValues": RESET_TYPES,
                }
            },
            "Links": {"ManagedBy": [{"@odata.id": "/redfish/v1/Managers/BMC"}]},
        }
    )


async def patch_system(request: web.Request) -> web.Response:
    _check_system(request)
    info = request.app[INFO]
    control = request.app[CONTROL]
    try:
        body = await request.json()
    except ValueError:
        return error(400, "MalformedJSON", "the request body is not valid JSON")
    if not isinstance(body, dict) or set(body) - {"Boot"} or not isinstance(body.get("Boot"), dict):
        return error(400, "PropertyNotWritable", "only Boot can be changed on this system")
    boot = body["Boot"]
    unknown = set(boot) - {
        "BootSourceOverrideTarget",
        "BootSourceOverrideEnabled",
        "BootSourceOverrideMode",
    }
    if unknown:
        return error(400, "PropertyUnknown", f"unknown Boot properties: {sorted(unknown)}")
    target_name = boot.get("BootSourceOverrideTarget")
    enabled_name = boot.get("BootSourceOverrideEnabled")
    mode_name = boot.get("BootSourceOverrideMode")
    if target_name is not None and target_name not in BOOT_TARGETS:
        return error(400, "PropertyValueNotInList", f"BootSourceOverrideTarget {target_name!r}")
    if enabled_name is not None and enabled_name not in BOOT_ENABLED:
        return error(400, "PropertyValueNotInList", f"BootSourceOverrideEnabled {enabled_name!r}")
    if mode_name is not None and mode_name != info.boot_mode:
        # The firmware is fixed when the machine is made (SeaBIOS or OVMF).
        return error(
            400,
            "PropertyValueNotInList",
            f"BootSourceOverrideMode {mode_name!r}: this machine boots {info.boot_mode} only",
        )
    current = control.override
    target = BOOT_TARGETS[target_name] if target_name is not None else current.target
    if enabled_name is not None:
        mode = BOOT_ENABLED[enabled_name]
    else:
        # A target alone means "next boot" unless an override is already standing.
        mode = current.mode if current.mode != "disabled" else "once"
    control.record(request.remote or "", "redfish", f"boot {target} {mode}")
    await control.set_boot_override(target, mode)
    return await get_system(request)


async def reset_action(request: web.Request) -> web.Response:
    _check_system(request)
    control = request.app[CONTROL]
    try:
        body = await request.json()
    except ValueError:
        return error(400, "MalformedJSON", "the request body is not valid JSON")
    reset_type = body.get("ResetType") if isinstance(body, dict) else None
    if reset_type not in RESET_TYPES:
        return error(
            400,
            "ActionParameterValueNotInList",
            f"ResetType {reset_type!r} not one of {RESET_TYPES}",
        )
    action = {
        "On": control.power_on,
        "ForceOff": control.power_off,
        "GracefulShutdown": control.soft_off,
        "ForceRestart": control.reset,
        "PowerCycle": control.power_cycle,
        "Nmi": control.nmi,
    }[reset_type]
    control.record(request.remote or "", "redfish", f"power {REDFISH_POWER[reset_type]}")
    apply = request.app.get(redfish_secureboot.APPLY)
    if apply is not None and reset_type in ("On", "ForceRestart", "PowerCycle"):
        # The firmware reads its Secure Boot variables as it starts: bring them in step first.
        await apply(request.app[redfish_secureboot.SECURE_BOOT])
    await action()
    if reset_type in ("On", "ForceRestart", "PowerCycle"):
        request.app[redfish_bios.BIOS].reboot()  # pending BIOS settings apply as it starts
        request.app[redfish_update.UPDATES].host_reset()  # so does firmware written meanwhile
        if redfish_secureboot.SECURE_BOOT in request.app:  # and the Secure Boot variables
            request.app[redfish_secureboot.SECURE_BOOT].reboot()
    return web.Response(status=204, headers={"OData-Version": ODATA_VERSION})


async def ethernet_interfaces(request: web.Request) -> web.Response:
    _check_system(request)
    path = f"{_system_path(request.app[INFO])}/EthernetInterfaces"
    return _json(
        {
            "@odata.type": "#EthernetInterfaceCollection.EthernetInterfaceCollection",
            "@odata.id": path,
            "Name": "Ethernet Interface Collection",
            "Members@odata.count": 1,
            "Members": [{"@odata.id": f"{path}/nic0"}],
        }
    )


async def ethernet_interface(request: web.Request) -> web.Response:
    _check_system(request)
    if request.match_info["nic_id"] != "nic0":
        raise not_found(request)
    info = request.app[INFO]
    return _json(
        {
            "@odata.type": "#EthernetInterface.v1_4_0.EthernetInterface",
            "@odata.id": f"{_system_path(info)}/EthernetInterfaces/nic0",
            "Id": "nic0",
            "Name": "nic0",
            "MACAddress": info.mac,
            "PermanentMACAddress": info.mac,
        }
    )


async def managers(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#ManagerCollection.ManagerCollection",
            "@odata.id": "/redfish/v1/Managers",
            "Name": "Manager Collection",
            "Members@odata.count": 1,
            "Members": [{"@odata.id": "/redfish/v1/Managers/BMC"}],
        }
    )


async def manager(request: web.Request) -> web.Response:
    if request.match_info["manager_id"] != "BMC":
        raise not_found(request)
    info = request.app[INFO]
    return _json(
        {
            "@odata.type": "#Manager.v1_5_0.Manager",
            "@odata.id": "/redfish/v1/Managers/BMC",
            "Id": "BMC",
            "Name": "vm-lab virtual BMC",
            "ManagerType": "BMC",
            **({"VirtualMedia": {"@odata.id": VMEDIA}} if CD in request.app else {}),
            "LogServices": {"@odata.id": redfish_events.LOG_SERVICES},
            "Status": {"State": "Enabled", "Health": "OK"},
            "Actions": {
                "#Manager.Reset": {
                    "target": "/redfish/v1/Managers/BMC/Actions/Manager.Reset",
                    "ResetType@Redfish.AllowableValues": ["GracefulRestart", "ForceRestart"],
                }
            },
            "Links": {"ManagerForServers": [{"@odata.id": _system_path(info)}]},
        }
    )


# ---- VirtualMedia: one CD ----------------------------------------------------------------------


async def virtual_media(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#VirtualMediaCollection.VirtualMediaCollection",
            "@odata.id": VMEDIA,
            "Name": "Virtual Media Services",
            "Members@odata.count": 1,
            "Members": [{"@odata.id": f"{VMEDIA}/Cd"}],
        }
    )


async def cd_resource(request: web.Request) -> web.Response:
    if request.match_info["media_id"] != "Cd":
        raise not_found(request)
    request.app[CONTROL].record(request.remote or "", "redfish", "read media")
    now = await request.app[CD].state()
    return _json(
        {
            "@odata.type": "#VirtualMedia.v1_3_0.VirtualMedia",
            "@odata.id": f"{VMEDIA}/Cd",
            "Id": "Cd",
            "Name": "Virtual CD",
            "MediaTypes": ["CD", "DVD"],
            "Image": now.image,
            "ImageName": now.image.rsplit("/", 1)[-1] if now.image else None,
            "Inserted": now.inserted,
            "WriteProtected": True,
            "ConnectedVia": "URI" if now.inserted else "NotConnected",
            "Actions": {
                "#VirtualMedia.InsertMedia": {
                    "target": f"{VMEDIA}/Cd/Actions/VirtualMedia.InsertMedia"
                },
                "#VirtualMedia.EjectMedia": {
                    "target": f"{VMEDIA}/Cd/Actions/VirtualMedia.EjectMedia"
                },
            },
        }
    )


async def insert_media(request: web.Request) -> web.Response:
    if request.match_info["media_id"] != "Cd":
        raise not_found(request)
    try:
        body = await request.json()
    except ValueError:
        return error(400, "MalformedJSON", "the request body is not valid JSON")
    image = body.get("Image") if isinstance(body, dict) else None
    if not isinstance(image, str) or not image:
        return error(400, "ActionParameterMissing", "InsertMedia needs Image (a URL)")
    if body.get("Inserted", True) is not True or body.get("WriteProtected", True) is not True:
        return error(400, "ActionParameterNotSupported", "only Inserted and WriteProtected true")
    request.app[CONTROL].record(request.remote or "", "redfish", f"insert {image}")
    try:
        await request.app[CD].insert(image)
    except MediaError as e:
        status = 409 if "already inserted" in str(e) else 400
        return error(status, "ResourceInUse" if status == 409 else "ActionNotSupported", str(e))
    return web.Response(status=204, headers={"OData-Version": ODATA_VERSION})


async def eject_media(request: web.Request) -> web.Response:
    if request.match_info["media_id"] != "Cd":
        raise not_found(request)
    request.app[CONTROL].record(request.remote or "", "redfish", "eject")
    await request.app[CD].eject()
    return web.Response(status=204, headers={"OData-Version": ODATA_VERSION})


def make_app(control: MachineControl, info: SystemInfo) -> web.Application:
    app = web.Application(middlewares=[redfish_update.rebooting, basic_auth])
    app[CONTROL] = control
    app[INFO] = info
    system = "/redfish/v1/Systems/{system_id}"
    app.router.add_get("/redfish", redfish_version)
    app.router.add_get("/redfish/v1", service_root)
    app.router.add_get("/redfish/v1/", service_root)
    app.router.add_get("/redfish/v1/$metadata", metadata)
    app.router.add_get("/redfish/v1/Systems", systems)
    app.router.add_get(system, get_system)
    app.router.add_patch(system, patch_system)
    app.router.add_post(system + "/Actions/ComputerSystem.Reset", reset_action)
    app.router.add_get(system + "/EthernetInterfaces", ethernet_interfaces)
    app.router.add_get(system + "/EthernetInterfaces/{nic_id}", ethernet_interface)
    app.router.add_get("/redfish/v1/Managers", managers)
    app.router.add_get("/redfish/v1/Managers/{manager_id}", manager)
    redfish_bios.install(app, system, info.firmware)
    redfish_secureboot.install(app, system, info.firmware)
    redfish_update.install(app, info.firmware)
    redfish_events.install(app)

    accounts = redfish_accounts.install(app, info.username, info.password)
    redfish_session.install(app, accounts.check)
    if info.media_dir is not None:
        app[CD] = VirtualCd(control.qmp, info.media_dir, info.system_id)
        app.router.add_get(VMEDIA, virtual_media)
        app.router.add_get(VMEDIA + "/{media_id}", cd_resource)
        app.router.add_post(VMEDIA + "/{media_id}/Actions/VirtualMedia.InsertMedia", insert_media)
        app.router.add_post(VMEDIA + "/{media_id}/Actions/VirtualMedia.EjectMedia", eject_media)
    return app
