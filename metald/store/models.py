"""The tables metald keeps. One module so the schema (and its Alembic migrations) has one home.

Conventions: string UUID primary keys (safe across several metald instances on one database),
timezone-aware UTC timestamps, JSON columns for open-ended data (labels, inventory), and a
``version`` column on rows that several writers race on (machines, claims).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Index,
    LargeBinary,
    Text,
    UniqueConstraint,
    false,
    func,
    text,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import FunctionElement
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(ts: datetime) -> datetime:
    """A stored timestamp as an aware UTC datetime: SQLite hands back naive ones, and metald
    writes UTC only."""
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def new_id() -> str:
    return str(uuid.uuid4())


def _ts(**kw: Any) -> Any:
    return Field(default_factory=utcnow, sa_column_kwargs={}, sa_type=DateTime(timezone=True), **kw)


class Machine(SQLModel, table=True):
    __tablename__ = "machines"

    id: str = Field(default_factory=new_id, primary_key=True)
    name: str | None = Field(default=None, unique=True)
    state: str = Field(index=True)
    #: Bumped by every write; writers compare-and-swap on it so two racing writers cannot both win.
    version: int = Field(default=1)
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    rack: str | None = Field(default=None, index=True)
    #: Switch port (DHCP option 82 / LLDP), which is the machine's rack position.
    rack_position: str | None = None
    #: Boot firmware as its last network boot told DHCP (option 93): bios, uefi-x64,
    #: uefi-ia32, uefi-arm64. A disk image must suit it (BIOS or UEFI boot loader).
    firmware: str | None = None
    #: CPU architecture, Debian's names: amd64, arm64. From the agent's inventory (uname -m),
    #: else from the firmware DHCP saw. Claims select on it; a boot image must be built for it.
    arch: str | None = Field(default=None, index=True)
    system_uuid: str | None = Field(default=None, index=True)
    serial: str | None = Field(default=None, index=True)
    vendor: str | None = None
    product: str | None = None
    cpu_model: str | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    gpu_model: str | None = Field(default=None, index=True)
    gpu_count: int = Field(default=0, index=True)
    inventory: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    inventory_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    power_state: str | None = None
    #: Firmware versions from the BMC's inventory (Redfish FirmwareInventory): id -> version.
    firmware_versions: dict[str, str] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False, server_default="{}")
    )
    #: BIOS settings (metald.bmc.firmware): current, pending, desired (the enroll rules'
    #: profile), drift (desired attributes the firmware does not have), read_at.
    bios: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: UEFI Secure Boot as the BMC last reported it (metald.bmc.secureboot): enabled,
    #: current_boot, mode, certificates (database -> SHA-256 fingerprints), read_at.
    secure_boot: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: What the next network boot should do (discovery, provision image, local disk, wipe).
    boot_intent: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    tenant_id: str | None = Field(default=None, foreign_key="tenants.id", index=True)
    claim_id: str | None = Field(default=None, foreign_key="claims.id", index=True)
    #: The machine held a tenant's data and has not been wiped (or confirmed wiped) since.
    wipe_required: bool = False
    #: The boot metald started (power-off, PXE, on; or a new phase) whose first script fetch
    #: may carry an agent token; None once that fetch took it.
    boot_armed: str | None = None
    #: The boot whose script carried the machine's current agent token.
    boot_current: str | None = None
    last_error: str | None = None
    #: A technician vouched for this machine (enroll.require_bmc: claimable without a BMC).
    approved_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    approved_by: str | None = None
    #: ``<clusterUuid>.<cliqueId>`` its GPUs report (metald.inventory.nvlink); placement packs
    #: by it only while ``nvlink_ready`` (every GPU present and registered in that domain).
    nvlink_domain: str | None = Field(default=None, index=True)
    nvlink_ready: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    #: The InfiniBand leaf switch(es) its ports are cabled to (metald.fabric_topology).
    ib_leaf: str | None = Field(default=None, index=True)
    #: Set by people (PATCH): the power feed or PDU group the machine hangs off.
    power_domain: str | None = Field(default=None, index=True)
    #: The boot whose measured-boot attestation passed (or taught the golden values): the
    #: machine is attested while this is its current boot (``metald.provision.attestation``).
    attested_boot: str | None = None
    state_changed_at: datetime = _ts()
    created_at: datetime = _ts()
    updated_at: datetime = _ts()

    #: Claim allocation walks ready machines smallest first (gpu_count, memory_mb, id) and
    #: stops at the claim's count: this index is that order.
    __table_args__ = (Index("ix_machines_alloc", "state", "gpu_count", "memory_mb", "id"),)


class Nic(SQLModel, table=True):
    __tablename__ = "nics"

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    #: Lower-case colon form, aa:bb:cc:dd:ee:ff.
    mac: str = Field(unique=True)
    name: str | None = None
    driver: str | None = None
    speed_mbps: int | None = None
    link: bool | None = None
    pxe: bool = False


class Bmc(SQLModel, table=True):
    __tablename__ = "bmcs"

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str | None = Field(default=None, foreign_key="machines.id", unique=True)
    address: str
    port: int | None = None
    #: ipmi or redfish.
    protocol: str
    username: str
    #: Encrypted with the secrets key (metald.secrets); never returned or logged.
    password_enc: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    verify_tls: bool = True
    ca_cert: str | None = None
    #: ok, auth-failed, unreachable, error, unknown.
    health: str = "unknown"
    health_detail: str | None = None
    power_state: str | None = None
    system_uuid: str | None = None
    #: Indexed (with lower(system_uuid), below): a machine's first inventory finds its BMC by
    #: them (``BmcRegistry.link_by_identity``), among every BMC registered ahead of it.
    serial: str | None = Field(default=None, index=True)
    macs: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    last_seen_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    created_at: datetime = _ts()
    #: The instance that holds this BMC (metald.bmc.ownership) and its fencing generation,
    #: raised at every acquisition: a command is sent only while both still match.
    owner: str | None = Field(default=None, index=True)
    generation: int = 0
    #: The provisioning step (machine state and entry time) whose commands are journaled
    #: here, its last command recorded before it was sent, and whether the step finished.
    step: str | None = None
    step_command: str | None = None
    step_done: bool = False

    __table_args__ = (
        UniqueConstraint("address", "port", name="uq_bmcs_address_port"),
        Index("ix_bmcs_system_uuid_lower", func.lower(text("system_uuid"))),
    )


class Lease(SQLModel, table=True):
    """A DHCP lease. (network, ip) is unique, so no address is ever held by two clients."""

    __tablename__ = "leases"

    id: int | None = Field(default=None, primary_key=True)
    network: str
    ip: str
    mac: str = Field(index=True)
    client_id: str | None = None
    hostname: str | None = None
    #: offered, bound, released, declined.
    state: str
    expires_at: datetime = Field(sa_type=DateTime(timezone=True))
    updated_at: datetime = _ts()

    __table_args__ = (UniqueConstraint("network", "ip", name="uq_leases_network_ip"),)


class Tenant(SQLModel, table=True):
    __tablename__ = "tenants"

    id: str = Field(default_factory=new_id, primary_key=True)
    name: str = Field(unique=True)
    #: slurm or kubernetes.
    cluster_kind: str = "slurm"
    control_plane: str | None = None
    #: Encrypted JSON blob of scheduler secrets (munge key, CA key, ...).
    secrets_enc: bytes | None = Field(default=None, sa_column=Column(LargeBinary))
    overlay_prefix: str | None = Field(default=None, unique=True)
    #: The tenant's VLAN id, emitted in its claims' events for switch automation.
    vlan: int | None = Field(default=None, unique=True, index=True)
    #: The tenant's InfiniBand partition key (0x0001-0x7ffe), emitted with its claims' events
    #: for the subnet manager; unique while the tenant holds it.
    pkey: int | None = Field(default=None, unique=True, index=True)
    #: Bumped whenever the tenant's mesh (peers, their endpoints) changes; nodes ack it.
    mesh_generation: int = 0
    created_at: datetime = _ts()


class Claim(SQLModel, table=True):
    __tablename__ = "claims"

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant_id: str = Field(foreign_key="tenants.id", index=True)
    #: Idempotency key, unique per tenant: a retried request returns the same claim.
    idempotency_key: str | None = None
    count: int
    selector: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    image: str | None = None
    #: Public SSH keys written into each machine's first-boot metadata (cloud-init NoCloud).
    ssh_authorized_keys: list[str] | None = Field(default=None, sa_column=Column(JSON))
    #: The deployed OS's network request (metald.provision.netplan); None: DHCP on the PXE NIC.
    network: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: The storage layout (metald.provision.storage); None: the image on the smallest disk.
    storage: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: How the machines were placed (metald.claims.placement): {"pack": ..., "group_size": ...}
    #: or {"spread": "power-domain"}; None: no placement asked.
    placement: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: pending, allocated, released, failed.
    state: str = "pending"
    #: The tenant consents to its machines being drained (Day-2 path: drained in its
    #: scheduler, replaced) for a firmware rollout with ``in_use = drain`` (docs/firmware.md).
    firmware_consent: bool = False
    version: int = 1
    created_by: str | None = None
    created_at: datetime = _ts()
    updated_at: datetime = _ts()

    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_claims_tenant_idem"),
    )


class ElasticPoolRow(SQLModel, table=True):
    """A tenant's elastic pool (docs/elastic.md): CLOUD nodes ``<prefix>1..<prefix><max>`` in
    its slurm.conf; slurmctld's power saving resumes them into claims (one per node name,
    idempotency key ``elastic:<pool id>:<node>``) and suspends them into releases."""

    __tablename__ = "elastic_pools"

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant_id: str = Field(foreign_key="tenants.id", index=True)
    name: str
    prefix: str
    min_nodes: int = 0
    max_nodes: int
    selector: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    image: str
    suspend_time_s: int = 300
    resume_timeout_s: int = 1800
    version: int = 1
    created_by: str | None = None
    created_at: datetime = _ts()
    updated_at: datetime = _ts()

    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_elastic_pools_tenant_name"),
        UniqueConstraint("tenant_id", "prefix", name="uq_elastic_pools_tenant_prefix"),
    )


class ElasticQuota(SQLModel, table=True):
    """An admin's cap on what a tenant's elastic pools may hold at once (docs/elastic.md):
    machines in all (null: no cap) and per GPU model (``{"NVIDIA H100 80GB HBM3": 8}``)."""

    __tablename__ = "elastic_quotas"

    tenant_id: str = Field(foreign_key="tenants.id", primary_key=True)
    max_machines: int | None = None
    per_sku: dict[str, int] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    updated_by: str | None = None
    updated_at: datetime = _ts()


class ClaimUserData(SQLModel, table=True):
    """A tenant's cloud-init user-data and meta-data for a claim (``machine_id`` None) or one
    machine of it. Kept apart from ``claims`` so no claim view can carry it by accident: only
    the machine's own agent token reads it (``metald.claims.provisioning``)."""

    __tablename__ = "claim_user_data"

    id: str = Field(default_factory=new_id, primary_key=True)
    claim_id: str = Field(foreign_key="claims.id", index=True)
    machine_id: str | None = Field(default=None, foreign_key="machines.id")
    user_data: str | None = Field(default=None, sa_column=Column(Text))
    #: Extra NoCloud meta-data keys (never instance-id or local-hostname).
    meta_data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    #: What claim views show instead of the content.
    sha256: str | None = None
    form: str | None = None
    created_at: datetime = _ts()


