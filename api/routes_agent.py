"""/api/v1/agent: what the agents in a machine's RAM talk to (agent tokens only): the discovery
agent posts inventory and asks what next; the deploy agent asks what to install or wipe and
reports progress."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from api import workflows
from api.roles import AGENT
from api.routes_commissioning import PlanOut
from api.routing import ApiRequest, Router
from api.schemas import In
from metald.inventory.schema import InventoryPayload
from metald.usecases.agent import Agent

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
    #: cloud-init NoCloud files: meta-data, user-data, network-config, and vendor-data when
    #: the claim brought its own user-data (metald's cloud-config then goes there).
    nocloud: dict[str, str] | None = None
    #: For a machine of a tenant with a hub: where and with what one-time token the node joins
    #: (``url``, ``token``, ``expires_at``, and ``ca``, the ``sha256:<hex>`` of the CA to pin,
    #: when ``url`` is https; also in user-data (or vendor-data) as /etc/metald/join.json).
    join: dict[str, str] | None = None
    #: The claim's storage layout on this machine: ``root`` (the image's disk, or the two of a
    #: RAID1 root), ``root_raid``, ``volumes`` (docs/tenant-os.md).
    storage: dict[str, Any] | None = None


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
    use_case=workflows.agent,
)
async def post_inventory(req: ApiRequest, agent: Agent) -> InventoryAccepted:
    """The agent's inventory (schema in docs/inventory.md). Accepted only from the machine's own
    token minted for inspection, only while it is inspecting, and only if newer than the last post (boot_id and
    sequence); a refused post is recorded as an ``inventory.refused`` event and changes nothing.
    ``next`` is what ``GET /api/v1/agent/next`` would answer now: with ``commission``, the
    plan too (unless metald must read the BMC's event log first), so the agent asks nothing
    before its first check."""
    out = await agent.post_inventory(req.require_principal(), req.body, actor=req.actor)
    return InventoryAccepted.model_validate(out)


@router.route(
    "GET",
    "/api/v1/agent/next",
    summary="Get the agent's next instruction",
    roles=AGENT,
    response=Instruction,
    tag="agent",
    use_case=workflows.agent,
)
async def next_instruction(req: ApiRequest, agent: Agent) -> Instruction:
    """``inspect`` (post inventory), ``commission`` (with the plan, unless metald must read the
    BMC's event log first: then ``GET /api/v1/agent/commissioning``), ``poweroff``, or
    ``wait`` (ask again after retry_after_s). A read: it never queues behind the writes."""
    return Instruction.model_validate(await agent.next_instruction(req.require_principal()))


@router.route(
    "POST",
    "/api/v1/agent/progress",
    summary="Report provisioning progress",
    roles=AGENT,
    body=ProgressIn,
    response=ProgressAccepted,
    tag="agent",
    errors=(409, 422),
    use_case=workflows.agent,
)
async def post_progress(req: ApiRequest, agent: Agent) -> ProgressAccepted:
    """The agent's progress while installing an image or wiping (phase, percent, bytes,
    rate_bps). ``done`` ends the operation (provisioned, or ready after a wipe); ``error`` fails
    it (provision-failed, wipe-failed) with the error as the machine's last_error."""
    b: ProgressIn = req.body
    out = await agent.post_progress(req.require_principal(), b.model_dump(), actor=req.actor)
    return ProgressAccepted.model_validate(out)


@router.route(
    "GET",
    "/api/v1/agent/provision",
    summary="Get what to install",
    roles=AGENT,
    response=ProvisionInstruction,
    tag="agent",
    use_case=workflows.agent,
)
async def provision_instruction(req: ApiRequest, agent: Agent) -> ProvisionInstruction:
    """For the deploy agent: while provisioning, the image to write (kind, url, sha256, format)
    and the first-boot metadata (cloud-init NoCloud: hostname, SSH keys, network config, and
    for a tenant with a hub the one-time join token in ``join``); while wiping, ``wipe``. A
    stateless node of a tenant that boots again (provisioned, joining, join-failed, active)
    gets ``join`` with a fresh token. Otherwise ``none``."""
    out = await agent.provision(
        req.require_principal(),
        actor=req.actor,
        join_url=f"{req.raw.scheme}://{req.raw.host}",
        join_ca=req.ctx.machines_ca if req.raw.secure else "",
    )
    return ProvisionInstruction.model_validate(out)
