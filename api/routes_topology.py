"""Fabric topology: /api/v1/nvlink-domains (a domain and its members), /api/v1/ib-fabric (the
InfiniBand leaves; the links uploaded from ibnetdiscover) and /api/v1/machines/{id}/topology
(one machine's place). docs/inventory.md, Topology."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from api import workflows
from api.roles import READERS
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In
from metald.inventory.ibnet import MAX_BYTES
from metald.usecases.topology import Topology

router = Router()
TAG = "topology"


class Member(BaseModel):
    machine_id: str
    name: str | None
    state: str
    tenant_id: str | None
    nvlink_ready: bool | None = None
    problems: list[str] = []
    slot_number: int | None = None
    chassis_serial: str | None = None
    rack: str | None = None
    ib_leaf: str | None = None
    power_domain: str | None = None


class NvlinkDomain(BaseModel):
    domain: str = Field(description="<clusterUuid>.<cliqueId>, as the GPUs report it.")
    cluster_uuid: str
    clique_id: int | None
    size: int = Field(description="Machines that report this domain.")
    free: int = Field(description="Of those, ready, unclaimed and registered in the domain.")
    racks: list[str]
    chassis: list[str] = Field(description="Chassis serials the GPUs report (one per rack).")
    degraded: list[str] = Field(description="Members with fabric problems (names or ids).")
    members: list[Member]


class NvlinkDomains(BaseModel):
    items: list[NvlinkDomain]


class IbLeaf(BaseModel):
    leaf: str
    size: int
    free: int
    members: list[Member]


class IbLeaves(BaseModel):
    items: list[IbLeaf]


class IbFabricUpload(In):
    ibnetdiscover: Annotated[str, StringConstraints(min_length=1, max_length=MAX_BYTES)] = Field(
        description="The output of ibnetdiscover (infiniband-diags) run on the fabric."
    )


class LeafMachines(BaseModel):
    leaf: str
    machines: list[str]


class IbFabricUpdated(BaseModel):
    links: int = Field(description="Host ports with a switch neighbour in the upload.")
    switches: int
    machines_changed: int
    leaves: list[LeafMachines]
    unmatched_ports: list[str] = Field(description="Port GUIDs no machine's inventory lists.")


class MachineTopology(BaseModel):
    machine_id: str
    name: str | None
    rack: str | None
    power_domain: str | None
    nvlink_domain: str | None
    nvlink_ready: bool
    nvlink: dict[str, Any] | None = Field(
        description="The NVLink facts of its inventory: domain, problems, per-GPU fabric."
    )
    nvlink_links: dict[str, Any] | None = Field(
        default=None,
        description="The NVLink link matrix (nvidia-smi topo -m and nvlink -s): per GPU its "
        "active and inactive links and bandwidth, the GPU pairs NVLink joins with their link "
        "count, the whole GPU/NIC matrix with CPU and NUMA affinity, each GPU's nearest NICs.",
    )
    ib_leaf: str | None
    infiniband: list[dict[str, Any]] = Field(
        description="RDMA ports with their GUIDs and the switch port each is cabled to."
    )


@router.route(
    "GET",
    "/api/v1/nvlink-domains",
    summary="List NVLink domains",
    roles=STAFF,
    response=NvlinkDomains,
    tag=TAG,
    use_case=workflows.topology,
)
async def list_nvlink_domains(req: ApiRequest, topo: Topology) -> NvlinkDomains:
    """Every NVLink domain the machines' GPUs report, with its members (tray slot, rack, leaf,
    power domain, fabric problems) and how many are free for a packed claim."""
    return NvlinkDomains(
        items=[NvlinkDomain.model_validate(d) for d in await topo.nvlink_domains()]
    )


@router.route(
    "GET",
    "/api/v1/ib-fabric",
    summary="List InfiniBand leaves",
    roles=STAFF,
    response=IbLeaves,
    tag=TAG,
    use_case=workflows.topology,
)
async def list_ib_leaves(req: ApiRequest, topo: Topology) -> IbLeaves:
    """Every InfiniBand leaf (or rail set) with the machines cabled to it."""
    return IbLeaves(items=[IbLeaf.model_validate(x) for x in await topo.ib_leaves()])


@router.route(
    "PUT",
    "/api/v1/ib-fabric",
    summary="Upload the InfiniBand fabric",
    roles=STAFF,
    body=IbFabricUpload,
    response=IbFabricUpdated,
    max_body=MAX_BYTES + 4096,
    errors=(422,),
    tag=TAG,
    use_case=workflows.topology,
)
async def upload_ib_fabric(req: ApiRequest, topo: Topology) -> IbFabricUpdated:
    """Replace the fabric's links with those of an ``ibnetdiscover`` output: each machine's
    leaf is the switch its inventoried port GUIDs are cabled to. Taken from the fabric's side,
    never from a host's own word."""
    out = await topo.upload_ib_fabric(req.body.ibnetdiscover, actor=req.actor)
    return IbFabricUpdated.model_validate(out)


@router.route(
    "GET",
    "/api/v1/machines/{id}/topology",
    summary="Show a machine's topology",
    roles=READERS,
    response=MachineTopology,
    errors=(404,),
    tag=TAG,
    use_case=workflows.topology,
)
async def show_machine_topology(req: ApiRequest, topo: Topology) -> MachineTopology:
    """The machine's NVLink domain and per-GPU fabric state, its InfiniBand ports with the
    switch each is cabled to, its rack and power domain."""
    out = await topo.machine(req.require_principal(), req.params["id"])
    return MachineTopology.model_validate(out)
