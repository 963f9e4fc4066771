"""/api/v1/repairs: the technicians' repair queue (``metald.usecases.repairs``): list and show
with the machine's rack position, the fault, its evidence and the part to look at; open one by
hand; take, note, repaired. Staff only: a tenant's orchestrator never sees a repair."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from api import listing, workflows
from api.paging import PageQuery
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In, Text
from metald.usecases.repairs import Repairs

router = Router()
TAG = "repairs"

Note = Annotated[str, StringConstraints(min_length=1, max_length=2000)]
#: Short, one-token values (a rack, a token's name, a part).
Word = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class RepairQuery(PageQuery):
    SORTABLE = ("opened_at", "status", "taken_at", "closed_at")
    status: Literal["open", "closed", "taken", "verifying", "all"] = Field(
        default="open",
        description="open (default: open, taken and verifying), closed, taken, verifying, all.",
    )
    rack: Word | None = Field(default=None, description="Only machines in this rack.")
    taken_by: Word | None = Field(default=None, description="Only repairs taken by this token.")
    machine: Word | None = Field(default=None, description="Only this machine (id or name).")


class RepairMachine(BaseModel):
    id: str
    name: str | None
    state: str
    rack: str | None
    rack_position: str | None
    serial: str | None
    last_error: str | None


class RepairOut(BaseModel):
    id: str
    machine_id: str
    machine: RepairMachine | None
    status: str = Field(description="open, taken, verifying or closed.")
    source: str = Field(description="remediation, technician, commissioning or release.")
    remediation_id: str | None
    opened_by: str
    opened_at: datetime
    summary: str
    faults: list[dict[str, Any]] = Field(
        description="kind, subject, code, severity, witness, evidence, first_seen (and the "
        "rule that classified it)."
    )
    parts: list[dict[str, Any]] = Field(
        description="Where to look: part (gpu, dimm, psu, fan, disk ...), where (a sentence), "
        "and the GPU's pci_address and serial, the DIMM slot ... where known."
    )
    taken_by: str | None
    taken_at: datetime | None
    notes: list[dict[str, Any]]
    repaired_by: str | None
    repaired_at: datetime | None
    commission_failures: int
    closed_at: datetime | None
    outcome: str | None = Field(description="returned, out or retired once closed.")
    outcome_reason: str | None
    version: int
    actions: list[str] = Field(
        description="What the repair allows now: take, note, repaired, release."
    )


class RepairPage(BaseModel):
    items: list[RepairOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


class RepairOpen(In):
    machine: Word = Field(description="The machine's id, name or an 8+ character id prefix.")
    summary: Text = Field(description="What is wrong, in a sentence (kept as the evidence).")
    part: Word | None = Field(default=None, description="The part to look at, if known.")


class NoteIn(In):
    text: Note


class RepairedIn(In):
    note: Note | None = Field(default=None, description="What was done (kept as a note).")


@router.route(
    "GET",
    "/api/v1/repairs",
    summary="List the repair queue",
    roles=STAFF,
    query=RepairQuery,
    response=RepairPage,
    tag=TAG,
    use_case=workflows.repairs,
)
async def list_repairs(req: ApiRequest, repairs: Repairs) -> RepairPage:
    """The repair queue, newest first: open ones by default (open, taken, verifying)."""
    paging = listing.paging(req)
    q: RepairQuery = req.query
    f = _Filter(None if q.status == "all" else q.status, q.rack, q.taken_by, q.machine)
    page = await repairs.list(req.require_principal(), f, paging)
    return listing.answer(RepairPage, page, paging, req)


class _Filter:
    def __init__(
        self, status: str | None, rack: str | None, taken_by: str | None, machine: str | None
    ) -> None:
        self.status, self.rack, self.taken_by, self.machine = status, rack, taken_by, machine


@router.route(
    "POST",
    "/api/v1/repairs",
    summary="Open a repair by hand",
    roles=STAFF,
    body=RepairOpen,
    response=RepairOut,
    status=201,
    tag=TAG,
    errors=(403, 404, 409, 422),
    location="/api/v1/repairs/{id}",
    use_case=workflows.repairs,
)
async def open_repair(req: ApiRequest, repairs: Repairs) -> RepairOut:
    """Put a machine in the queue with what is wrong (instead of a bare mark-broken): it is
    marked broken. A machine with an open repair gets the fault added to it. A machine that
    failed commissioning twice after repair is reopened by an admin only (403)."""
    b: RepairOpen = req.body
    out = await repairs.open(
        req.require_principal(), b.machine, summary=b.summary, part=b.part, actor=req.actor
    )
    return RepairOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/repairs/{id}",
    summary="Show a repair",
    roles=STAFF,
    response=RepairOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.repairs,
)
async def show_repair(req: ApiRequest, repairs: Repairs) -> RepairOut:
    """One repair: the machine and where it sits, faults with evidence, parts, notes."""
    return RepairOut.model_validate(await repairs.show(req.require_principal(), req.params["id"]))


@router.route(
    "POST",
    "/api/v1/repairs/{id}/take",
    summary="Take a repair",
    roles=STAFF,
    response=RepairOut,
    tag=TAG,
    errors=(404, 409),
    use_case=workflows.repairs,
)
async def take_repair(req: ApiRequest, repairs: Repairs) -> RepairOut:
    """The caller works on it: the machine goes from broken to repairing. Taken already, or
    the machine still in a tenant's claim: 409."""
    out = await repairs.take(req.require_principal(), req.params["id"], actor=req.actor)
    return RepairOut.model_validate(out)


@router.route(
    "POST",
    "/api/v1/repairs/{id}/release",
    summary="Release a taken repair",
    roles=STAFF,
    response=RepairOut,
    tag=TAG,
    errors=(403, 404, 409),
    use_case=workflows.repairs,
)
async def release_repair(req: ApiRequest, repairs: Repairs) -> RepairOut:
    """Let go of a taken repair without fixing it: the repair is open in the queue again, the
    machine broken again. Only the token that took it, or an admin (403 otherwise); a repair
    that is not taken: 409."""
    out = await repairs.release(req.require_principal(), req.params["id"], actor=req.actor)
    return RepairOut.model_validate(out)


@router.route(
    "POST",
    "/api/v1/repairs/{id}/note",
    summary="Add a note to a repair",
    roles=STAFF,
    body=NoteIn,
    response=RepairOut,
    tag=TAG,
    errors=(404, 409, 422),
    use_case=workflows.repairs,
)
async def note_repair(req: ApiRequest, repairs: Repairs) -> RepairOut:
    """What was found or swapped, kept with who and when."""
    out = await repairs.note(
        req.require_principal(), req.params["id"], req.body.text, actor=req.actor
    )
    return RepairOut.model_validate(out)


@router.route(
    "POST",
    "/api/v1/repairs/{id}/repaired",
    summary="Mark a repair done",
    roles=STAFF,
    body=RepairedIn,
    response=RepairOut,
    status=202,
    tag=TAG,
    errors=(404, 409, 422),
    use_case=workflows.repairs,
)
async def repaired(req: ApiRequest, repairs: Repairs) -> RepairOut:
    """The machine goes back through commissioning (wiped first when a tenant's data is still
    on its disks), booted through its BMC. A pass returns it to the pool and closes the
    repair; a failure puts the repair back in the queue; the second failure after repair keeps
    the machine out (broken, with the sentence)."""
    out = await repairs.repaired(
        req.require_principal(), req.params["id"], note=req.body.note, actor=req.actor
    )
    return RepairOut.model_validate(out)