class IpAllocation(SQLModel, table=True):
    """One static address metald handed out of a pool ([provision.networks.NAME]) to one
    interface of a claimed machine; deleted when the machine leaves the claim."""

    __tablename__ = "ip_allocations"

    network: str = Field(primary_key=True)
    address: str = Field(primary_key=True)
    claim_id: str = Field(foreign_key="claims.id", index=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    #: The netplan interface id (bond0.42, ib3 ...).
    interface: str
    created_at: datetime = _ts()


class IbLink(SQLModel, table=True):
    """A host port's InfiniBand neighbour: the leaf switch the fabric's discovery
    (``ibnetdiscover``) found it cabled to. Replaced as a whole by each upload."""

    __tablename__ = "ib_links"

    port_guid: str = Field(primary_key=True)
    switch_guid: str
    switch_name: str | None = None
    switch_port: int | None = None
    updated_at: datetime = _ts()


class Image(SQLModel, table=True):
    """What a claim installs: ``stateless`` (kernel + initrd/rootfs in RAM) or ``disk`` (a raw
    or qcow2 image streamed to disk by the agent). ``spec`` is validated by metald.provision."""

    __tablename__ = "images"

    id: str = Field(default_factory=new_id, primary_key=True)
    name: str = Field(unique=True)
    #: stateless or disk.
    kind: str
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    #: Tenants whose orchestrators may see and claim it; empty: every tenant (public).
    tenants: list[str] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False, server_default="[]")
    )
    created_by: str | None = None
    created_at: datetime = _ts()


