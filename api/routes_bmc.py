"""/api/v1/bmcs and what a BMC does for a machine: power, next boot device, sensors, event log.

Thin: validation and roles here, everything else in ``metald.bmc.service.BmcService`` (the
daemon hosts it as ``ctx.services.bmc``). No answer carries a BMC password.

With several instances a command for a BMC runs on the instance that owns it: a request that
reaches another one is forwarded to the owner's API URL with the caller's own token (the owner
authorizes it again) and its answer returned as is. A forwarded request is never forwarded
again: if ownership moved meanwhile, the answer is a 503 saying to retry. The forwarding mark
is signed with a key only instances hold (``metald.fleet.forward_auth``): a client that sets it
itself is refused (403), it does not get a non-owner to act on another instance's BMC.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import aiohttp
from aiohttp import web
from pydantic import BaseModel, Field, SecretStr, StrictBool, StringConstraints
from sqlmodel import Session, select

from api.paging import PageQuery, page_items
from api.resolve import Ref
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In
from metald import machines
from metald.bmc import targets
from metald.bmc.capabilities import Capability
from metald.errors import Conflict, MetaldError, Unprocessable
from metald.fleet import forward_auth
from metald.store.models import Bmc, utcnow

router = Router()
TAG = "bmcs"


class ServiceUnavailable(MetaldError):
    status = 503
    title = "Service unavailable"


# ---- addresses ----------------------------------------------------------------------------

_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
_ADDRESS_FORMS = (
    'write a host name or IP ("10.0.0.5", "bmc-r1-07.example", "fd00::5"), optionally with '
    'a port ("10.0.0.5:623", "[fd00::5]:443"); for Redfish over plain HTTP or to force '
    'HTTPS, "http://10.0.0.5" or "https://10.0.0.5:8443"'
)


def parse_bmc_address(address: str, port: int | None, protocol: str) -> tuple[str, int | None]:
    """``address`` as stored (a host or IP, or ``http(s)://host`` for Redfish) and the port,
    taken from the address when it names one; Unprocessable with what to write otherwise."""
    raw = address.strip()
    scheme = ""
    for s in ("https://", "http://"):
        if raw.lower().startswith(s):
            scheme, raw = s, raw[len(s) :]
    if "://" in raw:
        raise Unprocessable(
            f"address: {address!r} has a scheme metald does not speak; {_ADDRESS_FORMS}"
        )
    if scheme and protocol == "ipmi":
        raise Unprocessable(
            f'address: {address!r} is a URL, but IPMI has none; write the host alone ("10.0.0.5")'
        )
    if scheme:
        raw = raw.removesuffix("/")
    if any(c in raw for c in "/?#@ \\"):
        raise Unprocessable(
            f"address: {address!r} is not a host: no path, user, query or spaces; {_ADDRESS_FORMS}"
        )
    host, named_port = raw, None
    if raw.startswith("["):
        end = raw.find("]")
        host, rest = raw[1:end], raw[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise Unprocessable(f"address: {address!r} is not [IPv6]:port; {_ADDRESS_FORMS}")
        named_port = rest[1:] or None
    elif raw.count(":") == 1:
        host, named_port = raw.split(":")
    if named_port is not None:
        if not named_port.isdigit() or not 0 < int(named_port) < 65536:
            raise Unprocessable(f"address: port {named_port!r} is not 1-65535; {_ADDRESS_FORMS}")
        if port is not None and port != int(named_port):
            raise Unprocessable(
                f"address names port {named_port} but port is {port}; give the port once"
            )
        port = int(named_port)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host) or host.replace(".", "").isdigit():
            raise Unprocessable(
                f"address: {address!r} is not a host name or IP; {_ADDRESS_FORMS}"
            ) from None
        ip = None
    shown = f"[{ip}]" if scheme and ip is not None and ip.version == 6 else host
    return (f"{scheme}{shown}" if scheme else (str(ip) if ip is not None else host)), port


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


class BmcList(BaseModel):
    items: list[BmcOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


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


def _bmc(req: ApiRequest) -> Any:
    svc = req.ctx.services.bmc
    if svc is None:
        raise ServiceUnavailable("BMC control is not running in this metald instance")
    return svc


#: Set on a request one instance forwards to a BMC's owner (never forwarded again); signed.
FORWARDED = forward_auth.FORWARDED
#: How long a forwarded command may take at the owner (retries of a slow BMC included).
FORWARD_TIMEOUT_S = 120.0
M = TypeVar("M", bound=BaseModel)


class ForwardFailed(MetaldError):
    status = 502
    title = "BMC owner unreachable"


def forwarded_by(req: ApiRequest) -> str | None:
    """The instance that forwarded this request to us, verified (``forward_auth.verify``: call
    it once per request, a nonce counts once); None for a client's request; 403 when the mark
    is forged, altered, stale or replayed."""
    return forward_auth.verify(req.ctx.secrets, req.raw.method, req.raw.path_qs, req.raw.headers)


def forward_headers(req: ApiRequest) -> dict[str, str]:
    """The signed mark for forwarding this request to the BMC's owner (same method and path)."""
    return forward_auth.sign(req.ctx.secrets, req.raw.method, req.raw.path_qs, req.ctx.instance)


async def _on_owner(
    req: ApiRequest, out: type[M], *, machine_id: str | None = None, bmc_id: str | None = None
) -> M | None:
    """Forward the request to the instance that owns the BMC, when that is another one, and
    return its answer (an error answer raised as the same problem); None: run it here."""
    if forwarded_by(req):
        return None
    url = await _bmc(req).owner_url(machine_id=machine_id, bmc_id=bmc_id)
    if url is None:
        return None
    headers = forward_headers(req)
    if auth := req.raw.headers.get("Authorization"):
        headers["Authorization"] = auth
    body = req.body.model_dump(mode="json") if isinstance(req.body, BaseModel) else None
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as http,
            http.request(
                req.raw.method, url.rstrip("/") + req.raw.path_qs, json=body, headers=headers
            ) as r,
        ):
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise ForwardFailed(
            f"this BMC is owned by the instance at {url}, which did not answer "
            f"({type(e).__name__}); retry, or check that instance",
            owner_url=url,
        ) from None
    if r.status >= 400:
        err = MetaldError(str(data.get("detail") or "the BMC's owner refused the request"))
        err.status, err.title = r.status, str(data.get("title") or "Error")
        err.extra = {k: v for k, v in data.items() if k not in _PROBLEM_FIELDS}
        raise err
    return out.model_validate(data)


