"""/api/v1/bmcs and what a BMC does for a machine: power, next boot device, sensors, event log.

Declarations: validation and roles here, everything else in the BMCs use case
(``metald.usecases.bmcs``, over ``metald.bmc.service.BmcService``). No answer carries a BMC
password.

With several instances a command for a BMC runs on the instance that owns it: the routes
declare it (``owner=Owner.BMC`` / ``Owner.MACHINE``) and the router carries a request that
reaches another instance to the owner's API URL with the caller's own token (the owner
authorizes it again), returning its answer as is (``api.routing.Owner``). A forwarded request
is never forwarded again: if ownership moved meanwhile, the answer is a 503 saying to retry.
The forwarding mark is signed with a key only instances hold (``metald.fleet.forward_auth``):
a client that sets it itself is refused (403), it does not get a non-owner to act on another
instance's BMC.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field, SecretStr, StrictBool, StringConstraints

from api import listing, workflows
from api.paging import PageQuery
from api.resolve import Ref
from api.roles import ADMIN
from api.routing import STAFF, ApiRequest, Owner, Router
from api.schemas import In, ListPage
from metald.bmc import targets
from metald.bmc.capabilities import Capability
from metald.usecases.bmcs import Bmcs

router = Router()
TAG = "bmcs"


# ---- models -------------------------------------------------------------------------------


class BmcCreate(In):
    address: Annotated[str, StringConstraints(min_length=1, max_length=255)] = Field(
        description="Host name or IP, optionally with :port; for Redfish also http(s)://host"
        "[:port]. TLS is the default. Anything else (a path, a user) is refused with 422."
    )
    port: int | None = Field(default=None, ge=1, le=65535, description="Default 623 / 443.")
    protocol: Literal["auto", "ipmi", "redfish"] = Field(
        default="auto", description="auto tries Redfish, then IPMI."
    )
    username: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    #: SecretStr: never echoed back, not even in a validation error.
    password: SecretStr = Field(min_length=1, max_length=256)
    machine_id: Annotated[str, Ref("machines")] | None = Field(
        default=None,
        description="Link by hand (id, name or 8+ character id prefix); otherwise linked by "
        "system UUID, serial or MAC.",
    )
    verify_tls: bool = True
    ca_cert: Annotated[str, StringConstraints(max_length=65536)] | None = Field(
        default=None, description="PEM CA to trust for this BMC only (pinned)."
    )
    verify: bool = Field(
        default=True,
        description="false: store the BMC without connecting (health unreachable; a rack "
        "staged before it is cabled); its owning instance verifies it once it answers. Needs "
        "protocol ipmi or redfish.",
    )


class BmcOut(BaseModel):
    id: str
    machine_id: str | None
    address: str
    port: int | None
    protocol: str
    username: str
    verify_tls: bool
    ca_pinned: bool
    health: str = Field(description="ok, auth-failed, unreachable, error, unknown")
    health_detail: str | None
    power_state: str | None
    system_uuid: str | None
    serial: str | None
    macs: list[str]
    last_seen_at: datetime | None
    created_at: datetime | None
    owner_instance: str | None = Field(
        default=None,
        description="The live metald instance that owns this BMC now (power sync, commands).",
    )
    capabilities: list[Capability] = Field(
        default_factory=list,
        description="What its driver can be asked. A command for a capability not listed is "
        "refused (422, naming it; 409 for the serial console) before anything is sent.",
    )


class BmcList(ListPage[BmcOut]):
    """One page of BMCs."""


class BmcQuery(PageQuery):
    SORTABLE = ("address", "health", "protocol", "created_at")


class BmcLink(In):
    machine_id: Annotated[str, Ref("machines")] | None = Field(
        description="The machine to link to (id, name or 8+ character id prefix); null unlinks."
    )


class PowerRequest(In):
    action: Literal["on", "off", "cycle", "reset", "soft-off", "status"]
    wait_s: float | None = Field(
        default=None,
        ge=0,
        description="Seconds to wait for the BMC to report the new state, at most (and by "
        "default) [bmc] power_state_timeout_s; past it the answer is 202 with command_id.",
    )


class PowerOut(BaseModel):
    #: None while the BMC is not linked to a machine yet.
    machine_id: str | None
    bmc_id: str
    action: str | None = None
    power_state: str | None = Field(
        description="What the BMC reported last (null: no reading since the command)."
    )
    command_id: str | None = None
    status: Literal["pending", "confirmed", "failed"] | None = Field(
        default=None,
        description="An action's confirmation: pending (answered 202; GET .../power/commands/"
        "{command_id} or the bmc.power-confirmed / bmc.power-failed event tells the outcome).",
    )
    target_state: str | None = None
    elapsed_s: float | None = None
    detail: str | None = None


class BootDeviceRequest(In):
    device: Literal["pxe", "disk"]
    persistent: bool = Field(default=False, description="false: the next boot only.")
    uefi: bool = Field(default=True, description="false: legacy BIOS boot.")


class BootDeviceOut(BaseModel):
    machine_id: str
    device: str
    persistent: bool
    uefi: bool


class SensorOut(BaseModel):
    name: str
    kind: str
    value: float | None
    units: str | None
    health: str


class SensorList(BaseModel):
    items: list[SensorOut]


class LogEntryOut(BaseModel):
    id: str
    at: str | None
    severity: str
    message: str


class LogList(BaseModel):
    items: list[LogEntryOut]


class ApproveIn(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)] = Field(
        description="Why this machine is genuine without a BMC (ticket, asset tag checked).",
    )


class ApprovalOut(BaseModel):
    machine_id: str
    approved_at: datetime | None
    approved_by: str | None
    bmc_linked: bool


# ---- BMCs -----------------------------------------------------------------------------------

#: What every BMC route declares: staff only, in the BMCs use case.
_BMC: dict[str, Any] = {"roles": STAFF, "tag": TAG, "use_case": workflows.bmcs}
#: A command for the BMC ``{id}``: on the instance that owns it.
_ON_BMC: dict[str, Any] = {**_BMC, "owner": Owner.BMC}
#: A command for the machine ``{id}``'s BMC: on the instance that owns that BMC.
_ON_MACHINE: dict[str, Any] = {**_BMC, "owner": Owner.MACHINE, "errors": (404, 422, 502, 503)}


@router.route(
    "POST",
    "/api/v1/bmcs",
    summary="Register a BMC",
    body=BmcCreate,
    response=BmcOut,
    status=201,
    errors=(404, 409, 422, 503),
    location="/api/v1/bmcs/{id}",
    **_BMC,
)
async def register_bmc(req: ApiRequest, bmcs: Bmcs) -> BmcOut:
    """Connects first (422 "could not verify the BMC" naming the failed step, after [bmc]
    verify_s) unless verify is false; only to addresses [bmc] networks allows, never to
    loopback, link-local or metald's own listeners unless configured; links it to its machine."""
    b: BmcCreate = req.body
    out = await bmcs.register(
        b.address,
        b.port,
        b.protocol,
        username=b.username,
        password=b.password.get_secret_value(),
        machine_id=b.machine_id,
        verify_tls=b.verify_tls,
        ca_cert=b.ca_cert,
        actor=req.actor,
        verify=b.verify,
        own_listeners=targets.own_listeners(req.ctx.cfg),
    )
    return BmcOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/bmcs",
    summary="List BMCs",
    query=BmcQuery,
    response=BmcList,
    errors=(503,),
    **_BMC,
)
async def list_bmcs(req: ApiRequest, bmcs: Bmcs) -> BmcList:
    """Registered BMCs with their health and last known power state, by address, paginated."""
    return await listing.listed(req, BmcList, bmcs.list)


