"""/api/v1/agent: what the discovery agent in a machine's RAM talks to (agent tokens only)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from sqlmodel import Session

from api.routing import ApiRequest, Router
from metald import enrollment, machines
from metald.auth import Role, require_agent_phase
from metald.inventory.schema import InventoryPayload

router = Router()
AGENT = frozenset({Role.AGENT})


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


def _machine_id(req: ApiRequest) -> str:
    return next(iter(req.require_principal().scope))


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
    sequence); a refused post is recorded as an ``inventory.refused`` event and changes nothing."""
    mid = _machine_id(req)
    cfg = req.ctx.cfg.enroll
    p = req.require_principal()

    def run(s: Session) -> InventoryAccepted:
        # A provisioning or wipe token of this machine cannot rewrite its inventory.
        require_agent_phase(p, machines.get_machine(s, mid).state, {"inspect"})
        m = enrollment.accept_inventory(
            s, mid, req.body, actor=req.actor, cfg=cfg, instance=req.ctx.instance
        )
        return InventoryAccepted(
            machine_id=m.id,
            state=m.state,
            gpu_model=m.gpu_model,
            gpu_count=m.gpu_count,
            next=enrollment.next_instruction(m, cfg),
        )

    out = await req.write(run)
    bmc = req.ctx.services.get("bmc")
    if bmc is not None:
        # A BMC registered before its machine was known is linked by UUID, serial or MAC now.
        await bmc.link_by_identity(mid, actor=f"metald:{req.ctx.instance}")
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
    """``inspect`` (post inventory), ``poweroff``, or ``wait`` (ask again after retry_after_s)."""
    mid = _machine_id(req)

    def run(s: Session) -> Instruction:
        return Instruction(
            **enrollment.next_instruction(machines.get_machine(s, mid), req.ctx.cfg.enroll)
        )

    return await req.ctx.store.run(run)
