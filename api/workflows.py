"""The domain workflows the route handlers hand off to, wired from the app's context."""

from __future__ import annotations

from api.context import AppContext
from metald.claims.workflow import ClaimWorkflow
from metald.provision.intents import DeployImage
from metald.provision.netboot import Provisioner
from metald.tenants import mesh
from metald.tenants.runtime import TenantRuntime


class MeshOfContext:
    """The tenant mesh's release hook (``metald.tenants.mesh.after_release``) bound to the
    app's store and services, as the claim workflow's ``MeshRelease``."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx

    async def released(self, tenant_id: str, machine_ids: list[str], actor: str) -> object:
        return await mesh.after_release(
            self.ctx.store,
            self.ctx.services.mesh_watch,
            tenant_id,
            machine_ids,
            actor=actor,
            instance=self.ctx.instance,
        )


def tenant_runtime(ctx: AppContext) -> TenantRuntime | None:
    """The running tenant hubs, when this daemon runs them (``[tenants] hubs``)."""
    runtime = ctx.services.tenant_hubs
    return runtime if isinstance(runtime, TenantRuntime) else None


def provisioner(ctx: AppContext) -> Provisioner:
    """The ``provision`` service, which owns the boots API calls start in the background: the
    daemon's, or (an app run without the daemon, under test) the one its ``Services`` made."""
    return ctx.services.provision


def deploy_image(ctx: AppContext) -> DeployImage:
    return DeployImage(ctx.cfg.provision.deploy_kernel, ctx.cfg.provision.deploy_initrd)


def claim_workflow(ctx: AppContext) -> ClaimWorkflow:
    return ClaimWorkflow(
        store=ctx.store,
        instance=ctx.instance,
        deploy=deploy_image(ctx),
        boot=provisioner(ctx),
        bmc=ctx.services.bmc if ctx.cfg.provision.use_bmc else None,
        hubs=tenant_runtime(ctx),
        notify=ctx.bus.notify,
        require_bmc=ctx.cfg.enroll.require_bmc,
        mesh=MeshOfContext(ctx),
    )