@router.route(
    "GET",
    "/api/v1/bmcs/{id}",
    summary="Show a BMC",
    response=BmcOut,
    errors=(404, 503),
    **_BMC,
)
async def show_bmc(req: ApiRequest, bmcs: Bmcs) -> BmcOut:
    """One BMC; health_detail says why it is not ok."""
    return BmcOut.model_validate(await bmcs.show(req.params["id"]))


@router.route(
    "PUT",
    "/api/v1/bmcs/{id}/machine",
    summary="Link a BMC to a machine",
    body=BmcLink,
    response=BmcOut,
    errors=(404, 409, 503),
    **_BMC,
)
async def link_bmc(req: ApiRequest, bmcs: Bmcs) -> BmcOut:
    """Link by hand (or unlink with null) when automatic matching could not decide."""
    b: BmcLink = req.body
    return BmcOut.model_validate(await bmcs.link(req.params["id"], b.machine_id, actor=req.actor))


@router.route(
    "DELETE",
    "/api/v1/bmcs/{id}",
    summary="Remove a BMC",
    status=204,
    errors=(404, 503),
    **_BMC,
)
async def remove_bmc(req: ApiRequest, bmcs: Bmcs) -> None:
    """Forget the BMC and its stored credentials."""
    await bmcs.remove(req.params["id"], actor=req.actor)


