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
from metald.claims.tenant_os import OsRequest
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
    attested: bool = Field(
        default=False,
        description="Only machines whose current boot passed measured-boot attestation "
        "(docs/attestation.md).",
    )
    secure_boot: bool = Field(
        default=False,
        description="Only machines whose BMC reports UEFI Secure Boot enabled and the current "
        "boot verified (POST /api/v1/machines/{id}/secure-boot turns it on; docs/bmc.md).",
    )
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


NicSelector = Annotated[
    dict[Literal["name", "mac", "pci", "role"], Annotated[str, StringConstraints(max_length=64)]],
    Field(min_length=1, max_length=1),
]
NetName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
IfName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z][a-zA-Z0-9_.-]{0,14}$")]


class RouteIn(In):
    to: Annotated[str, StringConstraints(max_length=64)]
    via: Annotated[str, StringConstraints(max_length=64)]
    metric: int | None = Field(default=None, ge=0, le=65535)


class _Addressing(In):
    network: NetName | None = Field(
        default=None, description="A pool in [provision.networks]: one static address from it."
    )
    dhcp4: bool = False
    default_route: bool = Field(
        default=False, description="Route everything via the network's gateway."
    )
    mtu: int | None = Field(default=None, ge=576, le=65535)
    routes: list[RouteIn] = Field(default=[], max_length=32)


class EthernetIn(_Addressing):
    nic: NicSelector


class BondIn(_Addressing):
    name: IfName
    mode: Literal["802.3ad", "active-backup"] = "802.3ad"
    nics: list[NicSelector] = Field(min_length=2, max_length=8)


class VlanIn(_Addressing):
    link: IfName = Field(description="A bond's name or a NIC's name.")
    id: int | None = Field(default=None, ge=1, le=4094, description="Default: the network's.")
    name: IfName | None = None


class RailsIn(In):
    networks: list[NetName] = Field(min_length=1, max_length=32, description="One pool per rail.")
    nics: list[NicSelector] = Field(
        default=[], max_length=32, description="Default: every non-PXE NIC in PCI order."
    )
    mtu: int | None = Field(default=None, ge=576, le=65535)


class DnsIn(In):
    nameservers: list[Annotated[str, StringConstraints(max_length=64)]] = Field(
        default=[], max_length=8
    )
    search: list[Annotated[str, StringConstraints(max_length=253)]] = Field(
        default=[], max_length=8
    )


class NetworkIn(In):
    """The deployed OS's network (docs/tenant-os.md); rendered as netplan v2 per machine."""

    ethernets: list[EthernetIn] = Field(default=[], max_length=64)
    bonds: list[BondIn] = Field(default=[], max_length=16)
    vlans: list[VlanIn] = Field(default=[], max_length=64)
    rails: RailsIn | None = None
    dns: DnsIn | None = None
    pxe_dhcp: bool = Field(
        default=True,
        description="DHCP on the PXE NIC when nothing else uses it; false: static only.",
    )


DiskHints = Annotated[
    dict[
        Literal["size", "model", "vendor", "serial", "wwn", "name", "by_path", "rotational"],
        str | int | bool,
    ],
    Field(max_length=8),
]


class RootIn(In):
    hints: DiskHints = {}
    raid: Literal[1] | None = None
    disks: list[DiskHints] = Field(default=[], max_length=2)


class LvIn(In):
    name: NetName
    size_gib: int = Field(ge=1, le=1 << 20)


class LvmIn(In):
    vg: NetName
    lvs: list[LvIn] = Field(default=[], max_length=16)


class VolumeIn(In):
    name: NetName
    raid: Literal[0, 1] | None = None
    disks: list[DiskHints] | Literal["rest"] = Field(default=[])
    fs: Literal["ext4", "xfs"] = "ext4"
    mount: Annotated[str, StringConstraints(pattern=r"^/[A-Za-z0-9_./-]{0,200}$")] | None = None
    lvm: LvmIn | None = None


class StorageIn(In):
    """Root device hints and scratch volumes (docs/tenant-os.md), checked per machine."""

    root: RootIn = RootIn()
    volumes: list[VolumeIn] = Field(default=[], max_length=16)


