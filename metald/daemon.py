"""The daemon: one asyncio loop hosting the API and every configured service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from api.app import create_app, server_settings
from api.context import AppContext, Services
from metald import __version__
from metald.auth import bootstrap_admin
from metald.boot.http import asset_routes, require_https_middleware
from metald.boot.pki import PRIVATE_FILES, PkiError, resolve_tls_auto
from metald.boot.pki import machines_tls as load_machines_tls
from metald.boot.plane import https_required
from metald.config import Config, ConfigError, check_assets_root, split_hostport
from metald.events import EventBus
from metald.fleet.membership import Membership
from metald.fleet.startup import hold_sqlite_lock, verify_secrets_key
from metald.nodeguard import path_allowed
from metald.problem import problem
from metald.secrets import SecretBox
from metald.service import Service, TaskScope
from metald.store import Store

if TYPE_CHECKING:
    from metald.bmc.service import BmcService
    from metald.boot.ipxe import SignedAssets
    from metald.boot.plane import BootPlane
    from metald.boot.signing import AssetSigner
    from metald.firmware.service import FirmwareUpdates
    from metald.healthwatch.watch import HealthWatch
    from metald.nodeguard import TenantNodeGuard
    from metald.tenants.runtime import TenantRuntime

log = logging.getLogger("metald")


#: Files of the state folder that must be readable by metald's user only.
STATE_FILES = (
    "metald.db",
    "metald.db-wal",
    "metald.db-shm",
    "metald.db.instance-lock",
    "secrets.key",
    "admin.token",
    *PRIVATE_FILES,
)


def secure_state_dir(state_dir: str | os.PathLike[str]) -> list[str]:
    """Create the state folder 0700, or narrow an existing one and its known files to the
    owner (databases from before this check were 0644 in a 0755 folder). Returns what was
    changed, for the log."""
    path = Path(state_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fixed = []
    for p, mode in [(path, 0o700)] + [(path / n, 0o600) for n in STATE_FILES]:
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_IMODE(st.st_mode) & 0o077:
            continue
        os.chmod(p, stat.S_IMODE(st.st_mode) & mode)
        fixed.append(f"{p} {stat.S_IMODE(st.st_mode):o} -> {stat.S_IMODE(st.st_mode) & mode:o}")
    return fixed


def private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists: SQLite gives its -wal and -shm
    files the database file's mode, so this keeps all three private whatever the umask."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def only_paths(allowed: Callable[[str], bool], listener: str) -> Any:
    """Middleware: answer 404 problem+json for every path ``allowed`` refuses, before routing,
    authentication or any other middleware runs."""

    @web.middleware
    async def mw(request: web.Request, handler: Handler) -> web.StreamResponse:
        if allowed(request.path):
            return await handler(request)
        return problem(
            404,
            "Not found",
            f"there is no resource at {request.path} on the {listener} listener",
            instance=request.path,
        )

    return mw


def server_tls(cert: str, key: str) -> ssl.SSLContext | None:
    """A TLS 1.2+ server context for ``cert`` and ``key``, or None when not given."""
    if not cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def staff_tls(cfg: Config) -> ssl.SSLContext | None:
    return server_tls(cfg.api.tls_cert, cfg.api.tls_key)


class Daemon:
    def __init__(self, cfg: Config) -> None:
        check_assets_root(cfg)  # a Config built in code skips load_config's check
        cfg, tls_off = resolve_tls_auto(cfg)
        if tls_off:
            log.warning("boot: %s", tls_off)
        self.cfg = cfg
        for change in secure_state_dir(cfg.state_dir):
            log.warning("state folder was readable by others; narrowed %s", change)
        db = cfg.store_url.removeprefix("sqlite:///").split("?")[0]
        if cfg.store_url.startswith("sqlite:///") and db not in ("", ":memory:"):
            private_file(Path(db))
        self.store = Store(cfg.store_url, workers=cfg.store.workers)
        self.secrets = SecretBox.from_file(cfg.secrets_key_path)
        try:
            #: The machines' listener's certificate and the CA agents pin (None: plain HTTP).
            self.machines_tls = load_machines_tls(cfg)
        except (PkiError, OSError, ValueError) as e:
            raise ConfigError(f"boot TLS: {e}") from None
        #: Token paths refused over plain HTTP (boot.require_https, resolved).
        self.require_https = https_required(cfg, self.machines_tls is not None)
        #: Kernel and initrd over the plain-HTTP asset listener, signed (boot.assets_http_listen).
        self.signed_assets, self.asset_signer = _signed_assets(cfg)
        self.bus = EventBus()
        #: Every service's task group runs inside this one (``TaskScope.child``).
        self.tasks = TaskScope("metald")
        self.fleet = Membership(
            self.store,
            cfg.instance,
            heartbeat_s=cfg.fleet.heartbeat_s,
            dead_after_s=cfg.fleet.dead_after_s,
            loop_stall_s=cfg.fleet.loop_stall_s,
            api_url=cfg.api.public_url or f"http://{cfg.api.listen}",
            serves=_serves(cfg),
            tasks=self.tasks.child("fleet"),
        )
        self.services, self._routes = _build_services(self)
        self.ctx = AppContext(
            cfg=cfg,
            store=self.store,
            secrets=self.secrets,
            bus=self.bus,
            services=self.services,
            machines_ca=self.machines_tls.fingerprint if self.machines_tls else "",
        )
        hubs = getattr(self.services, "tenant_hubs", None)
        if hubs is not None and hasattr(hubs, "elastic_handler"):
            from api.workflows import elastic_handler, elastic_retry

            hubs.elastic_handler = elastic_handler(self.ctx)
            hubs.elastic_retry = elastic_retry(self.ctx)
        self._started: list[Service] = []
        self._store_lock: Any = None
        self._runners: list[web.AppRunner] = []
        self._stopping = asyncio.Event()

    async def _serve(self, app: web.Application, listen: str, tls: ssl.SSLContext | None) -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=False, **server_settings())
        await runner.setup()
        self._runners.append(runner)
        host, port = split_hostport(listen)
        await web.TCPSite(runner, host, port, reuse_address=True, ssl_context=tls).start()

    async def start(self) -> None:
        await self.tasks.open()
        self._store_lock = hold_sqlite_lock(self.cfg.store_url)
        self.fleet.sole_user = self._store_lock is not None
        await asyncio.get_running_loop().run_in_executor(None, self.store.migrate)
        if await self.store.run(verify_secrets_key, self.secrets, self.cfg.secrets_key_path):
            log.info("secrets key check value written: other instances must use the same key")
        # Membership first: a name held by a live instance stops this one before it serves.
        await self.fleet.start()
        created = await self.store.run(bootstrap_admin, self.cfg.admin_token_path)
        if created:
            log.warning("first start: an admin token was written to %s (mode 0600)", created)
        extra = self._routes
        staff = create_app(self.ctx, extra=extra)
        if self.require_https:
            staff.middlewares.insert(0, require_https_middleware())
        machines_listen = self.cfg.boot.http_listen
        if machines_listen:
            # Two listeners: the provisioning network reaches boot, agent and join only; the
            # staff API (management network) serves none of them.
            staff.middlewares.insert(0, only_paths(lambda p: not path_allowed(p), "staff API"))
            machines = create_app(self.ctx, extra=extra)
            if self.require_https:
                machines.middlewares.insert(0, require_https_middleware())
            machines.middlewares.insert(0, only_paths(path_allowed, "provisioning"))
            tls = self.machines_tls
            await self._serve(
                machines, machines_listen, server_tls(str(tls.cert), str(tls.key)) if tls else None
            )
        elif self.cfg.boot.enabled:
            log.warning(
                "boot.http_listen is empty: the staff API and the boot, agent and join endpoints "
                "share api.listen (%s), so the provisioning network (tenant nodes included) "
                "reaches the staff API's port; set boot.http_listen on the provisioning network "
                "and api.listen on the management network",
                self.cfg.api.listen,
            )
        if self.signed_assets is not None:
            plain = web.Application(middlewares=[], client_max_size=1024)
            plain.add_routes(asset_routes(Path(self.cfg.boot.assets_dir)))
            await self._serve(plain, self.cfg.boot.assets_http_listen, None)
        await self._serve(staff, self.cfg.api.listen, staff_tls(self.cfg))
        for svc in self.services.hosted():
            self._started.append(svc)  # stopped at stop even if its start fails half-way
            await svc.start()
            log.info("service %s started", svc.name)
        log.info(
            "metald %s (%s) listening on %s%s%s, store %s",
            __version__,
            self.cfg.instance,
            self.cfg.api.listen,
            " (TLS)" if self.cfg.api.tls_cert else "",
            f", machines on {machines_listen}{' (TLS)' if self.machines_tls else ''}"
            if machines_listen
            else "",
            "sqlite" if self.store.is_sqlite else "postgresql",
        )

    async def stop(self) -> None:
        for svc in reversed(self._started):
            try:
                await svc.stop()
            except Exception:
                log.exception("stopping %s failed", svc.name)
        self._started.clear()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        await self.fleet.stop()
        await self.tasks.close()  # whatever a service left running ends here
        self.store.close()
        if self._store_lock is not None:
            self._store_lock.close()
        log.info("metald stopped")

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s received: stopping", sig.name)
        self._stopping.set()

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.start()
        try:
            await self._stopping.wait()
        finally:
            await self.stop()


def _serves(cfg: Config) -> dict[str, Any]:
    """What this instance serves, as the instances list shows it and ownership uses it."""
    from metald.boot.plane import http_base_url

    return {
        "provisioning_networks": [str(n.subnet) for n in cfg.boot.networks]
        if cfg.boot.enabled
        else [],
        # where the agents this instance boots reach it; the others' go on the scripts it
        # serves (metald.urls=), so an agent outlives the instance that booted it
        "boot_url": http_base_url(cfg) if cfg.boot.enabled else None,
        "bmc_networks": [str(n) for n in cfg.bmc.networks],
        "hubs": cfg.tenants.hubs,
    }


def _build_services(d: Daemon) -> tuple[Services, list[web.RouteDef]]:
    """Every service this instance hosts, wired by constructor, and the HTTP routes some of
    them add to the API (boot)."""
    boot, routes = _boot_plane(d)
    bmc = _bmc(d)
    from metald.bmc.console import ConsoleService
    from metald.bmc.console_links import BmcLinks
    from metald.provision.commissioning import SelReads
    from metald.provision.netboot import Provisioner
    from metald.provision.watchdog import Watchdog
    from metald.tenants.mesh import MeshWatch
    from metald.token_sweep import TokenSweeper

    # Resumes claims and steps cut off by a restart or a dead instance, for the machines
    # this instance owns, and times out stuck machines.
    watchdog = Watchdog(
        d.store,
        d.cfg.provision,
        d.cfg.instance,
        bmc=bmc,
        ownership=d.fleet,
        resume_interval_s=d.cfg.fleet.heartbeat_s,
    )
    d.fleet.on_change(watchdog.wake)
    hubs = _tenant_hubs(d)
    provision = Provisioner()
    firmware, firmware_routes = _firmware(d, bmc)
    routes = [*routes, *firmware_routes]
    from metald.firmware.rollouts import FirmwareRollouts
    from metald.healthwatch.workflow import FirmwareDrain

    # Firmware rollouts in waves: each driven by one instance (a lease in the store), taken
    # over by a survivor. Machines in use are drained (with their tenant's consent) through
    # the health watch's remediations, the Day-2 path.
    rollouts = FirmwareRollouts(
        d.store,
        firmware,
        d.cfg.instance,
        ownership=d.fleet,
        tick_s=d.cfg.firmware.rollout_tick_s,
        lease_s=d.cfg.firmware.rollout_lease_s,
        tasks=d.tasks.child("firmware_rollouts"),
        notify=lambda: d.bus.notify(),
        drain=FirmwareDrain(d.cfg.health),
    )
    firmware.on_end = rollouts.wake
    d.fleet.on_change(rollouts.wake)
    services = Services(
        fleet=d.fleet,
        tenant_node_guard=_tenant_node_guard(d),
        boot=boot,
        bmc=bmc,
        # Serial consoles through the BMCs (IPMI Serial-over-LAN), shared by their viewers.
        console=ConsoleService(
            d.store,
            d.cfg.instance,
            BmcLinks(bmc, d.secrets),
            viewers_per_token=d.cfg.bmc.console_viewers_per_token,
            viewers_per_machine=d.cfg.bmc.console_viewers_per_machine,
            viewers_max=d.cfg.bmc.console_viewers_max,
        ),
        # Owns the provisioning steps API calls start in the background, and stops them.
        provision=provision,
        watchdog=watchdog,
        tenant_hubs=hubs,
        # Deletes tokens revoked or expired more than a day ago, hourly (one instance).
        token_sweeper=TokenSweeper(
            d.store, d.cfg.instance, ownership=d.fleet, tasks=d.tasks.child("token-sweeper")
        ),
        health_watch=_health_watch(d, bmc, hubs, provision, firmware),
        firmware=firmware,
        firmware_rollouts=rollouts,
        sel_reads=SelReads(tasks=d.tasks.child("commissioning_sel")),
        mesh_watch=MeshWatch(),
    )
    return services, routes


def _health_watch(
    d: Daemon, bmc: BmcService, hubs: TenantRuntime | None, provision: Any, firmware: Any = None
) -> HealthWatch:
    """Machines in use watched (BMC logs and sensors by their owner, node silence, the tenant's
    Slurm) and remediated with the tenant's scheduler in the loop (docs/health.md)."""
    from metald.health.scheduler import TenantScheduler
    from metald.healthwatch.watch import HealthWatch
    from metald.healthwatch.workflow import NoScheduler, Remediations
    from metald.provision.intents import DeployImage
    from metald.tenants.scheduler import SlurmScheduler
    from metald.usecases.repairs import RepairQueue

    cfg = d.cfg

    def scheduler_for(tenant_id: str) -> TenantScheduler | None:
        if hubs is None or not cfg.tenants.control_planes:
            return NoScheduler()  # the tenant runs its own scheduler: draining is theirs
        cp = hubs.control_plane(tenant_id)
        return SlurmScheduler(cp.run) if cp is not None else None  # None: not up yet

    def network_boot(ids: list[str], actor: str) -> None:
        if cfg.provision.use_bmc:
            provision.spawn(
                provision.reboot_all(d.store, bmc, ids, actor=actor, instance=cfg.instance)
            )

    def released(ids: list[str], claim_id: str, actor: str) -> None:
        """A machine a firmware drain took out of its claim: the release clean-up (BIOS,
        BMC accounts, firmware: metald.firmware.release), then its wipe, as a release does."""

        async def clean_then_wipe() -> None:
            held: list[str] = []
            if firmware is not None:
                try:
                    held = await firmware.after_release(ids, claim_id, actor)
                except Exception:  # the wipe still runs: a clean-up that broke must not keep data
                    log.exception("release clean-up after a firmware drain failed")
            network_boot([m for m in ids if m not in held], actor)

        provision.spawn(clean_then_wipe())

    actor = f"metald:{cfg.instance}"
    remediations = Remediations(
        store=d.store,
        cfg=cfg.health,
        instance=cfg.instance,
        scheduler_for=scheduler_for,
        # The bad machine goes to the technicians' queue with its faults (docs/repairs.md).
        repair=RepairQueue(instance=cfg.instance, actor=actor),
        deploy=DeployImage(cfg.provision.deploy_kernel, cfg.provision.deploy_initrd),
        boot=provision,
        network_boot=network_boot,
        released=released,
        require_bmc=cfg.enroll.require_bmc,
        hubs=hubs,
        notify=d.bus.notify,
    )
    watch = HealthWatch(
        d.store,
        cfg.health,
        cfg.instance,
        remediations=remediations,
        table=cfg.health.table(),
        bmc=bmc,
        ownership=d.fleet,
        scheduler_for=scheduler_for,
        tasks=d.tasks.child("health"),
    )
    d.fleet.on_change(watch.wake)
    return watch