_PROBLEM_FIELDS = {"type", "title", "status", "detail", "instance"}


# ---- BMCs -----------------------------------------------------------------------------------


@router.route(
    "POST",
    "/api/v1/bmcs",
    summary="Register a BMC",
    roles=STAFF,
    body=BmcCreate,
    response=BmcOut,
    status=201,
    tag=TAG,
    errors=(404, 409, 422, 503),
    location="/api/v1/bmcs/{id}",
)
async def register_bmc(req: ApiRequest) -> BmcOut:
    """Connects first (422 "could not verify the BMC" naming the failed step, after [bmc]
    verify_s) unless verify is false; only to addresses [bmc] networks allows, never to
    loopback, link-local or metald's own listeners unless configured; links it to its machine."""
    b: BmcCreate = req.body
    address, port = parse_bmc_address(b.address, b.port, b.protocol)
    out = await _bmc(req).register(
        address,
        port,
        b.protocol,
        b.username,
        b.password.get_secret_value(),
        machine_id=b.machine_id,
        verify_tls=b.verify_tls,
        ca_cert=b.ca_cert,
        actor=req.actor,
        verify=b.verify,
        own_listeners=targets.own_listeners(req.ctx.cfg),
    )
    req.ctx.bus.notify()
    return BmcOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/bmcs",
    summary="List BMCs",
    roles=STAFF,
    query=BmcQuery,
    response=BmcList,
    tag=TAG,
    errors=(503,),
)
async def list_bmcs(req: ApiRequest) -> BmcList:
    """Registered BMCs with their health and last known power state, by address, paginated."""
    q: BmcQuery = req.query
    items = [BmcOut.model_validate(x) for x in await _bmc(req).list()]
    limit = req.page_limit(q)
    page, cursor = page_items(items, q, ["address", "id"], limit, getattr)
    return BmcList(
        items=page, total=len(items), limit=limit, offset=q.offset, next=req.next_link(cursor)
    )


@router.route(
    "GET",
    "/api/v1/bmcs/{id}",
    summary="Show a BMC",
    roles=STAFF,
    response=BmcOut,
    tag=TAG,
    errors=(404, 503),
)
async def show_bmc(req: ApiRequest) -> BmcOut:
    """One BMC; health_detail says why it is not ok."""
    return BmcOut.model_validate(await _bmc(req).get(req.params["id"]))


