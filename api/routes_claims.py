"""/api/v1/claims, /api/v1/images, machine retry and agent progress: allocation and provisioning.

An orchestrator claims and releases machines for the tenants in its scope only; a claim of
another tenant is reported as absent. Staff read every claim; admins may claim for any tenant.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints
from sqlalchemy import func
from sqlmodel import Session, col, select

from api.routes_machines import load_visible, machine_out
from api.routing import ApiRequest, Router
from api.schemas import In, LabelKey, LabelValue, MachineOut, Name, Query
from api.workflows import claim_workflow
from metald.auth import Principal, Role, require_agent_phase
from metald.claims import images
from metald.claims.allocation import Selector
from metald.claims.provisioning import next_step
from metald.claims.records import claim_machines, latest_progress
from metald.claims.workflow import ClaimRequest
from metald.errors import NotFound
from metald.machines import get_machine
from metald.provision.images import normalize_spec
from metald.provision.progress import Progress, record_progress
from metald.provision.redact import redact_spec
from metald.store.models import Claim, Image, Machine, Nic

router = Router()
TAG = "claims"
CLAIMERS = frozenset({Role.ADMIN, Role.ORCHESTRATOR})
READERS = frozenset({Role.ADMIN, Role.TECHNICIAN, Role.ORCHESTRATOR})
STAFF = frozenset({Role.ADMIN, Role.TECHNICIAN})
AGENT = frozenset({Role.AGENT})
Text = Annotated[str, StringConstraints(min_length=1, max_length=500)]
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
    min_memory_mb: int | None = Field(default=None, ge=0)
    labels: dict[LabelKey, LabelValue] = Field(default={}, max_length=64)
    rack: Name | None = None


class ClaimCreate(In):
    tenant_id: Text
    count: int = Field(ge=1, le=1024)
    selector: SelectorIn = SelectorIn()
    image_id: Text
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
    idempotency_key: str | None
    created_by: str | None
    created_at: datetime
    updated_at: datetime
    #: True when an idempotency key matched an earlier claim (nothing new was allocated).
    replayed: bool = False
    machines: list[ClaimMachineOut] = []


class ClaimList(BaseModel):
    items: list[ClaimOut]
    total: int


class ClaimQuery(Query):
    tenant_id: str | None = None
    state: Literal["allocated", "released"] | None = None
    limit: int = Field(default=100, ge=1, le=1000)
    offset: int = Field(default=0, ge=0)


class ImageCreate(In):
    name: Name
    kind: Literal["stateless", "disk"]
    kernel: Text | None = Field(default=None, description="stateless: kernel URL or asset path.")
    initrd: Text | None = Field(default=None, description="stateless: initrd URL or asset path.")
    rootfs: Text | None = Field(default=None, description="stateless: rootfs URL or asset path.")
    kernel_args: dict[str, str] | None = Field(default=None, max_length=64)
    url: Text | None = Field(default=None, description="disk: http(s) URL of the image.")
    sha256: Text | None = Field(default=None, description="disk: SHA-256, 64 hex digits.")
    format: Literal["raw", "qcow2"] | None = None
    size_bytes: int | None = Field(default=None, gt=0)
    tenants: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default=[],
        max_length=256,
        description="Tenant ids whose orchestrators may see and claim it; empty: public.",
    )


class ImageOut(BaseModel):
    id: str
    name: str
    kind: str
    spec: dict[str, Any] = Field(
        description="As stored for admins; for others URL credentials (userinfo, signature "
        "and token query values) and secret-looking kernel arguments read REDACTED."
    )
    tenants: list[str]
    created_by: str | None
    created_at: datetime


class ImageList(BaseModel):
    items: list[ImageOut]


class RetryIn(In):
    reason: Annotated[str, StringConstraints(max_length=500)] | None = None
    version: int | None = Field(
        default=None, description="Fail with 409 unless the machine is at this version."
    )


class VerifyReadIn(In):
    offset: int = Field(ge=0)
    length: int = Field(ge=0)
    #: Every byte read back was zero.
    zero: bool


class WipedDiskIn(In):
    device: Annotated[str, StringConstraints(min_length=6, max_length=64, pattern=r"^/dev/\S+$")]
    size_bytes: int = Field(ge=0)
    method: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    reads: list[VerifyReadIn] = Field(default=[], max_length=16)


class ProgressIn(In):
    phase: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    percent: float | None = Field(default=None, ge=0, le=100)
    bytes: int | None = Field(default=None, ge=0)
    rate_bps: float | None = Field(default=None, ge=0)
    done: bool = False
    error: Annotated[str, StringConstraints(min_length=1, max_length=1000)] | None = None
    disks: list[WipedDiskIn] | None = Field(
        default=None,
        max_length=256,
        description="Wipe reports: per disk wiped, its device, size, method and verification "
        "reads. A wipe is done only with every disk recorded at inspection here.",
    )


class TechnicianNote(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    version: int | None = Field(
        default=None, description="Fail with 409 unless the machine is at this version."
    )


class ProgressAccepted(BaseModel):
    machine_id: str
    state: str


class ProvisionInstruction(BaseModel):
    #: provision (write ``image``, then ``nocloud``), wipe, join (a stateless node of a tenant
    #: booting again: join with ``join``, nothing to install), or none.
    action: Literal["provision", "wipe", "join", "none"]
    machine_id: str
    image: dict[str, Any] | None = None
    #: cloud-init NoCloud files: meta-data, user-data, network-config.
    nocloud: dict[str, str] | None = None
    #: For a machine of a tenant with a hub: where and with what one-time token the node joins
    #: (``url``, ``token``, ``expires_at``; also in user-data as /etc/metald/join.json).
    join: dict[str, str] | None = None


# ---- helpers ----------------------------------------------------------------------------


def _machine_view(s: Session, m: Machine) -> MachineOut:
    return machine_out(m, list(s.exec(select(Nic).where(Nic.machine_id == m.id)).all()))


def claim_out(s: Session, c: Claim, *, replayed: bool = False) -> ClaimOut:
    ms = claim_machines(s, c.id)
    progress = latest_progress(s, ms)
    return ClaimOut(
        **c.model_dump(exclude={"image", "version", "ssh_authorized_keys"}),
        image_id=c.image,
        ssh_authorized_keys=list(c.ssh_authorized_keys or []),
        replayed=replayed,
        machines=[
            ClaimMachineOut(
                **m.model_dump(include={"id", "name", "state", "gpu_model", "gpu_count"}),
                last_error=m.last_error,
                progress=ProgressOut(**progress[m.id]) if m.id in progress else None,
            )
            for m in ms
        ],
    )


def load_claim(s: Session, p: Principal, claim_id: str) -> Claim:
    c = s.get(Claim, claim_id, populate_existing=True)
    # Another tenant's claim is reported as absent, so scoped tokens cannot probe for ids.
    if c is None or not p.can_see_tenant(c.tenant_id):
        raise NotFound(f"no claim with id {claim_id!r} among the claims this token may see")
    return c


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
)
async def create_claim(req: ApiRequest) -> ClaimOut:
    """Allocate ``count`` machines matching the selector to the tenant, all or none, and start
    installing the image on them. A repeated ``idempotency_key`` returns the first claim
    (``replayed``); the same key with a different request is 409. Too few machines: 422 with
    ``matched`` (machines matching the selector) and ``available`` (of those, ready and free)."""
    b: ClaimCreate = req.body
    p = req.require_principal()
    if not p.can_see_tenant(b.tenant_id):
        raise NotFound(
            f"no tenant with id {b.tenant_id!r} among this token's tenants; "
            "an orchestrator token claims only for the tenants in its scope"
        )
    request = ClaimRequest(
        tenant_id=b.tenant_id,
        count=b.count,
        selector=Selector.from_dict(b.selector.model_dump()),
        image_id=b.image_id,
        idempotency_key=b.idempotency_key or req.raw.headers.get("Idempotency-Key") or None,
        ssh_authorized_keys=b.ssh_authorized_keys,
    )
    return await claim_workflow(req.ctx).claim(
        request,
        actor=req.actor,
        render=lambda s, c, replayed: claim_out(s, c, replayed=replayed),
    )


@router.route(
    "GET",
    "/api/v1/claims",
    summary="List claims",
    roles=READERS,
    query=ClaimQuery,
    response=ClaimList,
    tag=TAG,
)
async def list_claims(req: ApiRequest) -> ClaimList:
    """Claims visible to the caller (an orchestrator: its tenants' only), newest first."""
    q: ClaimQuery = req.query
    p = req.require_principal()

    def run(s: Session) -> ClaimList:
        stmt = select(Claim)
        if p.role is Role.ORCHESTRATOR:
            stmt = stmt.where(col(Claim.tenant_id).in_(sorted(p.scope)))
        if q.tenant_id:
            stmt = stmt.where(Claim.tenant_id == q.tenant_id)
        if q.state:
            stmt = stmt.where(Claim.state == q.state)
        total = s.exec(select(func.count()).select_from(stmt.subquery())).one()
        rows = s.exec(
            stmt.order_by(col(Claim.created_at).desc(), col(Claim.id))
            .offset(q.offset)
            .limit(q.limit)
        ).all()
        return ClaimList(items=[claim_out(s, c) for c in rows], total=total)

    return await req.ctx.store.run(run)


@router.route(
    "GET",
    "/api/v1/claims/{id}",
    summary="Show a claim",
    roles=READERS,
    response=ClaimOut,
    tag=TAG,
    errors=(404,),
)
async def show_claim(req: ApiRequest) -> ClaimOut:
    """One claim with each machine's state and latest progress (phase, percent, bytes, rate)."""
    p = req.require_principal()
    return await req.ctx.store.run(lambda s: claim_out(s, load_claim(s, p, req.params["id"])))


@router.route(
    "POST",
    "/api/v1/claims/{id}/release",
    summary="Release a claim",
    roles=CLAIMERS,
    response=ClaimOut,
    tag=TAG,
    errors=(404, 409),
)
async def release_claim(req: ApiRequest) -> ClaimOut:
    """End the claim: each machine leaves the tenant (tokens revoked, off the hub, detached),
    then metald powers it off through its BMC and boots it into the wipe image; it returns to
    ready when the wipe agent's evidence fits its recorded disks (a failed wipe leaves it in
    wipe-failed; a machine without a BMC waits for a technician's confirm-wipe). A machine
    marked broken during the claim is detached and owes a wipe. Releasing a released claim
    changes nothing."""
    p = req.require_principal()
    return await claim_workflow(req.ctx).release(
        req.params["id"],
        actor=req.actor,
        load=lambda s, claim_id: load_claim(s, p, claim_id),
        render=claim_out,
    )


@router.route(
    "POST",
    "/api/v1/claims/{id}/machines/{machine_id}/release",
    summary="Release one machine of a claim",
    roles=CLAIMERS,
    response=ClaimOut,
    tag=TAG,
    errors=(404, 409),
)
async def release_claim_machine(req: ApiRequest) -> ClaimOut:
    """Scale a claim down by one machine: it leaves the tenant (tokens revoked, off the hub and
    out of the cluster) and is wiped back to ready. The claim ends with its last machine."""
    p = req.require_principal()
    return await claim_workflow(req.ctx).release(
        req.params["id"],
        actor=req.actor,
        load=lambda s, claim_id: load_claim(s, p, claim_id),
        render=claim_out,
        machine_id=req.params["machine_id"],
    )


# ---- images -----------------------------------------------------------------------------


def _image_out(img: Image, p: Principal) -> ImageOut:
    out = ImageOut.model_validate(img.model_dump())
    if p.role is not Role.ADMIN:
        out.spec = redact_spec(out.spec)
    return out


def _image_visible(img: Image, p: Principal) -> bool:
    """Staff see every image; an orchestrator public ones and its tenants'."""
    if p.role is not Role.ORCHESTRATOR:
        return True
    return not img.tenants or any(p.can_see_tenant(t) for t in img.tenants)


@router.route(
    "POST",
    "/api/v1/images",
    summary="Add an image",
    roles=STAFF,
    body=ImageCreate,
    response=ImageOut,
    status=201,
    tag="images",
    errors=(409, 422),
)
async def create_image(req: ApiRequest) -> ImageOut:
    """``stateless``: kernel plus initrd and/or rootfs (booted into RAM). ``disk``: url, sha256
    and format raw (streamed to disk by the agent, .gz unpacked on the fly, sha256 of the raw
    bytes verified by reading back); qcow2 (downloaded into RAM, sha256 checked, written by
    qemu-img and compared)."""
    b: ImageCreate = req.body
    spec = normalize_spec(b.kind, b.model_dump(exclude={"name", "kind", "tenants"}))
    scope = sorted(set(b.tenants))

    def run(s: Session) -> ImageOut:
        img = images.create_image(
            s,
            name=b.name,
            kind=b.kind,
            spec=spec,
            tenants=scope,
            actor=req.actor,
            instance=req.ctx.instance,
        )
        return _image_out(img, req.require_principal())

    return await req.ctx.store.run(run)


@router.route(
    "GET", "/api/v1/images", summary="List images", roles=READERS, response=ImageList, tag="images"
)
async def list_images(req: ApiRequest) -> ImageList:
    """Every image in the catalog, by name; for an orchestrator, the public ones and its
    tenants'. URL credentials are REDACTED for all but admins."""
    p = req.require_principal()

    def run(s: Session) -> ImageList:
        rows = s.exec(select(Image).order_by(col(Image.name)))
        return ImageList(items=[_image_out(i, p) for i in rows if _image_visible(i, p)])

    return await req.ctx.store.run(run)


@router.route(
    "GET",
    "/api/v1/images/{id}",
    summary="Show an image",
    roles=READERS,
    response=ImageOut,
    tag="images",
    errors=(404,),
)
async def show_image(req: ApiRequest) -> ImageOut:
    """One image and its spec (URL credentials REDACTED for all but admins)."""
    p = req.require_principal()

    def run(s: Session) -> ImageOut:
        img = s.get(Image, req.params["id"])
        if img is None or not _image_visible(img, p):
            raise NotFound(f"no image with id {req.params['id']!r}")
        return _image_out(img, p)

    return await req.ctx.store.run(run)


# ---- retry and progress -----------------------------------------------------------------


@router.route(
    "POST",
    "/api/v1/machines/{id}/retry",
    summary="Retry a failed machine",
    roles=STAFF,
    body=RetryIn,
    response=MachineOut,
    tag="machines",
    errors=(404, 409),
)
async def retry_machine(req: ApiRequest) -> MachineOut:
    """Start a failed operation again: provision-failed -> provisioning, wipe-failed -> wiping,
    inspect-failed -> inspecting, join-failed -> joining. Network-booting ones are power-cycled
    into PXE through their BMC. Any other state: 409."""
    b: RetryIn = req.body
    p = req.require_principal()
    return await claim_workflow(req.ctx).retry(
        req.params["id"],
        actor=req.actor,
        load=lambda s, mid: load_visible(s, p, mid),
        render=_machine_view,
        reason=b.reason,
        version=b.version,
    )


@router.route(
    "POST",
    "/api/v1/machines/{id}/wipe",
    summary="Wipe a machine",
    roles=STAFF,
    body=RetryIn,
    response=MachineOut,
    tag="machines",
    errors=(404, 409),
)
async def wipe_machine(req: ApiRequest) -> MachineOut:
    """Start a wipe of a machine in maintenance or wipe-failed (e.g. one marked broken during
    a claim, repaired, and owing a wipe): power-off, PXE and the wipe image through its BMC,
    then ready once the agent's evidence fits its recorded disks. Any other state: 409."""
    b: RetryIn = req.body
    p = req.require_principal()
    return await claim_workflow(req.ctx).wipe(
        req.params["id"],
        actor=req.actor,
        load=lambda s, mid: load_visible(s, p, mid),
        render=_machine_view,
        reason=b.reason,
        version=b.version,
    )


@router.route(
    "POST",
    "/api/v1/machines/{id}/confirm-wipe",
    summary="Confirm a machine's disks were wiped",
    roles=STAFF,
    body=TechnicianNote,
    response=MachineOut,
    tag="machines",
    errors=(404, 409, 422),
)
async def confirm_wipe(req: ApiRequest) -> MachineOut:
    """A technician vouches that the machine's disks were erased (by hand, or it has no BMC
    through which metald could boot its wipe image, or no disks the agent can see): from
    releasing, wiping, wipe-failed or maintenance to ready, detached from any tenant and claim.
    The reason is required and recorded with the technician's name (``machine.wipe-confirmed``
    event)."""
    b: TechnicianNote = req.body
    p = req.require_principal()
    return await claim_workflow(req.ctx).confirm_wipe(
        req.params["id"],
        actor=req.actor,
        load=lambda s, mid: load_visible(s, p, mid),
        render=_machine_view,
        reason=b.reason,
        version=b.version,
    )


@router.route(
    "POST",
    "/api/v1/agent/progress",
    summary="Report provisioning progress",
    roles=AGENT,
    body=ProgressIn,
    response=ProgressAccepted,
    tag="agent",
    errors=(409, 422),
)
async def post_progress(req: ApiRequest) -> ProgressAccepted:
    """The agent's progress while installing an image or wiping (phase, percent, bytes,
    rate_bps). ``done`` ends the operation (provisioned, or ready after a wipe); ``error`` fails
    it (provision-failed, wipe-failed) with the error as the machine's last_error."""
    b: ProgressIn = req.body
    p = req.require_principal()
    mid = next(iter(p.scope))

    def run(s: Session) -> ProgressAccepted:
        require_agent_phase(p, get_machine(s, mid).state, {"provision", "wipe"})
        m: Machine = record_progress(
            s,
            mid,
            Progress(**b.model_dump()),
            actor=req.actor,
            instance=req.ctx.instance,
            min_interval_s=req.ctx.cfg.provision.progress_event_interval_s,
            token_boot=p.boot,
        )
        return ProgressAccepted(machine_id=m.id, state=m.state)

    out = await req.ctx.store.run(run)
    req.ctx.bus.notify()
    return out


@router.route(
    "GET",
    "/api/v1/agent/provision",
    summary="Get what to install",
    roles=AGENT,
    response=ProvisionInstruction,
    tag="agent",
)
async def provision_instruction(req: ApiRequest) -> ProvisionInstruction:
    """For the deploy agent: while provisioning, the image to write (kind, url, sha256, format)
    and the first-boot metadata (cloud-init NoCloud: hostname, SSH keys, network config, and
    for a tenant with a hub the one-time join token in ``join``); while wiping, ``wipe``. A
    stateless node of a tenant that boots again (provisioned, joining, join-failed, active)
    gets ``join`` with a fresh token. Otherwise ``none``."""
    p = req.require_principal()
    mid = next(iter(p.scope))

    def run(s: Session) -> ProvisionInstruction:
        m = s.get(Machine, mid)
        if m is not None:
            # A discovery token of this machine, once it is claimed, gets nothing here.
            require_agent_phase(p, m.state, {"provision", "wipe"})
        step = next_step(
            s,
            m,
            mid,
            actor=req.actor,
            join_url=f"{req.raw.scheme}://{req.raw.host}",
            join_token_ttl_s=req.ctx.cfg.tenants.join_token_ttl_s,
            instance=req.ctx.instance,
        )
        return ProvisionInstruction.model_validate(asdict(step))

    return await req.ctx.store.run(run)