@router.route(
    "GET",
    "/api/v1/bmcs/{id}/power",
    summary="Read a BMC host's power state",
    response=PowerOut,
    errors=(404, 502, 503),
    **_ON_BMC,
)
async def bmc_power_status(req: ApiRequest, bmcs: Bmcs) -> PowerOut:
    """Asks the BMC now; works before the host has enrolled as a machine."""
    return PowerOut.model_validate(await bmcs.bmc_power(req.params["id"], "status"))


@router.route(
    "POST",
    "/api/v1/bmcs/{id}/power",
    summary="Power a BMC's host",
    body=PowerRequest,
    response=PowerOut,
    errors=(404, 422, 502, 503),
    **_ON_BMC,
)
async def bmc_power_action(req: ApiRequest, bmcs: Bmcs) -> PowerOut | web.Response:
    """Zero-touch: power on racks whose machines are not enrolled yet; they PXE-boot, enroll
    themselves, and the BMC is linked to its machine by system UUID, serial or MAC."""
    b: PowerRequest = req.body
    out = await bmcs.bmc_power(req.params["id"], b.action, actor=req.actor, wait_s=b.wait_s)
    return _power_answer(PowerOut.model_validate(out))


def _power_answer(out: PowerOut) -> PowerOut | web.Response:
    """200 with the state the BMC reported; 202 while the BMC has not reported it yet."""
    if out.status != "pending":
        return out
    return web.json_response(out.model_dump(mode="json"), status=202)


class PowerCommandOut(BaseModel):
    command_id: str
    bmc_id: str
    machine_id: str | None
    action: str
    target_state: str
    status: Literal["pending", "confirmed", "failed"]
    power_state: str | None
    elapsed_s: float
    detail: str | None


@router.route(
    "GET",
    "/api/v1/bmcs/{id}/power/commands/{command_id}",
    summary="Follow a BMC power command",
    response=PowerCommandOut,
    errors=(404, 503),
    **_ON_BMC,
)
async def bmc_power_command(req: ApiRequest, bmcs: Bmcs) -> PowerCommandOut:
    """A power command answered 202: pending until the BMC reports the target state."""
    out = bmcs.power_command(req.params["command_id"], bmc_id=req.params["id"])
    return PowerCommandOut.model_validate(out)


# ---- what a BMC does for a machine -------------------------------------------------------------


@router.route(
    "GET",
    "/api/v1/machines/{id}/power",
    summary="Read a machine's power state",
    response=PowerOut,
    **_ON_MACHINE,
)
async def power_status(req: ApiRequest, bmcs: Bmcs) -> PowerOut:
    """Asks the BMC now (not a cached value)."""
    return PowerOut.model_validate(await bmcs.power(req.params["id"], "status"))