class PlacementIn(In):
    """Where the machines go in the fabric (docs/claims.md, Placement): exactly one of pack
    or spread."""

    pack: Literal["nvlink-domain", "rack", "ib-leaf"] | None = Field(
        default=None,
        description="Every group of machines inside one NVLink domain, rack or InfiniBand leaf.",
    )
    group_size: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Machines per group (count must be a multiple); default: one group of count.",
    )
    spread: Literal["power-domain"] | None = Field(
        default=None, description="Spread the machines evenly over power domains."
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
    user_data: Annotated[str, StringConstraints(max_length=16 << 20)] | None = Field(
        default=None,
        description="cloud-init user-data (cloud-config, script, boothook, include, jinja or "
        "MIME multipart), served as is; checked against cloud-init's schema; never shown again.",
    )
    meta_data: dict[Name, Text] = Field(
        default={}, max_length=32, description="Extra NoCloud meta-data keys."
    )
    network: NetworkIn | None = None
    storage: StorageIn | None = None
    placement: PlacementIn | None = None


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
    rack: str | None = None
    nvlink_domain: str | None = None
    ib_leaf: str | None = None
    power_domain: str | None = None
    last_error: str | None
    progress: ProgressOut | None = None


class ClaimOut(BaseModel):
    id: str
    tenant_id: str
    count: int
    selector: dict[str, Any]
    placement: dict[str, Any] | None = None
    image_id: str | None
    ssh_authorized_keys: list[str] = []
    state: str
    firmware_consent: bool = Field(
        default=False,
        description="The tenant consents to its machines being drained (out of the claim, "
        "replaced by its health policy) for firmware rollouts (docs/firmware.md).",
    )
    version: int = Field(description="Bumped by every change; the ETag, for If-Match.")
    idempotency_key: str | None
    created_by: str | None
    created_at: datetime
    updated_at: datetime
    network: dict[str, Any] | None = None
    storage: dict[str, Any] | None = None
    #: The user-data's form, size and sha256 (never its content).
    user_data: dict[str, Any] | None = None
    #: Static addresses metald handed out, by machine id.
    addresses: dict[str, list[dict[str, str]]] = {}
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


class ConsentIn(In):
    consent: bool = Field(
        description="true: a firmware rollout with in_use=drain may drain this claim's machines "
        "through the Day-2 path; false: they are updated only once released."
    )


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
    ``matched`` (machines matching the selector) and ``available`` (of those, ready and free);
    a ``placement`` that does not fit: 422 with ``free_per_domain``."""
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
        os=OsRequest(
            user_data=b.user_data,
            meta_data=b.meta_data,
            network=b.network.model_dump(exclude_defaults=True) if b.network else None,
            storage=b.storage.model_dump(exclude_defaults=True) if b.storage else None,
        ),
        placement=b.placement.model_dump(exclude_none=True) if b.placement else None,
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


@router.route(
    "PUT",
    "/api/v1/claims/{id}/firmware-consent",
    summary="Consent to firmware drains of a claim's machines",
    roles=CLAIMERS,
    body=ConsentIn,
    response=ClaimOut,
    tag=TAG,
    errors=(404, 409),
    versioned=True,
    use_case=workflows.claims,
)
async def firmware_consent(req: ApiRequest, claims: Claims) -> ClaimOut:
    """The tenant's orchestrator says whether a firmware rollout with ``in_use: drain`` may
    take this claim's machines out through the Day-2 path: drained in the tenant's scheduler
    (running jobs may finish for the claim's health policy's ``job_wait_s``), out of the
    claim, replaced when that policy replaces, wiped, then flashed from the pool. Without
    consent such a rollout waits for the machines' release. A ``claim.firmware-consent`` event
    on the claim's stream records each change."""
    b: ConsentIn = req.body
    out = await claims.firmware_consent(
        req.require_principal(),
        req.params["id"],
        b.consent,
        actor=req.actor,
        if_match=req.if_match,
    )
    return ClaimOut.model_validate(out)


class MachineUserData(In):
    user_data: Annotated[str, StringConstraints(max_length=16 << 20)] | None = Field(
        default=None, description="This machine's own user-data; null: the claim's."
    )
    meta_data: dict[Name, Text] = Field(default={}, max_length=32)


@router.route(
    "PUT",
    "/api/v1/claims/{id}/machines/{machine_id}/user-data",
    summary="Set one machine's user-data",
    roles=CLAIMERS,
    body=MachineUserData,
    response=ClaimOut,
    tag=TAG,
    errors=(404, 422),
    use_case=workflows.claims,
)
async def set_machine_user_data(req: ApiRequest, claims: Claims) -> ClaimOut:
    """Give one machine of the claim its own cloud-init user-data and meta-data instead of the
    claim's (checked the same way); served at the machine's next provisioning. Write-only:
    the claim shows its form, size and digest, never the content."""
    b: MachineUserData = req.body
    out = await claims.set_machine_user_data(
        req.require_principal(),
        req.params["id"],
        req.params["machine_id"],
        actor=req.actor,
        user_data=b.user_data,
        meta_data=b.meta_data,
    )
    return ClaimOut.model_validate(out)


class TopologyNodeOut(BaseModel):
    name: str = Field(description="The node's name in the tenant's cluster.")
    nvlink_domain: str | None
    ib_leaf: str | None
    address: str | None = Field(description="Its address on the tenant's mesh, once joined.")
    features: list[str] = Field(description="Node features naming where it sits.")


class ImexConfigOut(BaseModel):
    nvlink_domain: str
    nodes_config: str = Field(description="IMEX nodes_config.cfg: one node address a line.")


class ClaimTopologyOut(BaseModel):
    claim_id: str
    placement: dict[str, Any] | None
    nodes: list[TopologyNodeOut]
    slurm_topology_tree: str = Field(description="topology.conf for topology/tree (Slurm 22.05).")
    slurm_topology_block: str = Field(
        description="topology.conf for topology/block (Slurm 23.11 and later)."
    )
    imex_nodes_config: list[ImexConfigOut]
    unaddressed: list[str] = Field(
        description="Nodes in an NVLink domain that have not joined yet: not in the IMEX files."
    )


@router.route(
    "GET",
    "/api/v1/claims/{id}/topology",
    summary="Show a claim's topology",
    roles=READERS,
    response=ClaimTopologyOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.claims,
)
async def show_claim_topology(req: ApiRequest, claims: Claims) -> ClaimTopologyOut:
    """The claim's nodes by NVLink domain and InfiniBand leaf, as Slurm topology.conf (tree
    and block plugins) and NVIDIA IMEX nodes_config.cfg per NVLink domain."""
    out = await claims.topology(req.require_principal(), req.params["id"])
    return ClaimTopologyOut.model_validate(out)


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