class current_txid(FunctionElement[int]):  # noqa: N801 (an SQL function's name)
    """The writing transaction's id on PostgreSQL (64-bit, never wraps); NULL elsewhere."""

    type = BigInteger()
    inherit_cache = True


@compiles(current_txid)
def _current_txid_default(element: current_txid, compiler: Any, **kw: Any) -> str:
    return "NULL"


@compiles(current_txid, "postgresql")
def _current_txid_pg(element: current_txid, compiler: Any, **kw: Any) -> str:
    return "(pg_current_xact_id()::text::bigint)"


class Event(SQLModel, table=True):
    """Append-only record of what happened: transitions, actions, drift, progress."""

    __tablename__ = "events"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = _ts()
    kind: str = Field(index=True)
    machine_id: str | None = Field(default=None, index=True)
    tenant_id: str | None = Field(default=None, index=True)
    from_state: str | None = None
    to_state: str | None = None
    #: Who did it: token name/role, or "metald:<instance>" for the daemon itself.
    actor: str
    #: The metald instance that recorded it (several may share one database).
    instance: str | None = None
    reason: str | None = None
    data: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: PostgreSQL: the id of the transaction that wrote the row (the server sets it). Readers
    #: order events by (txid, id) and read only rows whose transaction and every older one has
    #: finished, so an event that commits after a later id was read is not skipped
    #: (metald.events). NULL on SQLite, whose ids are already in commit order.
    txid: int | None = Field(
        default=None, sa_column=Column(BigInteger, nullable=True, server_default=current_txid())
    )

    __table_args__ = (
        Index("ix_events_machine_id_id", "machine_id", "id"),
        Index("ix_events_txid_id", "txid", "id"),
    )


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_tokens"

    id: str = Field(default_factory=new_id, primary_key=True)
    name: str
    #: admin, technician, orchestrator, agent.
    role: str
    #: orchestrator: tenant ids; agent: [machine id].
    scope: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    #: An agent token's machine (its scope's one id), indexed: revoking a machine's tokens on
    #: every boot, release and wipe is then one indexed UPDATE, not a scan of every token.
    machine_id: str | None = Field(default=None, index=True)
    #: An agent token's phase (inspect, provision, wipe: ``lifecycle.PHASES``) and the boot it
    #: was minted for (``Machine.boot_current``); endpoints check both.
    phase: str | None = None
    boot: str | None = None
    #: sha256 of the secret; the secret itself is shown once, at creation.
    token_hash: str = Field(unique=True)
    created_by: str | None = None
    created_at: datetime = _ts()
    expires_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    revoked_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    last_used_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class UiSession(SQLModel, table=True):
    """A web console login (``metald.usecases.ui_sessions``): bound to the API token it was opened with,
    which every request checks again. The cookie carries a random id; only its SHA-256 is kept
    here, so a copy of the database opens no session."""

    __tablename__ = "ui_sessions"

    id_hash: str = Field(primary_key=True)
    token_id: str = Field(index=True)
    #: The synchronizer token every state-changing request must carry (form field or header).
    csrf: str
    created_at: datetime = _ts()
    last_seen_at: datetime = _ts()
    #: The absolute end of the session, whatever its use.
    expires_at: datetime = Field(sa_type=DateTime(timezone=True))