def _firmware(d: Daemon, bmc: BmcService) -> tuple[FirmwareUpdates, list[web.RouteDef]]:
    """Firmware updates through the BMCs, and the route BMCs pull verified images from (on
    the boot HTTP listener, when this instance serves boot)."""
    from metald.boot.plane import http_base_url
    from metald.firmware.images import FirmwareImages
    from metald.firmware.service import FirmwareUpdates

    fw = d.cfg.firmware
    images = FirmwareImages(
        d.cfg.firmware_images_dir,
        max_bytes=fw.max_image_mb << 20,
        timeout_s=fw.download_timeout_s,
    )
    boot = d.cfg.boot.enabled
    svc = FirmwareUpdates(
        d.store,
        bmc.control,
        images,
        fw,
        d.cfg.instance,
        rules=lambda: d.cfg.enroll.rules,
        boot_url=http_base_url(d.cfg) if boot else None,  # else images are pushed
        tasks=d.tasks.child("firmware"),
        notify=lambda: d.bus.notify(),
    )
    d.fleet.on_change(svc.wake)
    return svc, images.routes() if boot else []


def _signed_assets(cfg: Config) -> tuple[SignedAssets | None, AssetSigner | None]:
    """The plain-HTTP asset listener's URL and the image signer (boot.assets_http_listen),
    or (None, None): not set, boot off, or the machines' listener not on metald's own CA
    (logged: scripts then load kernel and initrd over that listener)."""
    b = cfg.boot
    if not (b.assets_http_listen and b.enabled):
        return None, None
    if not (b.tls_auto and b.http_listen):
        log.warning(
            "boot: boot.assets_http_listen is not used: the provisioning listener does not "
            "speak HTTPS with metald's own CA (boot.tls_auto is off), so there is no "
            "authenticated channel for the images' signatures; kernel and initrd go over "
            "boot.http_listen"
        )
        return None, None
    from metald.boot.ipxe import SignedAssets
    from metald.boot.signing import SIGNER_NAME, AssetSigner, ensure_signer

    try:
        signer = ensure_signer(Path(cfg.state_dir))
    except (PkiError, OSError, ValueError) as e:
        raise ConfigError(f"boot image signing: {e}") from None
    _, port = split_hostport(b.assets_http_listen)
    return SignedAssets(f"http://{b.server_address}:{port}", SIGNER_NAME), AssetSigner(signer)