@router.route(
    "PUT",
    "/api/v1/bmcs/{id}/machine",
    summary="Link a BMC to a machine",
    roles=STAFF,
    body=BmcLink,
    response=BmcOut,
    tag=TAG,
    errors=(404, 409, 503),
)
async def link_bmc(req: ApiRequest) -> BmcOut:
    """Link by hand (or unlink with null) when automatic matching could not decide."""
    b: BmcLink = req.body
    out = await _bmc(req).link(req.params["id"], b.machine_id, actor=req.actor)
    req.ctx.bus.notify()
    return BmcOut.model_validate(out)


@router.route(
    "DELETE",
    "/api/v1/bmcs/{id}",
    summary="Remove a BMC",
    roles=STAFF,
    status=204,
    tag=TAG,
    errors=(404, 503),
)
async def remove_bmc(req: ApiRequest) -> None:
    """Forget the BMC and its stored credentials."""
    await _bmc(req).remove(req.params["id"], actor=req.actor)
    req.ctx.bus.notify()


@router.route(
    "GET",
    "/api/v1/bmcs/{id}/power",
    summary="Read a BMC host's power state",
    roles=STAFF,
    response=PowerOut,
    tag=TAG,
    errors=(404, 502, 503),
)
async def bmc_power_status(req: ApiRequest) -> PowerOut:
    """Asks the BMC now; works before the host has enrolled as a machine."""
    if fwd := await _on_owner(req, PowerOut, bmc_id=req.params["id"]):
        return fwd
    return PowerOut.model_validate(await _bmc(req).power_bmc(req.params["id"], "status"))


@router.route(
    "POST",
    "/api/v1/bmcs/{id}/power",
    summary="Power a BMC's host",
    roles=STAFF,
    body=PowerRequest,
    response=PowerOut,
    tag=TAG,
    errors=(404, 422, 502, 503),
)
async def bmc_power_action(req: ApiRequest) -> PowerOut:
    """Zero-touch: power on racks whose machines are not enrolled yet; they PXE-boot, enroll
    themselves, and the BMC is linked to its machine by system UUID, serial or MAC."""
    b: PowerRequest = req.body
    if fwd := await _on_owner(req, PowerOut, bmc_id=req.params["id"]):
        return _power_answer(fwd)
    out = await _bmc(req).power_bmc(req.params["id"], b.action, actor=req.actor, wait_s=b.wait_s)
    req.ctx.bus.notify()
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
    roles=STAFF,
    response=PowerCommandOut,
    tag=TAG,
    errors=(404, 503),
)
async def bmc_power_command(req: ApiRequest) -> PowerCommandOut:
    """A power command answered 202: pending until the BMC reports the target state."""
    if fwd := await _on_owner(req, PowerCommandOut, bmc_id=req.params["id"]):
        return fwd
    out = _bmc(req).power_command(req.params["command_id"], bmc_id=req.params["id"])
    return PowerCommandOut.model_validate(out)


# ---- what a BMC does for a machine -------------------------------------------------------------

_MACHINE_ERRORS = (404, 422, 502, 503)