class Meta(SQLModel, table=True):
    """Small key/value facts about the installation (e.g. when it was initialised)."""

    __tablename__ = "meta"

    key: str = Field(primary_key=True)
    value: str


class WgHub(SQLModel, table=True):
    """A tenant's WireGuard hub: the one end every node of that tenant tunnels to."""

    __tablename__ = "wg_hubs"

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant_id: str = Field(foreign_key="tenants.id", unique=True)
    #: Interface name, unique host-wide (wireguard-go control sockets are global).
    ifname: str = Field(unique=True)
    public_key: str
    #: Encrypted with the secrets key; never returned or logged.
    private_key_enc: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    #: host:port nodes dial (the hub's underlay address).
    endpoint: str
    listen_port: int
    #: The hub's own overlay address (first host of the tenant's overlay prefix).
    address: str
    created_at: datetime = _ts()


class TenantCtlState(SQLModel, table=True):
    """A tenant's Slurm controller state (slurmctld's StateSaveLocation), so it survives the
    hub's move to another instance (``metald.tenants.ctlstate``)."""

    __tablename__ = "tenant_ctl_state"

    tenant_id: str = Field(foreign_key="tenants.id", primary_key=True)
    #: The instance that brought the hub up last; saves are fenced by ``generation``.
    owner: str
    generation: int = 0
    #: gzip'd tar of the folder, encrypted with the secrets key (job scripts and environments).
    data_enc: bytes | None = Field(default=None, sa_column=Column(LargeBinary))
    size: int = 0
    saved_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class WgPeer(SQLModel, table=True):
    """A node on a tenant's hub. (tenant, address) is unique: no address is held twice."""

    __tablename__ = "wg_peers"

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant_id: str = Field(foreign_key="tenants.id", index=True)
    machine_id: str = Field(foreign_key="machines.id", unique=True)
    public_key: str = Field(unique=True)
    address: str
    last_handshake_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: Where the hub last saw the node (ip:port): a restarted hub dials it at once instead of
    #: waiting for the node's next handshake.
    last_endpoint: str | None = None
    #: The underlay address the node's join came from (its mesh endpoint until the hub sees it).
    registered_from: str | None = None
    #: sha256 of the node token minted at join: the node's credential for its mesh view only.
    node_token_hash: str | None = Field(default=None, unique=True)
    #: The tenant mesh generation the node last applied; None: it never fetched a mesh view.
    mesh_acked: int | None = None
    created_at: datetime = _ts()

    __table_args__ = (UniqueConstraint("tenant_id", "address", name="uq_wg_peers_tenant_address"),)


