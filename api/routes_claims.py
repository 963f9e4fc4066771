"""/api/v1/claims, /api/v1/images, machine retry and agent progress: allocation and provisioning.

An orchestrator claims and releases machines for the tenants in its scope only; a claim of
another tenant is reported as absent. Staff read every claim; admins may claim for any tenant.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints
from sqlalchemy import func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from api.routes_machines import load_visible, machine_out
from api.routing import ApiRequest, Router
from api.schemas import In, LabelKey, LabelValue, MachineOut, Name, Query
from metald import claims as svc
from metald.auth import Principal, Role
from metald.errors import Conflict, NotFound, Unprocessable
from metald.lifecycle import ALLOCATED, State
from metald.machines import add_event
from metald.provision import driver
from metald.provision.images import normalize_spec
from metald.provision.intents import DeployImage
from metald.provision.metadata import nocloud
from metald.provision.progress import Progress, record_progress
from metald.provision.redact import redact_spec
from metald.store.models import Claim, Image, Machine, Nic, Tenant, WgHub
from metald.tenants import mesh
from metald.tenants.service import REJOIN, issue_join_token

log = logging.getLogger("metald.claims")
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


class ProgressIn(In):
    phase: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    percent: float | None = Field(default=None, ge=0, le=100)
    bytes: int | None = Field(default=None, ge=0)
    rate_bps: float | None = Field(default=None, ge=0)
    done: bool = False
    error: Annotated[str, StringConstraints(min_length=1, max_length=1000)] | None = None


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


def _deploy(req: ApiRequest) -> DeployImage:
    cfg = req.ctx.cfg.provision
    return DeployImage(cfg.deploy_kernel, cfg.deploy_initrd)


def _boot_from_network(req: ApiRequest, machine_ids: list[str]) -> None:
    """In the background: one-time PXE and a power cycle through each machine's BMC."""
    driver.spawn(
        driver.reboot_all(
            req.ctx.store, _bmc(req), machine_ids, actor=req.actor, instance=req.ctx.instance
        )
    )


def _bmc(req: ApiRequest) -> Any:
    return req.ctx.services.get("bmc") if req.ctx.cfg.provision.use_bmc else None


def claim_out(s: Session, c: Claim, *, replayed: bool = False) -> ClaimOut:
    ms = svc.claim_machines(s, c.id)
    progress = svc.latest_progress(s, ms)
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
    selector = svc.Selector.from_dict(b.selector.model_dump())
    key = b.idempotency_key or req.raw.headers.get("Idempotency-Key") or None

    def run(s: Session) -> tuple[ClaimOut, list[str]]:
        c, replayed = svc.create_claim(
            s,
            b.tenant_id,
            b.count,
            selector,
            b.image_id,
            key,
            req.actor,
            deploy=_deploy(req),
            ssh_authorized_keys=b.ssh_authorized_keys,
            instance=req.ctx.instance,
            require_bmc=req.ctx.cfg.enroll.require_bmc,
        )
        started: list[str] = []
        if not replayed:
            ids = [m.id for m in svc.claim_machines(s, c.id)]
            started = driver.start_provisioning(s, ids, actor=req.actor, instance=req.ctx.instance)
        return claim_out(s, c, replayed=replayed), started

    out, started = await req.ctx.store.run(run)
    req.ctx.bus.notify()
    _boot_from_network(req, started)
    return out


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
    """End the claim: each machine's tokens are revoked, then it is wiped and returns to ready
    (a failed wipe leaves it in wipe-failed). Releasing a released claim changes nothing."""
    p = req.require_principal()

    def run(s: Session) -> tuple[ClaimOut, list[str]]:
        c = load_claim(s, p, req.params["id"])
        wiping = svc.release_claim(s, c, req.actor, deploy=_deploy(req), instance=req.ctx.instance)
        return claim_out(s, load_claim(s, p, c.id)), wiping

    return await _after_release(req, *(await req.ctx.store.run(run)))