@router.route(
    "POST",
    "/api/v1/machines/{id}/power",
    summary="Power a machine",
    body=PowerRequest,
    response=PowerOut,
    **_ON_MACHINE,
)
async def power_action(req: ApiRequest, bmcs: Bmcs) -> PowerOut | web.Response:
    """on, off, soft-off, cycle, reset or status. An action answers the state the BMC reported
    once it reports the one the action ends in; past ``wait_s`` it answers 202 with the
    command's id. A failure is a 502 naming the BMC's health."""
    b: PowerRequest = req.body
    out = await bmcs.power(req.params["id"], b.action, actor=req.actor, wait_s=b.wait_s)
    return _power_answer(PowerOut.model_validate(out))


@router.route(
    "GET",
    "/api/v1/machines/{id}/power/commands/{command_id}",
    summary="Follow a machine's power command",
    response=PowerCommandOut,
    **{**_ON_MACHINE, "errors": (404, 503)},
)
async def power_command(req: ApiRequest, bmcs: Bmcs) -> PowerCommandOut:
    """A power command answered 202: pending until the BMC reports the target state."""
    out = bmcs.power_command(req.params["command_id"], machine_id=req.params["id"])
    return PowerCommandOut.model_validate(out)


@router.route(
    "PUT",
    "/api/v1/machines/{id}/boot-device",
    summary="Set a machine's next boot device",
    body=BootDeviceRequest,
    response=BootDeviceOut,
    **_ON_MACHINE,
)
async def boot_device(req: ApiRequest, bmcs: Bmcs) -> BootDeviceOut:
    """PXE or disk, for the next boot only or every boot, UEFI or legacy."""
    b: BootDeviceRequest = req.body
    out = await bmcs.set_boot_device(
        req.params["id"], b.device, persistent=b.persistent, uefi=b.uefi, actor=req.actor
    )
    return BootDeviceOut.model_validate(out)


class LocateRequest(In):
    on: StrictBool = Field(description="true lights the chassis identify light until turned off.")


class LocateOut(BaseModel):
    machine_id: str
    bmc_id: str
    on: bool | None = Field(description="What the BMC reports; null where it does not say.")


@router.route(
    "GET",
    "/api/v1/machines/{id}/locate",
    summary="Read a machine's locate light",
    response=LocateOut,
    **_ON_MACHINE,
)
async def locate_status(req: ApiRequest, bmcs: Bmcs) -> LocateOut:
    """Whether the chassis identify light is on, as the BMC reports it now."""
    return LocateOut.model_validate(await bmcs.locate(req.params["id"], None))


@router.route(
    "PUT",
    "/api/v1/machines/{id}/locate",
    summary="Turn a machine's locate light on or off",
    body=LocateRequest,
    response=LocateOut,
    **_ON_MACHINE,
)
async def locate(req: ApiRequest, bmcs: Bmcs) -> LocateOut:
    """IPMI chassis identify, or Redfish LocationIndicatorActive / IndicatorLED: so a
    technician finds the machine in the row. Records a bmc.locate event naming who."""
    b: LocateRequest = req.body
    return LocateOut.model_validate(await bmcs.locate(req.params["id"], b.on, actor=req.actor))


class FirmwareItemOut(BaseModel):
    id: str
    name: str
    version: str | None
    updateable: bool | None


class FirmwareOut(BaseModel):
    machine_id: str
    items: list[FirmwareItemOut]


@router.route(
    "GET",
    "/api/v1/machines/{id}/firmware",
    summary="Read a machine's firmware inventory",
    response=FirmwareOut,
    **_ON_MACHINE,
)
async def firmware_inventory(req: ApiRequest, bmcs: Bmcs) -> FirmwareOut:
    """BMC, BIOS, NIC and GPU firmware versions (Redfish FirmwareInventory), read now and
    recorded on the machine (``firmware_versions``; claims select by them)."""
    return FirmwareOut.model_validate(await bmcs.firmware(req.params["id"], actor=req.actor))