class JoinToken(SQLModel, table=True):
    """A one-time, short-lived token a node presents to join its tenant's cluster.

    Only the sha256 of the secret is stored; ``used_at`` is set by a compare-and-swap UPDATE.
    """

    __tablename__ = "join_tokens"

    id: str = Field(default_factory=new_id, primary_key=True)
    token_hash: str = Field(unique=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    tenant_id: str = Field(foreign_key="tenants.id", index=True)
    expires_at: datetime = Field(sa_type=DateTime(timezone=True))
    used_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    revoked_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    created_by: str | None = None
    created_at: datetime = _ts()


class Instance(SQLModel, table=True):
    """A metald process that shares this store: who it is, what it serves, when it last beat.

    ``heartbeat_at`` is written with the database's clock (PostgreSQL), so liveness never depends
    on the instances' clocks agreeing. ``incarnation`` is new at every start: a second process
    under a live instance's name is refused, and an old process whose row was taken over stops.
    """

    __tablename__ = "instances"

    name: str = Field(primary_key=True)
    incarnation: str
    version: str
    api_url: str | None = None
    host: str | None = None
    #: Process id on ``host``: a restart on the same host takes over a name whose process is
    #: gone at once, instead of waiting out dead_after_s.
    pid: int | None = None
    #: What this instance serves: provisioning networks, BMC networks (CIDRs), hubs.
    serves: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    started_at: datetime = _ts()
    heartbeat_at: datetime = _ts()
    #: Set by a clean stop, so the others take over at once instead of after the dead time.
    stopped_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class StoreMeta(SQLModel, table=True):
    """Facts about the store itself (key -> bytes), e.g. the secrets key's check value."""

    __tablename__ = "store_meta"

    key: str = Field(primary_key=True)
    value: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = _ts()


class CommissioningRun(SQLModel, table=True):
    """One commissioning of a machine against a profile (``metald.commissioning``): requested
    (waiting for the discovery boot's inventory), running, then passed, failed or error."""

    __tablename__ = "commissioning_runs"
    #: A machine's open run (requested or running) is found through this index: the planner
    #: would otherwise take the status index and read every running run of the fleet.
    __table_args__ = (Index("ix_commissioning_runs_machine_status", "machine_id", "status"),)

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    profile: str
    status: str = Field(index=True)
    #: The profile as it was when the run was requested (its checks are what the agent runs):
    #: a rule edited mid-run changes nothing for this run.
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    requested_by: str
    #: Why it failed, in a sentence naming the failed checks.
    summary: str | None = None
    created_at: datetime = _ts()
    started_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    finished_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: metald's reading of the BMC's event log when the agent asked for its plan (the bmc-sel
    #: check): the entries' keys and count, or why the BMC could not be read.
    sel_before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class CommissioningResult(SQLModel, table=True):
    """One check of a run: metald's verdict, what the agent said, the values, bounded output."""

    __tablename__ = "commissioning_results"
    __table_args__ = (UniqueConstraint("run_id", "check", name="uq_commissioning_result_check"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="commissioning_runs.id", index=True)
    check: str
    #: metald's verdict: passed, failed, skipped or error.
    status: str
    #: What the agent reported; kept for the record, never trusted alone.
    agent_status: str | None = None
    duration_s: float | None = None
    sentence: str
    values: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    raw: str | None = Field(default=None, sa_column=Column(Text))
    at: datetime = _ts()


class Repair(SQLModel, table=True):
    """A machine in the technicians' repair queue (``metald.repairs``): why (the faults and
    their evidence, bounded), the part to look at, who took it, their notes, and how it ended.

    ``open_machine_id`` is the machine's id while the repair is not closed and None after: its
    unique index keeps one open repair per machine, whoever opens it at the same moment."""

    __tablename__ = "repairs"

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    open_machine_id: str | None = Field(default=None, unique=True)
    #: open (in the queue), taken (a technician works on it), verifying (repaired: wipe and
    #: commissioning under way), closed.
    status: str = Field(index=True)
    #: remediation, technician, commissioning or release.
    source: str
    #: The remediation that opened it (its key: a remediation opens one repair, once).
    remediation_id: str | None = Field(default=None, unique=True)
    opened_by: str
    opened_at: datetime = _ts()
    #: The worst fault in a sentence.
    summary: str
    #: The fault records (kind, subject, code, severity, witness, evidence, first_seen ...).
    faults: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    #: Where to look, one entry per faulty part (GPU by PCI address and serial, DIMM slot ...).
    parts: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    taken_by: str | None = None
    taken_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    notes: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    repaired_by: str | None = None
    repaired_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: Commissioning runs that failed after this repair was marked repaired.
    commission_failures: int = 0
    closed_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: returned (commissioning passed: ready), out (failed commissioning twice after repair).
    outcome: str | None = None
    #: Why it ended, in a sentence.
    outcome_reason: str | None = None
    #: Bumped by every write; writers compare-and-swap on it.
    version: int = 1


class HealthFault(SQLModel, table=True):
    """One fault of a machine in use (``metald.health.trust.Fault``), open until a trusted
    witness clears it, a repair ends it, or (transient) it expires. ``open_key`` is the fault's
    key while it is open and NULL once cleared: one open row per key, however many instances
    record it at once."""

    __tablename__ = "health_faults"
    __table_args__ = (
        UniqueConstraint("open_key", name="uq_health_faults_open_key"),
        Index("ix_health_faults_machine_cleared", "machine_id", "cleared_at"),
    )

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id")
    open_key: str | None = None
    #: bmc, metald, scheduler, node (set by the code path that received the signal).
    witness: str
    kind: str
    subject: str
    code: str
    #: fatal, degraded, transient.
    severity: str
    #: The classification rule that decided, its sentence, and the part to look at.
    rule: str
    why: str = ""
    part: str = ""
    evidence: str = Field(sa_column=Column(Text, nullable=False))
    table_version: str
    first_at: datetime = _ts()
    last_at: datetime = _ts()
    #: How many signals it has seen.
    count: int = 1
    cleared_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: Who or what cleared it: the witness, "expired", "repaired".
    cleared_by: str | None = None


class BmcLogCursor(SQLModel, table=True):
    """How far a BMC's event log was read for health (SEL record id or Redfish entry id), and
    the keys of the entries seen, so each read turns only new entries into signals."""

    __tablename__ = "bmc_log_cursors"

    bmc_id: str = Field(foreign_key="bmcs.id", primary_key=True)
    last_id: str | None = None
    #: ``metald.commissioning.parsers.bmc_sel.entry_key`` of the entries seen (bounded).
    keys: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    entries: int = 0
    read_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: The instance that read it last (the BMC's owner then).
    reader: str | None = None


class BmcEventSubscription(SQLModel, table=True):
    """A Redfish EventService subscription metald holds on a BMC (push of its log entries to
    ``POST /api/v1/bmc-events/{bmc_id}``), made by the BMC's owner. Only a hash of the secret
    the BMC sends with each event is kept (``metald.healthwatch.pushed``)."""

    __tablename__ = "bmc_event_subscriptions"

    bmc_id: str = Field(foreign_key="bmcs.id", primary_key=True)
    #: SHA-256 of the per-BMC secret, hex.
    secret_hash: str
    #: The subscription's resource on the BMC (its ``Location``); None until the BMC took it.
    uri: str | None = None
    #: The instance that subscribed (the BMC's owner then).
    owner: str | None = None
    created_at: datetime = Field(sa_type=DateTime(timezone=True))
    #: The last event the BMC pushed and metald accepted.
    event_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    events: int = 0
    #: ``entry_key`` of the entries pushed and recorded (bounded): the polled read of the log
    #: takes them as seen, so an entry pushed and then polled is one signal, not two.
    keys: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))


class NodeHeartbeat(SQLModel, table=True):
    """A machine's last node report (the agent's heartbeat): silence is measured from it."""

    __tablename__ = "node_heartbeats"

    machine_id: str = Field(foreign_key="machines.id", primary_key=True)
    #: The claim the machine was in at that report: silence counts only within the same claim
    #: (a machine claimed again is not silent for its old report).
    claim_id: str | None = None
    last_at: datetime = _ts()
    reports: int = 0
    #: Parts of the last report metald could not read, in a sentence each.
    unreadable: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    #: The last fully read report's nvidia-smi digest and signal count when it found nothing
    #: (``metald.healthwatch.reports``); NULL otherwise. A report that says the same again is
    #: not parsed again.
    digests: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    #: Per GPU (PCI address), the correctable-ECC counts of the node's reports within
    #: ``[health] ecc_window_s``: ``[[iso time, count], ...]`` (migration 0033). A storm is a
    #: rate over them (``metald.health.node.ecc_storms``).
    ecc_readings: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class Remediation(SQLModel, table=True):
    """One remediation of a machine of a claim (``metald.health.remediation``): its step, the
    claim's policy as it was when it started, the replacement claimed in its place, and the
    instance driving it. ``open_machine`` is the machine id until done (NULL after): one open
    remediation per machine. Steps are written with a compare-and-swap on ``version``."""

    __tablename__ = "remediations"
    __table_args__ = (
        UniqueConstraint("open_machine", name="uq_remediations_open_machine"),
        UniqueConstraint("replacement_id", name="uq_remediations_replacement"),
        Index("ix_remediations_step", "step"),
    )

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    open_machine: str | None = None
    claim_id: str = Field(foreign_key="claims.id", index=True)
    tenant_id: str = Field(foreign_key="tenants.id", index=True)
    rack: str | None = None
    #: The machine's node name in the tenant's scheduler.
    node: str
    step: str
    severity: str
    #: Why it was opened: ``health`` (a fault) or ``firmware`` (a rollout's drain, with the
    #: tenant's consent: the machine leaves its claim for its update, no repair).
    cause: str = "health"
    evidence: str = Field(sa_column=Column(Text, nullable=False))
    policy: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    drained_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    #: The machine claimed in its place (written in the transaction that claims it).
    replacement_id: str | None = None
    #: The last decision's sentence (also on the claim's event stream).
    reason: str = ""
    #: The instance that wrote the last step (the tenant hub's owner then).
    owner: str | None = None
    version: int = 1
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    done_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class FirmwareBaseline(SQLModel, table=True):
    """One version of a SKU profile's firmware baseline (``metald.firmware.baselines``): the
    wanted version of each component, with the image's URL and SHA-256. A change is a new
    row (version + 1); the newest version of a profile is the one machines are held to."""

    __tablename__ = "firmware_baselines"
    __table_args__ = (UniqueConstraint("profile", "version", name="uq_firmware_baseline_version"),)

    id: str = Field(default_factory=new_id, primary_key=True)
    #: The commissioning (SKU) profile's name, as the enroll rules give it.
    profile: str = Field(index=True)
    version: int
    components: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    note: str | None = None
    created_by: str
    created_at: datetime = _ts()


class FirmwareUpdate(SQLModel, table=True):
    """One component's update on one machine through its BMC (``metald.firmware.updates``):
    every step is recorded here before it is taken, so whoever owns the BMC next resumes it
    from the BMC's task instead of flashing again."""

    __tablename__ = "firmware_updates"
    __table_args__ = (Index("ix_firmware_updates_machine_phase", "machine_id", "phase"),)

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id", index=True)
    #: The BMC it went through (no foreign key: the record outlives a BMC removed later).
    bmc_id: str = Field(index=True)
    profile: str
    baseline_version: int
    #: The baseline component and the FirmwareInventory item it updates.
    component: str
    item: str
    version_before: str | None = None
    version: str
    sha256: str
    apply: str
    #: How the image reaches the BMC: simple-update (the BMC pulls it) or multipart (pushed).
    transfer: str | None = None
    #: queued, offering, flashing, applying, verifying, done, failed (``updates.PHASES``).
    phase: str = Field(index=True)
    #: The BMC's task monitor (or Task resource) for the flash, once the BMC accepted it.
    task_uri: str | None = None
    percent: int | None = None
    #: Each step as taken: [{"step": ..., "at": ...}] (bounded).
    journal: list[dict[str, Any]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False)
    )
    error: str | None = None
    requested_by: str
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    finished_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class FirmwareRollout(SQLModel, table=True):
    """A firmware rollout across the fleet (``metald.firmware.rollouts``): machines of one
    profile flashed to one baseline version in waves, stopped by a failure budget. Driven by
    one instance at a time (``owner`` holds it until ``lease_until``); a survivor takes it
    over once the lease runs out."""

    __tablename__ = "firmware_rollouts"

    id: str = Field(default_factory=new_id, primary_key=True)
    profile: str = Field(index=True)
    baseline_version: int
    #: The claims' selector the targets were chosen with (for the record).
    selector: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    batch_size: int
    max_unavailable: int
    failure_budget: int
    #: skip, wait or drain (``metald.firmware.waves.InUse``).
    in_use: str
    #: running, paused, done, stopped, aborted (``metald.firmware.waves.RolloutState``).
    state: str = Field(index=True)
    reason: str | None = None
    owner: str | None = None
    lease_until: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    created_by: str
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    #: Set once nothing of it runs any more (ended and every started update settled).
    finished_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True), index=True)