def _boot_plane(d: Daemon) -> tuple[BootPlane | None, list[web.RouteDef]]:
    """DHCP, TFTP and RA as a service; HTTP boot as routes on the API's port."""
    if not d.cfg.boot.enabled:
        return None, []
    from metald.boot.http import boot_routes
    from metald.boot.plane import BootPlane, http_base_url, unbootable
    from metald.enrollment import enrollment_boot_hooks

    leased_only = d.cfg.boot.scripts_leased_only
    if not leased_only:
        log.warning(
            "boot.script_clients is 'any': a machine's iPXE script, agent token included, "
            "goes to whoever asks for its MAC on the provisioning network"
        )
    hooks = enrollment_boot_hooks(
        d.store,
        d.cfg.instance,
        d.cfg.enroll,
        leased_clients_only=leased_only,
        fleet=d.fleet,  # the other instances' URLs ride on agent scripts (metald.urls=)
    )
    hooks.unbootable = unbootable(d.cfg)  # arm64 with no arm64 iPXE: an event says why
    # The fleet: shares leases and splits DHCP clients with the other instances.
    plane = BootPlane(d.cfg, d.store, hooks, fleet=d.fleet)
    # Never the state folder (check_assets_root): the assets are served without a token.
    tls = d.machines_tls
    routes = boot_routes(
        hooks,
        Path(d.cfg.boot.assets_dir),
        http_base_url(d.cfg),
        require_https=d.require_https,
        ca_pem=tls.ca_pem if tls else None,
        signed=d.signed_assets,
        signer=d.asset_signer,
    )
    from metald.provision.media_boot import MediaBootRoutes, media_bios, media_efi  # virtual media

    efi, no_efi = media_efi(d.cfg.boot.assets_dir, d.cfg.boot.ipxe)
    if no_efi:
        log.warning("boot: virtual-media ISOs boot BIOS machines only: %s", no_efi)
    bios, no_bios = media_bios(d.cfg.boot.assets_dir, d.cfg.boot.ipxe)
    if no_bios:
        log.warning(
            "boot: virtual-media ISOs boot BIOS machines into Debian's iPXE (plain HTTP): %s",
            no_bios,
        )
    routes += MediaBootRoutes(
        hooks,
        http_base_url(d.cfg),
        ca_pem=tls.ca_pem if tls else None,
        require_https=d.require_https,
        efi=efi,
        bios=bios,
        signed=d.signed_assets,
    ).routes()
    return plane, routes


