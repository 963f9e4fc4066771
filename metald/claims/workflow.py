"""Claim, release, retry and wipe, each with its after-commit effects, over typed dependencies.

Every flow runs its transaction in the store's worker, then, once committed: wakes the live
event streams, takes released machines off their tenant's running hub (before they reboot),
and network-boots the machines whose operation starts with a boot (in the background, through
their BMC). The API authorises and validates, then calls one method here; how the result is
shown is the caller's ``render``, run inside the same transaction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from sqlmodel import Session

from metald.claims import allocation, records, release
from metald.claims.placement import Placement
from metald.claims.tenant_os import OsRequest, TenantOs
from metald.errors import Unprocessable
from metald.lifecycle import NETWORK_BOOT
from metald.provision import commissioning
from metald.provision.intents import DeployImage
from metald.store.db import Store
from metald.store.models import Claim, Machine

log = logging.getLogger("metald.claims")
R = TypeVar("R")


class HubSync(Protocol):
    """The tenant runtime (``metald.tenants.runtime``): brings the running hubs in line with
    the store now rather than at its next interval."""

    async def sync(self) -> object: ...


class MeshRelease(Protocol):
    """The tenant mesh (``metald.tenants.mesh``): tells the tenant's other nodes that machines
    left, and waits (bounded) until they have dropped them as peers."""

    async def released(self, tenant_id: str, machine_ids: list[str], actor: str) -> object: ...


class ReleaseCleanup(Protocol):
    """Puts released machines' BMCs back before their wipe (``metald.firmware.release``):
    BIOS profile, BMC accounts, firmware checked. Returns the machines held, not wiped."""

    async def after_release(
        self, machine_ids: list[str], claim_id: str | None, actor: str
    ) -> list[str]: ...


class BootControl(Protocol):
    """The provisioning runner (``metald.provision.netboot.Provisioner``) as the flows use it: database
    steps run inside the flow's transaction, the BMC steps in the background."""

    def start_provisioning(
        self, session: Session, machine_ids: list[str], *, actor: str, instance: str | None = None
    ) -> list[str]: ...

    def retry(
        self,
        session: Session,
        machine_id: str,
        *,
        actor: str,
        deploy: DeployImage,
        reason: str | None = None,
        version: int | None = None,
        instance: str | None = None,
    ) -> Machine: ...

    async def reboot_all(
        self,
        store: Store,
        bmc: Any,
        machine_ids: list[str],
        *,
        actor: str,
        instance: str | None = None,
    ) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


#: Loads a machine or claim the caller may act on (or raises NotFound) inside the transaction.
LoadMachine = Callable[[Session, str], Machine]
LoadClaim = Callable[[Session, str], Claim]


@dataclass(frozen=True)
class ClaimRequest:
    tenant_id: str
    count: int
    selector: allocation.Selector
    image_id: str
    idempotency_key: str | None
    ssh_authorized_keys: list[str]
    #: User-data, meta-data, network and storage of the deployed OS (docs/tenant-os.md).
    os: OsRequest = field(default_factory=OsRequest)
    placement: Placement | None = None