class FirmwareRolloutTarget(SQLModel, table=True):
    """One machine of a rollout and where it stands."""

    __tablename__ = "firmware_rollout_targets"

    rollout_id: str = Field(foreign_key="firmware_rollouts.id", primary_key=True)
    machine_id: str = Field(primary_key=True, index=True)
    #: The rollout's order (waves take targets in it).
    seq: int
    #: pending, waiting, draining, updating, done, failed, skipped (``waves.TargetStatus``).
    status: str
    wave: int | None = None
    #: The state the machine was in before the rollout put it in maintenance (back after).
    prior_state: str | None = None
    error: str | None = None
    started_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))
    finished_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class AttestationKey(SQLModel, table=True):
    """A machine's TPM attestation key (AK), enrolled at its first discovery boot."""

    __tablename__ = "attestation_keys"

    machine_id: str = Field(foreign_key="machines.id", primary_key=True)
    #: TPMT_PUBLIC, hex; its TPM name (nameAlg || hash), hex.
    ak_public: str
    ak_name: str
    #: The endorsement key (PEM) and its certificate (PEM) as the agent read them, if any.
    ek_public: str | None = None
    ek_certificate: str | None = None
    #: How far the EK certificate was checked (``metald.provision.attestation.check_ek``).
    ek_check: str
    enrolled_at: datetime = _ts()
    enrolled_boot: str | None = None


