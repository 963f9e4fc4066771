"""Request and response models of the API. Requests forbid unknown fields."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

from api.paging import PageQuery
from api.resolve import Ref
from metald.auth import Role
from metald.inventory.rules import FIELD_NOT_LABEL, field_not_label
from metald.lifecycle import State

#: The largest value of an INTEGER column on PostgreSQL (ids, versions, counts): a larger one
#: in a filter is refused with 422 rather than failing in the database.
SQL_INT_MAX = (1 << 31) - 1
#: Fail with 409 unless the machine is at this version (optimistic concurrency).
Version = Annotated[
    int | None,
    Field(ge=0, le=SQL_INT_MAX, description="Fail with 409 unless the machine is at this version."),
]
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"
#: A label key; never a machine field's name (``rack``: metald.inventory.rules.field_not_label).
LabelKey = Annotated[
    str, StringConstraints(pattern=LABEL_KEY_PATTERN), AfterValidator(field_not_label)
]
LabelValue = Annotated[str, StringConstraints(max_length=253)]
Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
#: Free text of one line's worth: 1 to 500 characters.
Text = Annotated[str, StringConstraints(min_length=1, max_length=500)]
#: References in bodies and queries: what a path's {id} takes (api.resolve.resolve_refs).
TenantRef = Annotated[Text, Ref("tenants")]
ImageRef = Annotated[Text, Ref("images")]
MachineRef = Annotated[Text, Ref("machines")]


Item = TypeVar("Item")


class ListPage(BaseModel, Generic[Item]):
    """One page of a list, as every list endpoint answers it (``api.listing.answer``); each
    list names its own (``class MachinePage(ListPage[MachineOut])``)."""

    items: list[Item]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


class In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Query(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- machines ---------------------------------------------------------------------------


class TokenQuery(PageQuery):
    SORTABLE = ("name", "role", "created_at", "expires_at")


class TenantQuery(PageQuery):
    SORTABLE = ("name", "created_at")


class MachineQuery(PageQuery):
    SORTABLE = ("name", "state", "created_at", "updated_at", "rack", "gpu_model", "gpu_count")
    state: list[State] = Field(default=[], description="Filter by state (repeatable).")
    label: list[str] = Field(default=[], description="key=value (repeatable; all must match).")
    gpu_model: str | None = Field(
        default=None, description="Exact GPU model name, e.g. 'NVIDIA H100 80GB HBM3'."
    )
    gpu_count: int | None = Field(default=None, ge=0, le=1024, description="Exact number of GPUs.")
    min_gpu_count: int | None = Field(
        default=None, ge=0, le=1024, description="At least this many GPUs."
    )
    rack: str | None = None
    arch: Literal["amd64", "arm64"] | None = Field(
        default=None, description="CPU architecture (machines with none recorded are amd64)."
    )
    tenant_id: Annotated[str, Ref("tenants")] | None = Field(
        default=None, description="The tenant's id, name or an 8+ character id prefix."
    )

    @field_validator("label")
    @classmethod
    def _labels(cls, v: list[str]) -> list[str]:
        for item in v:
            key, eq, _value = item.partition("=")
            if not eq:
                raise ValueError(f"label filter {item!r} must be key=value")
            # The key becomes a JSON path in SQL: only keys a label can have are accepted.
            if not re.match(LABEL_KEY_PATTERN, key):
                raise ValueError(
                    f"label filter key {key!r} is not a label key (letters, digits, '._/-', "
                    "at most 63 characters, starting with a letter or digit)"
                )
            if key in FIELD_NOT_LABEL:
                raise ValueError(f"{key!r} is a machine field, not a label: filter with {key}=")
        return v


class MachineCreate(In):
    macs: list[str] = Field(
        min_length=1, max_length=16, description="NIC MACs; the first is the PXE NIC."
    )
    name: Name | None = None
    labels: dict[LabelKey, LabelValue] = {}
    rack: Name | None = None


class MachinePatch(In):
    """The fields a technician may change on a machine (absent: unchanged)."""

    name: Name | None = Field(default=None, description="Unique; paths accept it for the id.")
    rack: Name | None = None
    power_domain: Name | None = Field(
        default=None, description="The power feed or PDU group (claims spread over these)."
    )
    version: Version = None


class LabelsPatch(In):
    """JSON merge patch of labels: a string sets a label, null removes it."""

    labels: dict[LabelKey, LabelValue | None] = Field(max_length=64)
    version: Version = None


class MachineAction(In):
    action: Literal[
        "inspect", "maintenance-on", "maintenance-off", "mark-broken", "repair", "retire"
    ]
    reason: Annotated[str, StringConstraints(max_length=500)] | None = None
    version: Version = None


class NicOut(BaseModel):
    mac: str
    name: str | None = None
    driver: str | None = None
    speed_mbps: int | None = None
    link: bool | None = None
    pxe: bool = False


class MachineOut(BaseModel):
    id: str
    name: str | None
    state: str
    version: int
    labels: dict[str, str]
    rack: str | None
    rack_position: str | None
    firmware: str | None = None
    arch: str | None = Field(
        default=None,
        description="CPU architecture (amd64, arm64): from the agent's inventory (uname -m), "
        "else from the firmware DHCP saw; null while neither has said.",
    )
    system_uuid: str | None
    serial: str | None
    vendor: str | None
    product: str | None
    cpu_model: str | None
    cpu_count: int | None
    memory_mb: int | None
    gpu_model: str | None
    gpu_count: int
    nvlink_domain: str | None = Field(
        default=None, description="<clusterUuid>.<cliqueId> its GPUs report (NVLink fabric)."
    )
    nvlink_ready: bool = Field(
        default=False,
        description="Every GPU present and registered in nvlink_domain: placed by NVLink.",
    )
    ib_leaf: str | None = Field(
        default=None, description="The InfiniBand leaf switch(es) its ports are cabled to."
    )
    power_domain: str | None = None
    power_state: str | None
    firmware_versions: dict[str, str] = Field(
        default={}, description="Firmware inventory id -> version, as the BMC reported it."
    )
    bios: dict[str, Any] | None = Field(
        default=None, description="BIOS settings: current, pending, desired, drift, read_at."
    )
    secure_boot: dict[str, Any] | None = Field(
        default=None,
        description="UEFI Secure Boot as the BMC last reported it: enabled, current_boot, "
        "mode, certificates (database -> SHA-256 fingerprints), read_at.",
    )
    tenant_id: str | None
    claim_id: str | None
    last_error: str | None
    state_reason: str | None = Field(
        default=None,
        description="Why the machine is in its state: the reason given when it entered it "
        "(a maintenance or broken reason, a failure).",
    )
    allowed_actions: list[str]
    nics: list[NicOut] = []
    inventory: dict[str, Any] | None = None
    inventory_at: datetime | None
    state_changed_at: datetime
    created_at: datetime
    updated_at: datetime


class MachinePage(ListPage[MachineOut]):
    """One page of machines."""


# ---- events -----------------------------------------------------------------------------


class EventQuery(Query):
    machine_id: Annotated[str, Ref("machines")] | None = Field(
        default=None, description="The machine's id, name or an 8+ character id prefix."
    )
    kind: str | None = None
    after: int = Field(
        default=0,
        ge=0,
        le=SQL_INT_MAX,
        description=(
            "Only events delivered after the event with this id (the last one received, or a "
            "page's next_after). Events come in commit order, which on PostgreSQL may differ "
            "slightly from id order: resume from the cursor, never from the largest id seen."
        ),
    )
    limit: int | None = Field(
        default=None, ge=1, le=1000, description="Page size (default: the api.page_size setting)."
    )
    since: AwareDatetime | None = Field(
        default=None,
        description=(
            "Only events recorded at or after this time (RFC 3339 with a UTC offset, e.g. "
            "2026-12-06T17:00:00Z)."
        ),
    )
    sort: Literal["id", "-id"] = Field(
        default="id",
        description="id: delivery order (the default); -id: the newest first.",
    )


class EventStreamQuery(EventQuery):
    """A stream's filters: those of a list, in delivery order only."""

    sort: Literal["id"] = Field(
        default="id",
        description="A stream is in delivery (commit) order: id is the only value.",
    )


