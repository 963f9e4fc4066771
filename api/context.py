"""What API handlers share: config, store, secrets, the event bus and the daemon's services."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from metald.config import Config
from metald.events import EventBus
from metald.health.config import IntakeConfig
from metald.healthwatch import intake
from metald.healthwatch.intake import Intake
from metald.limits import Limiter
from metald.provision.commissioning import SelReads
from metald.provision.netboot import Provisioner
from metald.secrets import SecretBox
from metald.service import Service
from metald.store import Store
from metald.tenants.mesh import MeshWatch
from metald.usecases.firmware import FirmwareUpdater, RolloutDriver

if TYPE_CHECKING:
    from metald.bmc.console import ConsoleService
    from metald.boot.plane import BootPlane
    from metald.fleet.membership import Membership
    from metald.healthwatch.watch import HealthWatch
    from metald.nodeguard import TenantNodeGuard
    from metald.provision.watchdog import Watchdog
    from metald.tenants.runtime import TenantRuntime
    from metald.token_sweep import TokenSweeper


class BmcApi(Protocol):
    """The BMC service as the API and the workflows below it see it (``metald.bmc.service``'s
    ``BmcService``: the API never imports it, which would reach the BMC drivers). Routes that
    need more take it as ``Any`` (``metald.usecases.bmcs.Bmcs``)."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def link_by_identity(
        self, machine_id: str, actor: str = ...
    ) -> dict[str, Any] | None: ...

    async def event_log(self, machine_id: str) -> list[dict[str, Any]]: ...

    async def owner_url(
        self, *, machine_id: str | None = None, bmc_id: str | None = None
    ) -> str | None: ...

    def after_inspection(self, machine_id: str) -> None: ...

    def after_report(self, machine_id: str) -> None: ...


@dataclass(frozen=True)
class Services:
    """The services one daemon hosts, built once in ``Daemon.__init__`` and handed to the API
    by constructor. ``None``: not hosted by this instance (its routes answer 503). The order
    of the fields is the order the daemon starts them in (and stops them in reverse)."""

    #: The fleet membership (always, in a daemon; started before the others).
    fleet: Membership | None = None
    #: Requests from tenants' machines reach only join, agent and boot ([api] guard_tenant_nodes).
    tenant_node_guard: TenantNodeGuard | None = None
    #: DHCP, TFTP and RA ([boot] enabled).
    boot: BootPlane | None = None
    #: BMC control (always, in a daemon).
    bmc: BmcApi | None = None
    #: Serial consoles through the BMCs (always, in a daemon).
    console: ConsoleService | None = None
    #: The background provisioning steps API calls start (always: an app run without the
    #: daemon, under test, gets its own).
    provision: Provisioner = field(default_factory=Provisioner)
    #: Times out stuck machines and resumes cut-off steps.
    watchdog: Watchdog | None = None
    #: Tenants' WireGuard hubs and Slurm control planes ([tenants] hubs).
    tenant_hubs: TenantRuntime | None = None
    #: Deletes long-dead tokens.
    token_sweeper: TokenSweeper | None = None
    #: Watches machines in use and remediates them ([health]; docs/health.md).
    health_watch: HealthWatch | None = None
    #: Firmware updates through the BMCs (always, in a daemon; ``metald.firmware.service``).
    firmware: FirmwareUpdater | None = None
    #: Firmware rollouts in waves across the fleet (always, in a daemon;
    #: ``metald.firmware.rollouts``).
    firmware_rollouts: RolloutDriver | None = None
    #: Commissioning's background BMC event-log reads (owned, stopped with the daemon).
    sel_reads: SelReads = field(default_factory=SelReads)
    #: The tenant meshes' long-poll wake-ups (no task: nothing to start or stop).
    mesh_watch: MeshWatch = field(default_factory=MeshWatch)

    def hosted(self) -> Iterator[Service]:
        """The services present that the daemon starts after its listeners, in start order
        (the fleet is not one of them: the daemon starts it first, before it serves)."""
        for f in fields(self):
            svc = getattr(self, f.name)
            if svc is not None and f.name not in ("fleet", "mesh_watch"):
                yield svc

    def health(self) -> dict[str, str]:
        """Each service present, by name, and how it is (``/healthz``)."""
        out: dict[str, str] = {}
        for svc in (self.fleet, *self.hosted()):
            if svc is None or isinstance(svc, SelReads):
                continue
            health = getattr(svc, "health", None)
            out[svc.name] = health() if callable(health) else "running"
        return out


@dataclass
class AppContext:
    cfg: Config
    store: Store
    secrets: SecretBox
    bus: EventBus
    #: The services the daemon hosts; absent ones (None) answer 503.
    services: Services = field(default_factory=Services)
    #: ``sha256:<hex>`` of the CA the machines' listener's certificate chains to (what agents
    #: and nodes pin; ``metald.boot.pki``), or empty when machines reach metald over HTTP.
    machines_ca: str = ""
    #: Caps on held mesh long-polls (``[api] mesh_polls_*``; ``metald.limits``).
    mesh_polls: Limiter = field(init=False)
    _intakes: dict[str, tuple[IntakeConfig, Intake]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.mesh_polls = Limiter(
            "mesh long-polls",
            total=self.cfg.api.mesh_polls_max,
            per={"token": self.cfg.api.mesh_polls_per_token},
            retry_after_s=5,
            advice="poll again after Retry-After",
        )

    def intake(self, route: str) -> Intake:
        """The token buckets in front of a route machines push to on their own
        (``bmc-events`` or ``health-reports``; ``metald.healthwatch.intake``), built anew when
        ``[health.intake]`` is another object (a configuration replaced)."""
        cfg = self.cfg.health.intake
        got = self._intakes.get(route)
        if got is None or got[0] is not cfg:
            make = intake.for_events if route == "bmc-events" else intake.for_reports
            got = (cfg, make(cfg))
            self._intakes[route] = got
        return got[1]

    @property
    def instance(self) -> str:
        return self.cfg.instance