BiosValue = StrictBool | int | Annotated[str, StringConstraints(max_length=256)]


class BiosIn(In):
    attributes: dict[Annotated[str, StringConstraints(min_length=1, max_length=128)], BiosValue] = (
        Field(
            min_length=1,
            max_length=256,
            description="Desired BIOS attributes (Redfish names); what differs is staged as "
            "pending settings, applied at the machine's next reboot.",
        )
    )


class BiosOut(BaseModel):
    machine_id: str
    current: dict[str, Any]
    pending: dict[str, Any]
    desired: dict[str, Any]
    drift: dict[str, Any] = Field(description="Desired attributes neither set nor pending.")
    read_at: str


@router.route(
    "GET",
    "/api/v1/machines/{id}/bios",
    summary="Read a machine's BIOS settings",
    response=BiosOut,
    **_ON_MACHINE,
)
async def bios_settings(req: ApiRequest, bmcs: Bmcs) -> BiosOut:
    """Current and pending attributes, read now; drift from the desired profile is recorded
    on the machine and reported as a bmc.bios-drift event."""
    return BiosOut.model_validate(await bmcs.bios(req.params["id"], actor=req.actor))


@router.route(
    "PUT",
    "/api/v1/machines/{id}/bios",
    summary="Set a machine's desired BIOS settings",
    body=BiosIn,
    response=BiosOut,
    **_ON_MACHINE,
)
async def set_bios_settings(req: ApiRequest, bmcs: Bmcs) -> BiosOut:
    """Replaces the machine's desired profile (the enroll rules set one at inspection) and
    stages what differs; a value the BMC refuses is a 422 with its reason."""
    b: BiosIn = req.body
    out = await bmcs.set_bios(req.params["id"], dict(b.attributes), actor=req.actor)
    return BiosOut.model_validate(out)


class SecureBootIn(In):
    enable: StrictBool = Field(
        description="Write SecureBootEnable: the firmware enforces it from its next boot."
    )
    enroll: StrictBool = Field(
        default=False,
        description="First enroll metald's signing certificate (bmc.secure_boot_cert) in db.",
    )


class SecureBootOut(BaseModel):
    machine_id: str
    enabled: bool | None = Field(description="SecureBootEnable as the BMC reports it.")
    current_boot: bool | None = Field(
        description="SecureBootCurrentBoot: the running boot was verified (true only after a "
        "reboot with Secure Boot on)."
    )
    mode: str | None = Field(description="SetupMode (no PK), UserMode, AuditMode, DeployedMode.")
    certificates: dict[str, list[str]] = Field(
        description="Database (PK, KEK, db, dbx) -> SHA-256 fingerprints of its certificates."
    )
    read_at: str
    enrolled: bool | None = Field(
        default=None, description="POST: metald's certificate was added to db (false: present)."
    )


_SECURE_BOOT: dict[str, Any] = {**_ON_MACHINE, "errors": (404, 409, 422, 502, 503)}


@router.route(
    "GET",
    "/api/v1/machines/{id}/secure-boot",
    summary="Read a machine's UEFI Secure Boot state",
    response=SecureBootOut,
    **_SECURE_BOOT,
)
async def secure_boot(req: ApiRequest, bmcs: Bmcs) -> SecureBootOut:
    """Read now through the machine's Redfish BMC and recorded on the machine (a change is a
    bmc.secure-boot event); an IPMI BMC has no Secure Boot (409)."""
    return SecureBootOut.model_validate(await bmcs.secure_boot(req.params["id"], actor=req.actor))


