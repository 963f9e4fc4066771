"""/api/v1/firmware: baselines per SKU profile (admins write them, staff read them), the
fleet's compliance with them, and firmware updates of one machine through its BMC
(``metald.firmware``; docs/firmware.md)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints, TypeAdapter, ValidationError

from api import listing, workflows
from api.paging import PageQuery
from api.roles import ADMIN
from api.routes_claims import SelectorIn
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In, Name
from metald.errors import Unprocessable
from metald.firmware.baselines import ApplyKind, BaselineSpec, Component
from metald.usecases.firmware import Firmware, Rollouts, RolloutSpec

router = Router()
TAG = "firmware"
_NAME: TypeAdapter[str] = TypeAdapter(Name)


class BaselineIn(In):
    components: list[Component] = Field(
        min_length=1,
        max_length=64,
        description="Each: id (a FirmwareInventory id, or a glob over ids such as 'GPU*'), "
        "version (as the BMC reports it), and, for metald to flash it, url (http, https or "
        "file) and sha256 of the image, and apply (none, host-reset, bmc-reset).",
    )
    note: Annotated[str, StringConstraints(max_length=500)] | None = None


class ComponentOut(BaseModel):
    id: str
    version: str
    url: str | None
    sha256: str | None
    apply: ApplyKind


class BaselineVersion(BaseModel):
    version: int
    components: list[ComponentOut]
    note: str | None
    created_by: str
    created_at: datetime


class BaselineOut(BaseModel):
    id: str
    profile: str
    version: int
    components: list[ComponentOut]
    note: str | None
    created_by: str
    created_at: datetime
    #: Earlier versions, newest first (only when one profile is shown).
    history: list[BaselineVersion] | None = None


class BaselineQuery(PageQuery):
    SORTABLE = ("profile",)


class BaselineList(BaseModel):
    items: list[BaselineOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


class FindingOut(BaseModel):
    component: str
    item: str | None = Field(description="The FirmwareInventory id; null when none matched.")
    want: str
    have: str | None
    status: str = Field(description="ok, differs, missing (no such item), unknown (never read).")
    direction: str | None = Field(description="older / newer when the versions read as numbers.")


class ComplianceOut(BaseModel):
    machine_id: str
    name: str | None
    state: str
    rack: str | None
    profile: str
    baseline_version: int
    compliant: bool
    off_baseline: list[FindingOut]
    components: list[FindingOut]


class ComplianceQuery(PageQuery):
    SORTABLE = ("profile", "state", "rack", "name")
    profile: Name | None = Field(default=None, description="Only machines of this profile.")
    all: bool = Field(default=False, description="List compliant machines too.")


class ComplianceList(BaseModel):
    items: list[ComplianceOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


@router.route(
    "PUT",
    "/api/v1/firmware/baselines/{id}",
    summary="Set a profile's firmware baseline",
    roles=ADMIN,
    body=BaselineIn,
    response=BaselineOut,
    tag=TAG,
    errors=(409, 422),
    use_case=workflows.firmware,
)
async def put_baseline(req: ApiRequest, firmware: Firmware) -> BaselineOut:
    """Store a new version of the SKU profile's baseline (the enroll rules' commissioning
    profile name); the earlier versions are kept. Admins only: a baseline says which images
    metald flashes on the fleet."""
    b: BaselineIn = req.body
    out = await firmware.put_baseline(
        req.require_principal(),
        _profile(req),
        BaselineSpec(components=b.components),
        note=b.note,
        actor=req.actor,
    )
    return BaselineOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/firmware/baselines",
    summary="List firmware baselines",
    roles=STAFF,
    query=BaselineQuery,
    response=BaselineList,
    tag=TAG,
    use_case=workflows.firmware,
)
async def list_baselines(req: ApiRequest, firmware: Firmware) -> BaselineList:
    """The newest baseline of each profile, by profile."""
    paging = listing.paging(req)
    page = await firmware.baselines(req.require_principal(), paging)
    return listing.answer(BaselineList, page, paging, req)


@router.route(
    "GET",
    "/api/v1/firmware/baselines/{id}",
    summary="Show a profile's firmware baseline",
    roles=STAFF,
    response=BaselineOut,
    tag=TAG,
    errors=(404, 422),
    use_case=workflows.firmware,
)
async def show_baseline(req: ApiRequest, firmware: Firmware) -> BaselineOut:
    """The newest version, with the earlier ones in ``history``."""
    return BaselineOut.model_validate(
        await firmware.baseline(req.require_principal(), _profile(req))
    )


@router.route(
    "GET",
    "/api/v1/firmware/compliance",
    summary="List machines off their firmware baseline",
    roles=STAFF,
    query=ComplianceQuery,
    response=ComplianceList,
    tag=TAG,
    use_case=workflows.firmware,
)
async def compliance(req: ApiRequest, firmware: Firmware) -> ComplianceList:
    """Machines whose SKU profile has a baseline, compared with its newest version from the
    firmware versions last read through their BMCs (``GET /api/v1/machines/{id}/firmware``
    reads them again): the components off baseline (differs, missing, unknown). Only the
    machines off baseline unless ``all=true``."""
    q: ComplianceQuery = req.query
    paging = listing.paging(req)
    page = await firmware.compliance(
        req.require_principal(), paging, profile=q.profile, include_compliant=q.all
    )
    return listing.answer(ComplianceList, page, paging, req)


def _profile(req: ApiRequest) -> str:
    value = req.params["id"]  # the path's {id}: a baseline is named by its SKU profile
    try:
        return _NAME.validate_python(value)
    except ValidationError:
        raise Unprocessable(
            f"{value[:80]!r} is not a profile name: letters, digits, '.', '_' and '-', "
            "at most 63 characters, starting with a letter or digit"
        ) from None


class UpdateIn(In):
    components: list[Annotated[str, StringConstraints(min_length=1, max_length=128)]] | None = (
        Field(
            default=None,
            max_length=64,
            description="FirmwareInventory ids or baseline component ids; absent: every component "
            "off baseline that has an image.",
        )
    )


class UpdateOut(BaseModel):
    id: str
    machine_id: str
    bmc_id: str
    profile: str
    baseline_version: int
    component: str
    item: str
    version_before: str | None
    version: str
    sha256: str
    apply: str
    transfer: str | None
    phase: str = Field(
        description="queued, offering, flashing, applying, verifying, done or failed."
    )
    task_uri: str | None
    percent: int | None
    journal: list[dict[str, Any]]
    error: str | None
    requested_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class UpdateList(BaseModel):
    items: list[UpdateOut]


@router.route(
    "POST",
    "/api/v1/machines/{id}/firmware/update",
    summary="Update a machine's firmware to its baseline",
    roles=STAFF,
    body=UpdateIn,
    response=UpdateList,
    status=202,
    tag=TAG,
    errors=(404, 409, 422, 503),
    use_case=workflows.firmware,
)
async def update_firmware(req: ApiRequest, firmware: Firmware) -> UpdateList:
    """For a machine in maintenance whose BMC speaks Redfish: flash every component off its
    profile's baseline that has an image (or only ``components``), one after another, in the
    background. metald verifies each image's SHA-256 before it offers it; the BMC pulls it
    from the boot listener (SimpleUpdate) or metald pushes it (multipart); the host is
    power-cycled (or the BMC reset) only after the BMC's task completed, and an update is
    done only once the new version is read back. Progress: ``firmware.update`` events and
    ``GET .../firmware/updates``. IPMI BMCs are refused (422): IPMI has no standard update."""
    b: UpdateIn = req.body
    items = await firmware.update(
        req.require_principal(), req.params["id"], components=b.components, actor=req.actor
    )
    return UpdateList(items=[UpdateOut.model_validate(i) for i in items])


@router.route(
    "GET",
    "/api/v1/machines/{id}/firmware/updates",
    summary="List a machine's firmware updates",
    roles=STAFF,
    response=UpdateList,
    tag=TAG,
    errors=(404, 503),
    use_case=workflows.firmware,
)
async def list_updates(req: ApiRequest, firmware: Firmware) -> UpdateList:
    """The machine's last 50 updates, newest first, each with its phase, the BMC's task and
    progress, and the steps taken."""
    items = await firmware.updates_of(req.require_principal(), req.params["id"])
    return UpdateList(items=[UpdateOut.model_validate(i) for i in items])


# --- rollouts: waves across the fleet ---


class RolloutIn(In):
    profile: Name = Field(description="The SKU profile whose machines are updated.")
    version: int = Field(ge=1, description="The profile's baseline version to roll out.")
    selector: SelectorIn = Field(
        default_factory=SelectorIn,
        description="Which machines of the profile: the claims' selector (rack, labels, "
        "gpu_model, min_gpu_count, min_memory_mb, firmware ...). Empty: all of them.",
    )
    batch_size: int = Field(default=10, ge=1, le=1000, description="Machines per wave.")
    max_unavailable: int = Field(
        default=10, ge=1, le=1000, description="At most this many machines updating at once."
    )
    failure_budget: int = Field(
        default=1,
        ge=1,
        le=10000,
        description="The rollout stops (nothing more starts) once this many machines failed.",
    )
    in_use: Literal["skip", "wait", "drain"] = Field(
        default="skip",
        description="A machine a tenant holds: skipped, updated once released (wait), or, "
        "where its claim's tenant consented (PUT /api/v1/claims/{id}/firmware-consent), "
        "drained through the Day-2 path (out of the claim, replaced by the claim's health "
        "policy, wiped) and updated from the pool (drain; without consent: wait).",
    )


class RolloutTargetOut(BaseModel):
    machine_id: str
    seq: int
    status: str = Field(
        description="pending, waiting, draining, updating, done, failed or skipped."
    )
    wave: int | None
    prior_state: str | None
    error: str | None
    started_at: datetime | None
    finished_at: datetime | None


class RolloutProgress(BaseModel):
    total: int
    pending: int
    waiting: int
    draining: int = 0
    updating: int
    done: int
    failed: int
    skipped: int
    percent: int = Field(description="Machines ended (done, failed or skipped), in percent.")
    wave: int = Field(description="The newest wave (0: none yet).")


class RolloutOut(BaseModel):
    id: str
    profile: str
    baseline_version: int
    selector: dict[str, Any]
    batch_size: int
    max_unavailable: int
    failure_budget: int
    in_use: str
    state: str = Field(description="running, paused, done, stopped (budget spent) or aborted.")
    reason: str | None
    owner: str | None = Field(description="The metald instance driving it now.")
    lease_until: datetime | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    progress: RolloutProgress
    targets: list[RolloutTargetOut] | None = None


class RolloutList(BaseModel):
    items: list[RolloutOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


class RolloutQuery(PageQuery):
    SORTABLE = ("created_at",)


class RolloutActionIn(In):
    action: Literal["pause", "resume", "abort"]


@router.route(
    "POST",
    "/api/v1/firmware/rollouts",
    summary="Start a firmware rollout",
    roles=ADMIN,
    body=RolloutIn,
    response=RolloutOut,
    status=202,
    tag=TAG,
    errors=(409, 422),
    use_case=workflows.rollouts,
)
async def create_rollout(req: ApiRequest, rollouts: Rollouts) -> RolloutOut:
    """Update every machine of the profile that the selector matches and that is off the
    baseline version, in waves of ``batch_size`` with at most ``max_unavailable`` at once,
    each taken into maintenance (no claim takes it) and back to ready once updated. The
    rollout stops once ``failure_budget`` machines failed. Machines in use are skipped, waited
    for, or drained with their tenant's consent (``in_use``). Progress: ``firmware.rollout*`` events and
    ``GET /api/v1/firmware/rollouts/{id}``. Admins only."""
    b: RolloutIn = req.body
    spec = RolloutSpec(
        profile=b.profile,
        version=b.version,
        selector=b.selector.model_dump(),
        batch_size=b.batch_size,
        max_unavailable=b.max_unavailable,
        failure_budget=b.failure_budget,
        in_use=b.in_use,
    )
    out = await rollouts.create(req.require_principal(), spec, actor=req.actor)
    return RolloutOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/firmware/rollouts",
    summary="List firmware rollouts",
    roles=STAFF,
    query=RolloutQuery,
    response=RolloutList,
    tag=TAG,
    use_case=workflows.rollouts,
)
async def list_rollouts(req: ApiRequest, rollouts: Rollouts) -> RolloutList:
    """Newest first, each with its progress (without its targets)."""
    paging = listing.paging(req)
    page = await rollouts.list(req.require_principal(), paging)
    return listing.answer(RolloutList, page, paging, req)


@router.route(
    "GET",
    "/api/v1/firmware/rollouts/{id}",
    summary="Show a firmware rollout",
    roles=STAFF,
    response=RolloutOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.rollouts,
)
async def show_rollout(req: ApiRequest, rollouts: Rollouts) -> RolloutOut:
    """The rollout, its progress, and each machine's status, wave and error."""
    return RolloutOut.model_validate(await rollouts.get(req.require_principal(), req.params["id"]))


@router.route(
    "POST",
    "/api/v1/firmware/rollouts/{id}/actions",
    summary="Pause, resume or abort a firmware rollout",
    roles=ADMIN,
    body=RolloutActionIn,
    response=RolloutOut,
    tag=TAG,
    errors=(404, 409),
    use_case=workflows.rollouts,
)
async def rollout_action(req: ApiRequest, rollouts: Rollouts) -> RolloutOut:
    """``pause``: nothing more starts until ``resume``; ``abort``: nothing more starts ever.
    Flashes under way finish either way (a flash is never cut off). Admins only."""
    b: RolloutActionIn = req.body
    out = await rollouts.act(req.require_principal(), req.params["id"], b.action, actor=req.actor)
    return RolloutOut.model_validate(out)