class AttestationNonce(SQLModel, table=True):
    """A nonce metald issued for one machine's boot: a quote over it is accepted once."""

    __tablename__ = "attestation_nonces"

    nonce: str = Field(primary_key=True)  # hex
    machine_id: str = Field(foreign_key="machines.id", index=True)
    boot: str | None = None
    issued_at: datetime = _ts()
    expires_at: datetime = Field(sa_type=DateTime(timezone=True))
    used_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))


class Attestation(SQLModel, table=True):
    """One attestation a machine's agent submitted, and metald's verdict on it."""

    __tablename__ = "attestations"

    id: str = Field(default_factory=new_id, primary_key=True)
    machine_id: str = Field(foreign_key="machines.id")
    at: datetime = _ts()
    boot: str | None = None
    machine_state: str
    #: learned, passed, failed (verdicts), refused (the submission proved nothing).
    status: str
    #: For refused: the reason code (bad-signature, stale-nonce, forged-event-log, ...).
    reason: str | None = None
    summary: str
    #: ``Verdict.as_dict()``: the PCRs, the changes with their events.
    verdict: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    #: What the boot measured (``Golden.as_dict()``): the golden values if accepted.
    measured: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    accepted_by: str | None = None
    accepted_reason: str | None = None
    accepted_at: datetime | None = Field(default=None, sa_type=DateTime(timezone=True))

    __table_args__ = (Index("ix_attestations_machine_id", "machine_id", "at"),)


class AttestationGolden(SQLModel, table=True):
    """Golden boot measurements: per machine (``machine:<id>``, learned on first use or
    accepted by a technician) or per SKU (``sku:<product>``, given by an operator)."""

    __tablename__ = "attestation_golden"

    subject: str = Field(primary_key=True)
    golden: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    #: first-use, accepted, operator.
    source: str
    set_by: str
    reason: str | None = None
    set_at: datetime = _ts()
    attestation_id: str | None = None