@router.route(
    "GET",
    "/api/v1/machines/{id}/power",
    summary="Read a machine's power state",
    roles=STAFF,
    response=PowerOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def power_status(req: ApiRequest) -> PowerOut:
    """Asks the BMC now (not a cached value)."""
    if fwd := await _on_owner(req, PowerOut, machine_id=req.params["id"]):
        return fwd
    return PowerOut.model_validate(await _bmc(req).power(req.params["id"], "status"))


@router.route(
    "POST",
    "/api/v1/machines/{id}/power",
    summary="Power a machine",
    roles=STAFF,
    body=PowerRequest,
    response=PowerOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def power_action(req: ApiRequest) -> PowerOut:
    """on, off, soft-off, cycle, reset or status. An action answers the state the BMC reported
    once it reports the one the action ends in; past ``wait_s`` it answers 202 with the
    command's id. A failure is a 502 naming the BMC's health."""
    b: PowerRequest = req.body
    if fwd := await _on_owner(req, PowerOut, machine_id=req.params["id"]):
        return _power_answer(fwd)
    out = await _bmc(req).power(req.params["id"], b.action, actor=req.actor, wait_s=b.wait_s)
    req.ctx.bus.notify()
    return _power_answer(PowerOut.model_validate(out))


@router.route(
    "GET",
    "/api/v1/machines/{id}/power/commands/{command_id}",
    summary="Follow a machine's power command",
    roles=STAFF,
    response=PowerCommandOut,
    tag=TAG,
    errors=(404, 503),
)
async def power_command(req: ApiRequest) -> PowerCommandOut:
    """A power command answered 202: pending until the BMC reports the target state."""
    if fwd := await _on_owner(req, PowerCommandOut, machine_id=req.params["id"]):
        return fwd
    out = _bmc(req).power_command(req.params["command_id"], machine_id=req.params["id"])
    return PowerCommandOut.model_validate(out)


@router.route(
    "PUT",
    "/api/v1/machines/{id}/boot-device",
    summary="Set a machine's next boot device",
    roles=STAFF,
    body=BootDeviceRequest,
    response=BootDeviceOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def boot_device(req: ApiRequest) -> BootDeviceOut:
    """PXE or disk, for the next boot only or every boot, UEFI or legacy."""
    b: BootDeviceRequest = req.body
    if fwd := await _on_owner(req, BootDeviceOut, machine_id=req.params["id"]):
        return fwd
    out = await _bmc(req).set_boot_device(
        req.params["id"], b.device, persistent=b.persistent, uefi=b.uefi, actor=req.actor
    )
    req.ctx.bus.notify()
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
    roles=STAFF,
    response=LocateOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def locate_status(req: ApiRequest) -> LocateOut:
    """Whether the chassis identify light is on, as the BMC reports it now."""
    if fwd := await _on_owner(req, LocateOut, machine_id=req.params["id"]):
        return fwd
    return LocateOut.model_validate(await _bmc(req).locate(req.params["id"], None))


@router.route(
    "PUT",
    "/api/v1/machines/{id}/locate",
    summary="Turn a machine's locate light on or off",
    roles=STAFF,
    body=LocateRequest,
    response=LocateOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def locate(req: ApiRequest) -> LocateOut:
    """IPMI chassis identify, or Redfish LocationIndicatorActive / IndicatorLED: so a
    technician finds the machine in the row. Records a bmc.locate event naming who."""
    b: LocateRequest = req.body
    if fwd := await _on_owner(req, LocateOut, machine_id=req.params["id"]):
        return fwd
    out = await _bmc(req).locate(req.params["id"], b.on, actor=req.actor)
    req.ctx.bus.notify()
    return LocateOut.model_validate(out)


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
    roles=STAFF,
    response=FirmwareOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def firmware_inventory(req: ApiRequest) -> FirmwareOut:
    """BMC, BIOS, NIC and GPU firmware versions (Redfish FirmwareInventory), read now and
    recorded on the machine (``firmware_versions``; claims select by them)."""
    if fwd := await _on_owner(req, FirmwareOut, machine_id=req.params["id"]):
        return fwd
    out = FirmwareOut.model_validate(await _bmc(req).firmware(req.params["id"], actor=req.actor))
    req.ctx.bus.notify()
    return out


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
    roles=STAFF,
    response=BiosOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def bios_settings(req: ApiRequest) -> BiosOut:
    """Current and pending attributes, read now; drift from the desired profile is recorded
    on the machine and reported as a bmc.bios-drift event."""
    if fwd := await _on_owner(req, BiosOut, machine_id=req.params["id"]):
        return fwd
    out = BiosOut.model_validate(await _bmc(req).bios(req.params["id"], actor=req.actor))
    req.ctx.bus.notify()
    return out


@router.route(
    "PUT",
    "/api/v1/machines/{id}/bios",
    summary="Set a machine's desired BIOS settings",
    roles=STAFF,
    body=BiosIn,
    response=BiosOut,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def set_bios_settings(req: ApiRequest) -> BiosOut:
    """Replaces the machine's desired profile (the enroll rules set one at inspection) and
    stages what differs; a value the BMC refuses is a 422 with its reason."""
    b: BiosIn = req.body
    if fwd := await _on_owner(req, BiosOut, machine_id=req.params["id"]):
        return fwd
    out = await _bmc(req).set_bios(req.params["id"], dict(b.attributes), actor=req.actor)
    req.ctx.bus.notify()
    return BiosOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/machines/{id}/sensors",
    summary="Read a machine's sensors",
    roles=STAFF,
    response=SensorList,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def sensors(req: ApiRequest) -> SensorList:
    """Temperatures, fans, power draw and the rest, as the BMC reports them now."""
    if fwd := await _on_owner(req, SensorList, machine_id=req.params["id"]):
        return fwd
    items = await _bmc(req).sensors(req.params["id"])
    return SensorList(items=[SensorOut.model_validate(x) for x in items])


@router.route(
    "GET",
    "/api/v1/machines/{id}/bmc-log",
    summary="Read a machine's BMC event log",
    roles=STAFF,
    response=LogList,
    tag=TAG,
    errors=_MACHINE_ERRORS,
)
async def show_bmc_log(req: ApiRequest) -> LogList:
    """The BMC's own event log (IPMI SEL, Redfish LogService entries)."""
    if fwd := await _on_owner(req, LogList, machine_id=req.params["id"]):
        return fwd
    items = await _bmc(req).event_log(req.params["id"])
    return LogList(items=[LogEntryOut.model_validate(x) for x in items])


# ---- vouching for a machine without a BMC (enroll.require_bmc) -------------------------------


@router.route(
    "POST",
    "/api/v1/machines/{id}/approve",
    summary="Approve a machine without a BMC",
    roles=STAFF,
    body=ApproveIn,
    response=ApprovalOut,
    tag=TAG,
    errors=(404, 409, 422),
)
async def approve_machine(req: ApiRequest) -> ApprovalOut:
    """A technician vouches for a self-enrolled machine (its MAC and inventory are its own
    word): with ``enroll.require_bmc`` a machine is claimable only once linked to a BMC or
    approved here. Records a ``machine.approved`` event; approving again keeps the first."""
    b: ApproveIn = req.body

    def run(s: Session) -> ApprovalOut:
        m = machines.get_machine(s, req.params["id"])
        linked = s.exec(select(Bmc.id).where(Bmc.machine_id == m.id)).first() is not None
        if m.approved_at is None:
            m = machines.update_fields(
                s,
                m.id,
                actor=req.actor,
                kind="machine.approved",
                values={"approved_at": utcnow(), "approved_by": req.actor},
                data={"reason": b.reason, "bmc_linked": linked},
                instance=req.ctx.instance,
            )
        return ApprovalOut(
            machine_id=m.id,
            approved_at=m.approved_at,
            approved_by=m.approved_by,
            bmc_linked=linked,
        )

    out = await req.ctx.store.run(run)
    req.ctx.bus.notify()
    return out


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
    roles=STAFF,
    body=BootRequest,
    response=BootOut,
    tag=TAG,
    errors=(404, 409, 422, 502, 503),
)
async def boot_machine(req: ApiRequest) -> BootOut | web.Response:
    """The network-boot step, started now (202): confirmed power-off, then
    (virtual-media) insert metald's ISO and a one-time CD boot, or (network) a one-time PXE
    boot; the boot is armed, so its first script carries the agent token; then power on.
    Only for a machine metald boots (inspecting, provisioning, wiping)."""
    from api.workflows import provisioner
    from metald.bmc import media as virtual_media
    from metald.lifecycle import NETWORK_BOOT, State
    from metald.provision import netboot

    b: BootRequest = req.body
    mid = req.params["id"]
    if fwd := await _on_owner(req, BootOut, machine_id=mid):
        return web.json_response(fwd.model_dump(mode="json"), status=202)
    svc = _bmc(req)
    m = await req.ctx.store.run(machines.get_machine, mid)
    if State(m.state) not in NETWORK_BOOT:
        booting = ", ".join(sorted(s.value for s in NETWORK_BOOT))
        raise Conflict(
            f"machine {mid} is {m.state}: metald boots a machine only in {booting}; "
            "claim, inspect or release it first (or use PUT .../power for a plain power action)",
            state=m.state,
        )
    url = None
    if b.via == "virtual-media":
        base = virtual_media.boot_base(svc.control)
        if base is None:
            raise virtual_media.no_boot_url(req.ctx.cfg, mid)  # 409: the keys to set
        await virtual_media.check_for(svc.control, mid)
        url = f"{base}/boot/n/{mid}/"  # + the boot's nonce, once armed
    else:
        await svc.control.row_for_machine(mid)  # 404 with what to do when it has no BMC
    provisioner(req.ctx).spawn(
        netboot.boot_from_network(
            req.ctx.store, svc, mid, actor=req.actor, instance=req.ctx.instance, via=b.via
        )
    )
    out = BootOut(machine_id=mid, via=b.via, image_url=url, state=m.state)
    return web.json_response(out.model_dump(mode="json"), status=202)