@router.route(
    "POST",
    "/api/v1/machines/{id}/secure-boot",
    summary="Enable (or disable) a machine's UEFI Secure Boot",
    body=SecureBootIn,
    response=SecureBootOut,
    **{**_SECURE_BOOT, "roles": ADMIN},
)
async def set_secure_boot(req: ApiRequest, bmcs: Bmcs) -> SecureBootOut:
    """Admins only. With enroll, metald's signing certificate is added to the firmware's db
    first; then SecureBootEnable is written. The firmware applies both at its next boot, so
    current_boot stays false until the machine reboots. A bmc.secure-boot-set event; an IPMI
    BMC answers 409."""
    b: SecureBootIn = req.body
    out = await bmcs.set_secure_boot(
        req.params["id"], enable=b.enable, enroll=b.enroll, actor=req.actor
    )
    return SecureBootOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/machines/{id}/sensors",
    summary="Read a machine's sensors",
    response=SensorList,
    **_ON_MACHINE,
)
async def sensors(req: ApiRequest, bmcs: Bmcs) -> SensorList:
    """Temperatures, fans, power draw and the rest, as the BMC reports them now."""
    items = await bmcs.sensors(req.params["id"])
    return SensorList(items=[SensorOut.model_validate(x) for x in items])


@router.route(
    "GET",
    "/api/v1/machines/{id}/bmc-log",
    summary="Read a machine's BMC event log",
    response=LogList,
    **_ON_MACHINE,
)
async def show_bmc_log(req: ApiRequest, bmcs: Bmcs) -> LogList:
    """The BMC's own event log (IPMI SEL, Redfish LogService entries)."""
    items = await bmcs.event_log(req.params["id"])
    return LogList(items=[LogEntryOut.model_validate(x) for x in items])


# ---- vouching for a machine without a BMC (enroll.require_bmc) -------------------------------


@router.route(
    "POST",
    "/api/v1/machines/{id}/approve",
    summary="Approve a machine without a BMC",
    body=ApproveIn,
    response=ApprovalOut,
    errors=(404, 409, 422),
    **_BMC,
)
async def approve_machine(req: ApiRequest, bmcs: Bmcs) -> ApprovalOut:
    """A technician vouches for a self-enrolled machine (its MAC and inventory are its own
    word): with ``enroll.require_bmc`` a machine is claimable only once linked to a BMC or
    approved here. Records a ``machine.approved`` event; approving again keeps the first."""
    b: ApproveIn = req.body
    out = await bmcs.approve(req.params["id"], b.reason, actor=req.actor)
    return ApprovalOut.model_validate(out)


# ---- booting a machine through its BMC (issue 16 item 3) ------------------------------------


class BootRequest(In):
    via: Literal["virtual-media", "network"] = Field(
        description="virtual-media: metald's boot ISO in the BMC's virtual CD (Redfish "
        "VirtualMedia), for networks without DHCP boot options; network: one-time PXE."
    )
    image: Literal["discovery"] = Field(
        "discovery", description="The ISO to boot: metald's iPXE boot image (discovery)."
    )


class BootOut(BaseModel):
    machine_id: str
    via: str
    image_url: str | None = Field(
        description="Where the BMC fetches this boot's ISO (virtual-media only): a URL under "
        "this prefix with the boot's unguessable nonce, valid while the boot is armed."
    )
    state: str


@router.route(
    "POST",
    "/api/v1/machines/{id}/boot",
    summary="Boot a machine through its BMC, from virtual media or the network",
    body=BootRequest,
    response=BootOut,
    **{**_ON_MACHINE, "errors": (404, 409, 422, 502, 503)},
)
async def boot_machine(req: ApiRequest, bmcs: Bmcs) -> web.Response:
    """The network-boot step, started now (202): confirmed power-off, then
    (virtual-media) insert metald's ISO and a one-time CD boot, or (network) a one-time PXE
    boot; the boot is armed, so its first script carries the agent token; then power on.
    Only for a machine metald boots (inspecting, provisioning, wiping)."""
    b: BootRequest = req.body
    out = BootOut.model_validate(await bmcs.boot(req.params["id"], b.via, actor=req.actor))
    return web.json_response(out.model_dump(mode="json"), status=202)