def _bmc(d: Daemon) -> BmcService:
    """BMC control. Always on: its drivers' dependencies are metald's own, so an import that
    fails here is a broken install and stops the start, never a daemon silently without BMCs."""
    from metald.bmc.media import boot_url_problem
    from metald.bmc.service import BmcService
    from metald.boot.plane import http_base_url

    svc = BmcService(
        d.store,
        d.secrets,
        d.cfg.bmc,
        d.cfg.instance,
        ownership=d.fleet,
        # where BMCs fetch the boot ISO; None (virtual-media boots refused, 409) where this
        # instance serves none or its URL would lack an address
        vmedia_base=None if boot_url_problem(d.cfg) else http_base_url(d.cfg),
        tasks=d.tasks.child("bmc"),
    )
    d.fleet.on_change(svc.wake)
    return svc


def _tenant_hubs(d: Daemon) -> TenantRuntime | None:
    """Tenants' WireGuard hubs and Slurm control planes on this host ([tenants] hubs)."""
    if not d.cfg.tenants.hubs:
        return None
    from metald.tenants.runtime import TenantRuntime

    runtime = TenantRuntime(
        d.store,
        d.secrets,
        d.cfg.tenants,
        d.cfg.state_dir,
        d.cfg.instance,
        ownership=d.fleet,
        tasks=d.tasks.child("tenant_hubs"),
    )
    d.fleet.on_change(runtime.wake)
    return runtime


def _tenant_node_guard(d: Daemon) -> TenantNodeGuard | None:
    """Requests from tenants' machines reach only the join, agent and boot endpoints."""
    if not d.cfg.api.guard_tenant_nodes:
        return None
    from metald.nodeguard import TenantNodeGuard

    return TenantNodeGuard(d.store, tasks=d.tasks.child("tenant_node_guard"))