class EventOut(BaseModel):
    id: int
    at: datetime
    kind: str
    machine_id: str | None
    tenant_id: str | None
    from_state: str | None
    to_state: str | None
    actor: str
    instance: str | None
    reason: str | None
    data: dict[str, Any] | None


class EventPage(BaseModel):
    items: list[EventOut]
    next_after: int = Field(
        description="Pass as after to read on: no event that commits later is skipped."
    )
    next: str | None = Field(
        default=None,
        description="The next page (this request with after=next_after) when this one is full; "
        "null at the end (sort=-id lists the newest and has none).",
    )


# ---- tokens and tenants -----------------------------------------------------------------


class TokenCreate(In):
    name: Name
    role: Role
    scope: list[str] = Field(
        default=[],
        max_length=256,
        description="orchestrator: tenants; agent: one machine (ids, names or 8+ character id "
        "prefixes; the token holds the ids).",
    )
    ttl_seconds: int | None = Field(default=None, ge=60, le=10 * 365 * 86400)


class TokenOut(BaseModel):
    id: str
    name: str
    role: str
    scope: list[str]
    created_by: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret. Shown once; store it now.")


class TokenList(ListPage[TokenOut]):
    """One page of tokens."""


class WhoAmI(BaseModel):
    token_id: str
    name: str
    role: str
    scope: list[str]


class TenantCreate(In):
    name: Name
    cluster_kind: Literal["slurm", "kubernetes"] = "slurm"
    control_plane: Annotated[str, StringConstraints(max_length=253)] | None = None


class TenantOut(BaseModel):
    id: str
    name: str
    cluster_kind: str
    control_plane: str | None
    overlay_prefix: str | None
    #: VLAN id for the tenant's machines (switch automation reads it from claim events).
    vlan: int | None = None
    created_at: datetime


class TenantList(ListPage[TenantOut]):
    """One page of tenants."""


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    database: str
    version: str
    instance: str
    services: dict[str, str]
