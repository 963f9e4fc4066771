"""The daemon: one asyncio loop hosting the API and every configured service."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from aiohttp import web

from api.app import create_app, server_settings
from api.context import AppContext
from metald import __version__
from metald.auth import bootstrap_admin
from metald.config import Config, split_hostport
from metald.events import EventBus
from metald.secrets import SecretBox
from metald.service import Service
from metald.store import Store

log = logging.getLogger("metald")


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.store = Store(cfg.store_url, workers=cfg.store.workers)
        self.secrets = SecretBox.from_file(cfg.secrets_key_path)
        self.bus = EventBus()
        self.ctx = AppContext(cfg=cfg, store=self.store, secrets=self.secrets, bus=self.bus)
        self.services: list[Service] = []
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()

    def _build_services(self) -> list[web.RouteDef]:
        """Instantiate optional subsystems that exist in this build; return extra HTTP routes."""
        routes: list[web.RouteDef] = []
        for factory in _SERVICE_FACTORIES:
            svc, extra = factory(self)
            if svc is not None:
                self.services.append(svc)
                self.ctx.services[svc.name] = svc
            routes.extend(extra)
        return routes

    async def start(self) -> None:
        os.makedirs(self.cfg.state_dir, exist_ok=True)
        await asyncio.get_running_loop().run_in_executor(None, self.store.migrate)
        created = await self.store.run(bootstrap_admin, self.cfg.admin_token_path)
        if created:
            log.warning("first start: an admin token was written to %s (mode 0600)", created)
        extra = self._build_services()
        app = create_app(self.ctx, extra=extra)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, **server_settings()
        )
        await self._runner.setup()
        host, port = split_hostport(self.cfg.api.listen)
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        for svc in self.services:
            await svc.start()
            log.info("service %s started", svc.name)
        log.info(
            "metald %s (%s) listening on %s, store %s",
            __version__,
            self.cfg.instance,
            self.cfg.api.listen,
            "sqlite" if self.store.is_sqlite else "postgresql",
        )

    async def stop(self) -> None:
        for svc in reversed(self.services):
            try:
                await svc.stop()
            except Exception:
                log.exception("stopping %s failed", svc.name)
        if self._runner is not None:
            await self._runner.cleanup()
        self.store.close()
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


def _boot_plane(d: Daemon) -> tuple[Any, list[web.RouteDef]]:
    """DHCP, TFTP and RA as a service; HTTP boot as routes on the API's port."""
    if not d.cfg.boot.enabled:
        return None, []
    from pathlib import Path

    from metald.boot.http import boot_routes
    from metald.boot.plane import BootPlane, http_base_url
    from metald.enrollment import EnrollmentBootHooks

    leased_only = d.cfg.boot.scripts_leased_only
    if not leased_only:
        log.warning(
            "boot.script_clients is 'any': a machine's iPXE script, agent token included, "
            "goes to whoever asks for its MAC on the provisioning network"
        )
    hooks = EnrollmentBootHooks(
        d.store, d.cfg.instance, d.cfg.enroll, leased_clients_only=leased_only
    )
    plane = BootPlane(d.cfg, d.store, hooks)
    routes = boot_routes(
        hooks, Path(d.cfg.boot.assets_dir or d.cfg.state_dir), http_base_url(d.cfg)
    )
    return plane, routes


def _bmc(d: Daemon) -> tuple[Any, list[web.RouteDef]]:
    try:
        from metald.bmc.service import BmcService
    except ImportError:
        return None, []
    return BmcService(d.store, d.secrets, d.cfg.bmc, d.cfg.instance), []


def _provision_watchdog(d: Daemon) -> tuple[Any, list[web.RouteDef]]:
    """Times out stuck machines and resumes claims interrupted by a restart."""
    from metald.provision.watchdog import Watchdog

    return Watchdog(d.store, d.cfg.provision, d.cfg.instance, services=d.ctx.services), []


def _tenant_hubs(d: Daemon) -> tuple[Any, list[web.RouteDef]]:
    """Tenants' WireGuard hubs and Slurm control planes on this host ([tenants] hubs)."""
    if not d.cfg.tenants.hubs:
        return None, []
    from metald.tenants.runtime import TenantRuntime

    return TenantRuntime(d.store, d.secrets, d.cfg.tenants, d.cfg.state_dir, d.cfg.instance), []


def _tenant_node_guard(d: Daemon) -> tuple[Any, list[web.RouteDef]]:
    """Requests from tenants' machines reach only the join, agent and boot endpoints."""
    if not d.cfg.api.guard_tenant_nodes:
        return None, []
    from metald.nodeguard import TenantNodeGuard

    return TenantNodeGuard(d.store), []


def _token_sweeper(d: Daemon) -> tuple[Any, list[web.RouteDef]]:
    """Deletes tokens revoked or expired more than a day ago, hourly."""
    from metald.token_sweep import TokenSweeper

    return TokenSweeper(d.store, d.cfg.instance), []


_SERVICE_FACTORIES = [
    _tenant_node_guard,
    _boot_plane,
    _bmc,
    _provision_watchdog,
    _tenant_hubs,
    _token_sweeper,
]
