"""/api/v1/agent: what the agents in a machine's RAM talk to (agent tokens only): the discovery
agent posts inventory and asks what next; the deploy agent asks what to install or wipe and
reports progress."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints
from sqlmodel import Session

from api.roles import AGENT
from api.routes_commissioning import PlanOut
from api.routing import ApiRequest, Router
from api.schemas import In
from api.workflows import claim_workflow
from metald import enrollment, machines
from metald.auth import require_agent_phase
from metald.claims.provisioning import next_step
from metald.inventory.schema import InventoryPayload
from metald.lifecycle import State
from metald.machines import get_machine
from metald.provision import commissioning
from metald.provision.progress import Progress, record_progress
from metald.store.models import Machine

router = Router()


class InventoryAccepted(BaseModel):
    machine_id: str
    state: str
    gpu_model: str | None
    gpu_count: int
    next: dict[str, Any]


class Instruction(BaseModel):
    action: str
    reason: str | None = None
    retry_after_s: int | None = None
    #: With ``commission``: the checks to run, as ``GET /api/v1/agent/commissioning`` gives
    #: them, so the agent starts at once. Absent while metald has not yet stored its first
    #: reading of the BMC's event log (``bmc-sel``): the agent then asks that endpoint, which
    #: waits for it.
    plan: PlanOut | None = None


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


def _machine_id(req: ApiRequest) -> str:
    return next(iter(req.require_principal().scope))


def _instruction(s: Session, m: Machine, cfg: Any) -> dict[str, Any]:
    """``enrollment.next_instruction``, with the commissioning plan when it may be served."""
    out = enrollment.next_instruction(m, cfg)
    run = commissioning.current_run(s, m.id) if out["action"] == "commission" else None
    plan = None if run is None else commissioning.agent_plan(run)
    if plan is not None:
        out["plan"] = plan
    return out


@router.route(
    "POST",
    "/api/v1/agent/inventory",
    summary="Post a machine's inventory",
    roles=AGENT,
    body=InventoryPayload,
    raw_body=True,
    response=InventoryAccepted,
    tag="agent",
    errors=(403, 409, 422),
)
async def post_inventory(req: ApiRequest) -> InventoryAccepted:
    """The agent's inventory (schema in docs/inventory.md). Accepted only from the machine's own
    token minted for inspection, only while it is inspecting, and only if newer than the last post (boot_id and
    sequence); a refused post is recorded as an ``inventory.refused`` event and changes nothing.
    ``next`` is what ``GET /api/v1/agent/next`` would answer now: with ``commission``, the
    plan too (unless metald must read the BMC's event log first), so the agent asks nothing
    before its first check."""
    mid = _machine_id(req)
    cfg = req.ctx.cfg.enroll
    p = req.require_principal()

    def run(s: Session) -> InventoryAccepted:
        # A provisioning or wipe token of this machine cannot rewrite its inventory.
        m = machines.get_machine(s, mid)
        require_agent_phase(p, m.state, {"inspect"})
        m = enrollment.accept_inventory(
            s,
            mid,
            req.body,
            actor=req.actor,
            cfg=cfg,
            instance=req.ctx.instance,
            commit=False,
            machine=m,
        )
        nxt = _instruction(s, m, cfg)  # in the same transaction: the run it just started
        s.commit()
        return InventoryAccepted(
            machine_id=m.id, state=m.state, gpu_model=m.gpu_model, gpu_count=m.gpu_count, next=nxt
        )

    out = await req.write(run)
    bmc = req.ctx.services.bmc
    if bmc is not None:
        # A BMC registered before its machine was known is linked by UUID, serial or MAC now.
        await bmc.link_by_identity(mid, actor=f"metald:{req.ctx.instance}")
        bmc.after_inspection(mid)  # firmware versions, BIOS profile (background)
    return out


@router.route(
    "GET",
    "/api/v1/agent/next",
    summary="Get the agent's next instruction",
    roles=AGENT,
    response=Instruction,
    tag="agent",
)
async def next_instruction(req: ApiRequest) -> Instruction:
    """``inspect`` (post inventory), ``commission`` (with the plan, unless metald must read the
    BMC's event log first: then ``GET /api/v1/agent/commissioning``), ``poweroff``, or
    ``wait`` (ask again after retry_after_s). A read: it never queues behind the writes."""
    mid = _machine_id(req)

    def run(s: Session) -> Instruction:
        return Instruction(**_instruction(s, machines.get_machine(s, mid), req.ctx.cfg.enroll))

    return await req.ctx.store.read_aside(run)


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
            on_wiped=lambda s, m: commissioning.after_wipe(
                s, m, req.ctx.cfg.enroll.rules, actor=req.actor, instance=req.ctx.instance
            ),
        )
        return ProgressAccepted(machine_id=m.id, state=m.state)

    out = await req.run(run)
    req.ctx.bus.notify()
    after = getattr(req.ctx.services.bmc, "after_report", None)
    if (b.done or b.error) and after is not None:
        after(mid)  # a virtual-media boot's ISO is ejected
    if State(out.state) is State.INSPECTING:  # wiped; its profile asks to commission again
        claim_workflow(req.ctx).network_boot([mid], f"metald:{req.ctx.instance}")
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

    return await req.run(run)