@dataclass
class ClaimWorkflow:
    store: Store
    instance: str
    #: The deploy kernel and initrd every install and wipe boots.
    deploy: DeployImage
    boot: BootControl
    #: The BMC service the runner boots machines through; None: machines boot when someone
    #: powers them (``provision.use_bmc = false``, or no BMC service).
    bmc: Any
    #: The running tenant hubs; None when this daemon runs none.
    hubs: HubSync | None
    #: Wakes the live event streams after a commit.
    notify: Callable[[], None]
    #: enroll.require_bmc: claim only machines vouched for by a BMC link or a technician.
    require_bmc: bool | None = None
    #: The tenant mesh, told of released machines before they are wiped.
    mesh: MeshRelease | None = None
    #: Restores BIOS settings and BMC accounts and checks firmware before the wipe.
    cleanup: ReleaseCleanup | None = None
    #: [provision] settings of the tenant's OS: cloud-config schema, size limit, address pools.
    tenant_os: TenantOs = field(default_factory=TenantOs)

    def network_boot(self, machine_ids: list[str], actor: str) -> None:
        """Boot machines a step outside this workflow moved into a network-booting state."""
        self._boot_from_network(machine_ids, actor)

    def _boot_from_network(self, machine_ids: list[str], actor: str) -> None:
        """In the background: one-time PXE and a power cycle through each machine's BMC."""
        self.boot.spawn(
            self.boot.reboot_all(
                self.store, self.bmc, machine_ids, actor=actor, instance=self.instance
            )
        )

    async def claim(
        self, request: ClaimRequest, *, actor: str, render: Callable[[Session, Claim, bool], R]
    ) -> R:
        """Allocate the machines (``allocation.create_claim``) and start provisioning them; a
        replayed request starts nothing. ``render(session, claim, replayed)``."""
        b = request

        def run(s: Session) -> tuple[R, list[str]]:
            c, replayed = allocation.create_claim(
                s,
                b.tenant_id,
                b.count,
                b.selector,
                b.image_id,
                b.idempotency_key,
                actor,
                deploy=self.deploy,
                ssh_authorized_keys=b.ssh_authorized_keys,
                instance=self.instance,
                require_bmc=self.require_bmc,
                os=replace(b.os, settings=self.tenant_os),
                placement=b.placement,
            )
            started: list[str] = []
            if not replayed:
                ids = [m.id for m in records.claim_machines(s, c.id)]
                started = self.boot.start_provisioning(s, ids, actor=actor, instance=self.instance)
            return render(s, c, replayed), started

        out, started = await self.store.run(run)
        self.notify()
        self._boot_from_network(started, actor)
        return out

    async def release(
        self,
        claim_id: str,
        *,
        actor: str,
        load: LoadClaim,
        render: Callable[[Session, Claim], R],
        machine_id: str | None = None,
    ) -> R:
        """End the claim (or, with ``machine_id``, release that one machine of it); then take
        the released machines off the tenant's running hub and boot them into the wipe."""

        def run(s: Session) -> tuple[R, list[str], str]:
            c = load(s, claim_id)
            if machine_id is None:
                wiping = release.release_claim(
                    s, c, actor, deploy=self.deploy, instance=self.instance
                )
            else:
                wiping = release.release_machine(
                    s, c, machine_id, actor, deploy=self.deploy, instance=self.instance
                )
            return render(s, load(s, c.id)), wiping, c.tenant_id

        out, wiping, tenant_id = await self.store.run(run)
        self.notify()
        if wiping and self.hubs is not None:
            # Off the tenant's hub and out of its cluster before the machine reboots to be wiped.
            try:
                await self.hubs.sync()
            except Exception:  # the runtime's loop tries again; the store already says released
                log.exception("tenant runtime sync after releasing claim %s failed", claim_id)
        if wiping and self.mesh is not None:
            # Off every other node's mesh before the wipe: acknowledged, or timed out (bounded,
            # so a hung node cannot hold releases; the event names who did not answer).
            try:
                await self.mesh.released(tenant_id, wiping, actor)
            except Exception:
                log.exception("mesh update after releasing claim %s failed", claim_id)
        if wiping and self.cleanup is not None:
            # In the background, machine by machine through its BMC: then the wipe boots.
            self.boot.spawn(self._clean_then_wipe(wiping, claim_id, actor))
        else:
            self._boot_from_network(wiping, actor)
        return out

    async def _clean_then_wipe(self, machine_ids: list[str], claim_id: str, actor: str) -> None:
        assert self.cleanup is not None
        held: list[str] = []
        try:
            held = await self.cleanup.after_release(machine_ids, claim_id, actor)
        except Exception:  # the wipe still runs: a clean-up that broke must not keep data
            log.exception("release clean-up of claim %s failed", claim_id)
        self.notify()
        wipe = [m for m in machine_ids if m not in held]
        if wipe:
            await self.boot.reboot_all(
                self.store, self.bmc, wipe, actor=actor, instance=self.instance
            )

    async def _on_machine(
        self,
        machine_id: str,
        step: Callable[[Session, Machine], Machine],
        *,
        actor: str,
        load: LoadMachine,
        render: Callable[[Session, Machine], R],
        boot: frozenset[str],
    ) -> R:
        """One technician step on one machine in one transaction; then wake the event
        streams, and network-boot the machine if the step left it in one of ``boot``."""

        def run(s: Session) -> tuple[R, str]:
            m = step(s, load(s, machine_id))
            return render(s, m), m.state

        out, state = await self.store.run(run)
        self.notify()
        if state in boot:
            self._boot_from_network([machine_id], actor)
        return out

    async def retry(
        self,
        machine_id: str,
        *,
        actor: str,
        load: LoadMachine,
        render: Callable[[Session, Machine], R],
        reason: str | None = None,
        version: int | None = None,
    ) -> R:
        """Start a failed operation again (``lifecycle.RETRY``); one that starts with a network
        boot is power-cycled into PXE through the BMC."""

        def step(s: Session, m: Machine) -> Machine:
            return self.boot.retry(
                s,
                m.id,
                actor=actor,
                deploy=self.deploy,
                reason=reason,
                version=version,
                instance=self.instance,
            )

        return await self._on_machine(
            machine_id, step, actor=actor, load=load, render=render, boot=NETWORK_BOOT
        )

    async def commission(
        self,
        machine_id: str,
        *,
        actor: str,
        load: LoadMachine,
        render: Callable[[Session, Machine], R],
        profile_of: Callable[[Machine], Any],
        reason: str | None = None,
    ) -> R:
        """A technician's commissioning (``provision.commissioning.request_run``): inspected
        again, booted through the BMC; the run starts with the fresh inventory."""

        def step(s: Session, m: Machine) -> Machine:
            commissioning.request_run(
                s, m.id, profile=profile_of(m), actor=actor, reason=reason, instance=self.instance
            )
            return load(s, m.id)

        return await self._on_machine(
            machine_id, step, actor=actor, load=load, render=render, boot=NETWORK_BOOT
        )

    async def verify_repair(
        self,
        machine_id: str,
        *,
        actor: str,
        load: LoadMachine,
        render: Callable[[Session, Machine], R],
        profile_of: Callable[[Machine], Any],
        mark: Callable[[Session, Machine], object],
        reason: str,
    ) -> R:
        """A repaired machine back through commissioning, booted through the BMC: wiped first
        when a tenant's data is still on its disks (the wipe's end requests the run:
        ``provision.commissioning.after_wipe``), else inspected again with a run requested.
        ``mark`` records the repair's side in the same transaction."""

        def step(s: Session, m: Machine) -> Machine:
            profile = profile_of(m)
            if profile is None:
                raise Unprocessable(
                    f"no enroll rule gives machine {m.id} a commissioning profile, so nothing "
                    "could verify the repair; add a [enroll.rules.commissioning] profile whose "
                    "rule matches it, then mark it repaired again"
                )
            mark(s, m)
            if m.wipe_required:
                return release.start_wipe(
                    s, m, actor, deploy=self.deploy, reason=reason, instance=self.instance
                )
            commissioning.request_run(
                s, m.id, profile=profile, actor=actor, reason=reason, instance=self.instance
            )
            return load(s, m.id)

        return await self._on_machine(
            machine_id, step, actor=actor, load=load, render=render, boot=NETWORK_BOOT
        )

    async def wipe(
        self,
        machine_id: str,
        *,
        actor: str,
        load: LoadMachine,
        render: Callable[[Session, Machine], R],
        reason: str | None = None,
        version: int | None = None,
    ) -> R:
        """A technician's wipe (``release.start_wipe``), booted through the BMC."""

        def step(s: Session, m: Machine) -> Machine:
            return release.start_wipe(
                s,
                m,
                actor,
                deploy=self.deploy,
                reason=reason,
                version=version,
                instance=self.instance,
            )

        return await self._on_machine(
            machine_id, step, actor=actor, load=load, render=render, boot=NETWORK_BOOT
        )

    async def confirm_wipe(
        self,
        machine_id: str,
        *,
        actor: str,
        load: LoadMachine,
        render: Callable[[Session, Machine], R],
        reason: str,
        version: int | None = None,
    ) -> R:
        """A technician vouches for a wipe done by hand (``release.confirm_wipe``)."""

        def step(s: Session, m: Machine) -> Machine:
            return release.confirm_wipe(
                s, m, actor, reason=reason, version=version, instance=self.instance
            )

        return await self._on_machine(
            machine_id, step, actor=actor, load=load, render=render, boot=frozenset()
        )
