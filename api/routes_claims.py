"""/api/v1/claims: an orchestrator claims machines for a tenant, watches them, releases them.

An orchestrator claims and releases machines for the tenants in its scope only; a claim of
another tenant is reported as absent. Staff read every claim; admins may claim for any tenant.
The flows themselves are ``metald.claims.workflow``'s.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from api import listing, workflows
from api.resolve import Ref
from api.roles import CLAIMERS, READERS
from api.routing import ApiRequest, Router
from api.schemas import (
    SQL_INT_MAX,
    ImageRef,
    In,
    LabelKey,
    LabelValue,
    ListPage,
    Name,
    PageQuery,
    TenantRef,
    Text,
)
from metald.usecases.claims import Claims

router = Router()
TAG = "claims"
SshKey = Annotated[
    str,
    StringConstraints(
        max_length=16384,
        pattern=r"^(ssh-(rsa|ed25519|dss)|ecdsa-sha2-nistp(256|384|521)|"
        r"sk-(ssh-ed25519|ecdsa-sha2-nistp256)@openssh\.com) [A-Za-z0-9+/=]+( [^\r\n]*)?$",
    ),
]


# ---- models -----------------------------------------------------------------------------


class SelectorIn(In):
    gpu_model: Text | None = Field(
        default=None, description="Exact GPU model, or a glob such as 'NVIDIA H100*'."
    )
    min_gpu_count: int = Field(default=0, ge=0, le=1024)
    min_memory_mb: int | None = Field(default=None, ge=0, le=SQL_INT_MAX)
    labels: dict[LabelKey, LabelValue] = Field(default={}, max_length=64)
    rack: Name | None = None
    commissioned_within_days: float | None = Field(
        default=None,
        gt=0,
        le=3650,
        description="Only machines whose commissioning passed "
        "within this many days (docs/commissioning.md).",
    )
    commission_profile: Name | None = Field(
        default=None, description="Only machines that passed commissioning with this profile."
    )
    firmware: dict[Name, Text] = Field(
        default={},
        max_length=16,
        description="Firmware inventory id -> version or glob ({'BIOS': '2.19.*'}); machines "
        "whose BMC reported no such item do not match.",
    )
    arch: Literal["amd64", "arm64"] | None = Field(
        default=None,
        description="CPU architecture. Unset: the image's (an image is built for one); set "
        "to another than the image's: refused (422).",
    )


class ClaimCreate(In):
    tenant_id: TenantRef = Field(description="The tenant's id, name or an 8+ character id prefix.")
    count: int = Field(ge=1, le=1024)
    selector: SelectorIn = SelectorIn()
    image_id: ImageRef = Field(description="The image's id, name or an 8+ character id prefix.")
    ssh_authorized_keys: list[SshKey] = Field(
        default=[], max_length=32, description="Public keys for the machines' first boot."
    )
    idempotency_key: Annotated[str, StringConstraints(min_length=1, max_length=200)] | None = Field(
        default=None, description="A retried request with the same key gets the same claim."
    )


class ProgressOut(BaseModel):
    phase: str | None = None
    percent: float | None = None
    bytes: int | None = None
    rate_bps: float | None = None
    error: str | None = None
    done: bool = False
    at: datetime | None = None


class ClaimMachineOut(BaseModel):
    id: str
    name: str | None
    state: str
    gpu_model: str | None
    gpu_count: int
    last_error: str | None
    progress: ProgressOut | None = None


class ClaimOut(BaseModel):
    id: str
    tenant_id: str
    count: int
    selector: dict[str, Any]
    image_id: str | None
    ssh_authorized_keys: list[str] = []
    state: str
    version: int = Field(description="Bumped by every change; the ETag, for If-Match.")
    idempotency_key: str | None
    created_by: str | None
    created_at: datetime
    updated_at: datetime
    #: True when an idempotency key matched an earlier claim (nothing new was allocated).
    replayed: bool = False
    machines: list[ClaimMachineOut] = []


class ClaimList(ListPage[ClaimOut]):
    """One page of claims."""


class ClaimQuery(PageQuery):
    SORTABLE = ("state", "created_at", "updated_at", "count")
    tenant_id: Annotated[str, Ref("tenants")] | None = Field(
        default=None, description="The tenant's id, name or an 8+ character id prefix."
    )
    state: Literal["allocated", "released"] | None = None


# ---- claims -----------------------------------------------------------------------------


@router.route(
    "POST",
    "/api/v1/claims",
    summary="Claim machines",
    roles=CLAIMERS,
    body=ClaimCreate,
    response=ClaimOut,
    status=201,
    tag=TAG,
    errors=(404, 409, 422),
    location="/api/v1/claims/{id}",
    use_case=workflows.claims,
)
async def create_claim(req: ApiRequest, claims: Claims) -> ClaimOut:
    """Allocate ``count`` machines matching the selector to the tenant, all or none, and start
    installing the image on them. A repeated ``idempotency_key`` returns the first claim
    (``replayed``); the same key with a different request is 409. Too few machines: 422 with
    ``matched`` (machines matching the selector) and ``available`` (of those, ready and free)."""
    b: ClaimCreate = req.body
    out = await claims.claim(
        req.require_principal(),
        actor=req.actor,
        tenant_id=b.tenant_id,
        count=b.count,
        selector=b.selector.model_dump(),
        image_id=b.image_id,
        idempotency_key=b.idempotency_key or req.raw.headers.get("Idempotency-Key") or None,
        ssh_authorized_keys=b.ssh_authorized_keys,
    )
    return ClaimOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/claims",
    summary="List claims",
    roles=READERS,
    query=ClaimQuery,
    response=ClaimList,
    tag=TAG,
    use_case=workflows.claims,
)
async def list_claims(req: ApiRequest, claims: Claims) -> ClaimList:
    """Claims visible to the caller (an orchestrator: its tenants' only), newest first."""
    p = req.require_principal()
    return await listing.listed(req, ClaimList, lambda paging: claims.list(p, req.query, paging))


@router.route(
    "GET",
    "/api/v1/claims/{id}",
    summary="Show a claim",
    roles=READERS,
    response=ClaimOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.claims,
)
async def show_claim(req: ApiRequest, claims: Claims) -> ClaimOut:
    """One claim with each machine's state and latest progress (phase, percent, bytes, rate)."""
    return ClaimOut.model_validate(await claims.show(req.require_principal(), req.params["id"]))


#: What both releases declare (the claim's, one machine's).
_RELEASE: dict[str, Any] = {
    "roles": CLAIMERS,
    "response": ClaimOut,
    "tag": TAG,
    "errors": (404, 409),
    "versioned": True,
    "use_case": workflows.claims,
}


@router.route(
    "POST",
    "/api/v1/claims/{id}/release",
    summary="Release a claim",
    **_RELEASE,
)
async def release_claim(req: ApiRequest, claims: Claims) -> ClaimOut:
    """End the claim: each machine leaves the tenant (tokens revoked, off the hub, detached),
    then metald powers it off through its BMC and boots it into the wipe image; it returns to
    ready when the wipe agent's evidence fits its recorded disks (a failed wipe leaves it in
    wipe-failed; a machine without a BMC waits for a technician's confirm-wipe). A machine
    marked broken during the claim is detached and owes a wipe. Releasing a released claim
    changes nothing."""
    return await _release(req, claims)


@router.route(
    "POST",
    "/api/v1/claims/{id}/machines/{machine_id}/release",
    summary="Release one machine of a claim",
    **_RELEASE,
)
async def release_claim_machine(req: ApiRequest, claims: Claims) -> ClaimOut:
    """Scale a claim down by one machine: it leaves the tenant (tokens revoked, off the hub and
    out of the cluster) and is wiped back to ready. The claim ends with its last machine."""
    return await _release(req, claims)


async def _release(req: ApiRequest, claims: Claims) -> ClaimOut:
    """The claim, or the one machine of it the path names, released as the caller; only at
    the version ``If-Match`` names, if it names one."""
    out = await claims.release(
        req.require_principal(),
        req.params["id"],
        actor=req.actor,
        if_match=req.if_match,
        machine_id=req.params.get("machine_id"),
    )
    return ClaimOut.model_validate(out)