async def _after_release(req: ApiRequest, out: ClaimOut, wiping: list[str]) -> ClaimOut:
    req.ctx.bus.notify()
    runtime = req.ctx.services.get("tenant_hubs")
    if wiping and runtime is not None and hasattr(runtime, "sync"):
        # Off the tenant's hub and out of its cluster before the machine reboots to be wiped.
        try:
            await runtime.sync()
        except Exception:  # the runtime's loop tries again; the store already says released
            log.exception("tenant runtime sync after releasing claim %s failed", out.id)
    if wiping:  # off every other node's mesh before the wipe: acknowledged or timed out
        await mesh.after_release(
            req.ctx.store,
            req.ctx.services,
            out.tenant_id,
            wiping,
            actor=req.actor,
            instance=req.ctx.instance,
        )
    _boot_from_network(req, wiping)
    return out


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
    mid = req.params["machine_id"]

    def run(s: Session) -> tuple[ClaimOut, list[str]]:
        c = load_claim(s, p, req.params["id"])
        m = s.get(Machine, mid)
        if m is None or m.claim_id != c.id:
            raise NotFound(f"claim {c.id} holds no machine {mid!r}")
        if State(m.state) not in ALLOCATED:
            raise Conflict(f"machine {mid} is {m.state}: it is not allocated to the claim any more")
        wiping = svc.release_claim(
            s, c, req.actor, deploy=_deploy(req), instance=req.ctx.instance, only={mid}
        )
        return claim_out(s, load_claim(s, p, c.id)), wiping

    return await _after_release(req, *(await req.ctx.store.run(run)))


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
        if s.exec(select(Image).where(Image.name == b.name)).first():
            raise Conflict(f"an image named {b.name!r} already exists; pick another name")
        unknown = [t for t in scope if s.get(Tenant, t) is None]
        if unknown:
            raise Unprocessable(f"tenants: no tenant with id {', '.join(map(repr, unknown))}")
        img = Image(name=b.name, kind=b.kind, spec=spec, tenants=scope, created_by=req.actor)
        s.add(img)
        s.flush()
        add_event(
            s,
            "image.created",
            req.actor,
            data={"image_id": img.id, "name": img.name, "kind": img.kind},
            instance=req.ctx.instance,
        )
        try:
            s.commit()
        except IntegrityError:
            s.rollback()
            raise Conflict(f"an image named {b.name!r} already exists; pick another name") from None
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

    def run(s: Session) -> MachineOut:
        m = load_visible(s, p, req.params["id"])
        m = driver.retry(
            s,
            m.id,
            actor=req.actor,
            deploy=_deploy(req),
            reason=b.reason,
            version=b.version,
            instance=req.ctx.instance,
        )
        nics = s.exec(select(Nic).where(Nic.machine_id == m.id)).all()
        return machine_out(m, list(nics))

    out = await req.ctx.store.run(run)
    req.ctx.bus.notify()
    if out.state in (State.PROVISIONING, State.WIPING, State.INSPECTING):
        _boot_from_network(req, [out.id])
    return out


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
    mid = next(iter(req.require_principal().scope))

    def run(s: Session) -> ProgressAccepted:
        m: Machine = record_progress(
            s,
            mid,
            Progress(**b.model_dump()),
            actor=req.actor,
            instance=req.ctx.instance,
            min_interval_s=req.ctx.cfg.provision.progress_event_interval_s,
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
    mid = next(iter(req.require_principal().scope))

    def run(s: Session) -> ProvisionInstruction:
        m = s.get(Machine, mid)
        rejoin = m is not None and State(m.state) in REJOIN
        if m is None or (m.state not in (State.PROVISIONING, State.WIPING) and not rejoin):
            return ProvisionInstruction(action="none", machine_id=mid)
        if m.state == State.WIPING:
            return ProvisionInstruction(action="wipe", machine_id=mid)
        c = s.get(Claim, m.claim_id) if m.claim_id else None
        img = s.get(Image, c.image) if c and c.image else None
        if img is None or (rejoin and img.kind != "stateless"):
            # A disk image booted from disk has its seed; only a RAM-booted node asks again.
            return ProvisionInstruction(action="none", machine_id=mid)
        pxe = s.exec(select(Nic).where(Nic.machine_id == mid, col(Nic.pxe))).first()
        join = None
        if m.tenant_id and s.exec(select(WgHub).where(WgHub.tenant_id == m.tenant_id)).first():
            # A fresh one-time token each time the agent asks (older unused ones are revoked):
            # the node joins with whichever it was given last.
            secret, expires = issue_join_token(
                s,
                mid,
                actor=req.actor,
                ttl=timedelta(seconds=req.ctx.cfg.tenants.join_token_ttl_s),
                instance=req.ctx.instance,
                supersede_peer=rejoin,  # the node rebooted: its old key is gone with its RAM
            )
            join = {
                "url": f"{req.raw.scheme}://{req.raw.host}",
                "token": secret,
                "expires_at": expires.isoformat(),
            }
        files = nocloud(
            machine_id=mid,
            name=m.name,
            pxe_mac=pxe.mac if pxe else None,
            ssh_authorized_keys=list(c.ssh_authorized_keys or []) if c else [],
            join=join,
        )
        if rejoin and join is None:
            return ProvisionInstruction(action="none", machine_id=mid)
        return ProvisionInstruction(
            action="join" if rejoin else "provision",
            machine_id=mid,
            image={"id": img.id, "kind": img.kind, **img.spec},
            nocloud=files,
            join=join,
        )

    return await req.ctx.store.run(run)
