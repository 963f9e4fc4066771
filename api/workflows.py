"""The domain workflows and use cases the route handlers hand off to, wired from the app's
context (each route names its use case: ``Router.route(..., use_case=...)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from api.context import AppContext
from metald.bmc.media import boot_url_problem
from metald.claims.tenant_os import TenantOs
from metald.claims.workflow import ClaimWorkflow
from metald.provision.intents import DeployImage
from metald.provision.netboot import Provisioner
from metald.tenants import mesh
from metald.tenants.runtime import TenantRuntime
from metald.usecases.agent import Agent
from metald.usecases.attestation import Attestation
from metald.usecases.bmcs import Bmcs
from metald.usecases.claims import Claims
from metald.usecases.commissioning import Commissioning
from metald.usecases.elastic import ElasticPools
from metald.usecases.events import Events
from metald.usecases.firmware import Firmware, Rollouts
from metald.usecases.images import Images
from metald.usecases.instances import Instances
from metald.usecases.join import Join
from metald.usecases.machines import Machines
from metald.usecases.mesh import Mesh
from metald.usecases.repairs import Repairs
from metald.usecases.tenants import Tenants
from metald.usecases.tokens import Tokens
from metald.usecases.topology import Topology

if TYPE_CHECKING:
    from api.routing import ApiRequest


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
        cleanup=ctx.services.firmware if ctx.cfg.provision.use_bmc else None,
        tenant_os=TenantOs.from_config(ctx.cfg.provision),
    )


# ---- use cases (``metald.usecases``), one per resource, built for a request ---------------


def machines(req: ApiRequest) -> Machines:
    ctx = req.ctx
    return Machines(ctx.store, ctx.instance, ctx.bus.notify, workflow=claim_workflow(ctx))


def tenants(req: ApiRequest) -> Tenants:
    ctx = req.ctx
    return Tenants(
        ctx.store,
        ctx.secrets,
        ctx.instance,
        vlan_range=ctx.cfg.tenants.vlan_range,
        hub_addresses=ctx.cfg.tenants.hub_addresses,
        hubs=tenant_runtime(ctx),
    )


def tokens(req: ApiRequest) -> Tokens:
    return Tokens(req.ctx.store, req.ctx.instance, req.ctx.bus.notify)


def images(req: ApiRequest) -> Images:
    return Images(req.ctx.store, req.ctx.instance)


def join(req: ApiRequest) -> Join:
    ctx = req.ctx
    return Join(
        ctx.store,
        ctx.secrets,
        ctx.instance,
        ctx.bus.notify,
        mesh=ctx.services.mesh_watch,
        hubs=ctx.services.tenant_hubs,
    )


def commissioning(req: ApiRequest) -> Commissioning:
    ctx = req.ctx
    bmc = ctx.services.bmc
    return Commissioning(
        ctx.store,
        req,  # the agent's results: its token's first use is stamped in the same commit
        ctx.instance,
        ctx.bus.notify,
        rules=ctx.cfg.enroll.rules,
        sel_reader=None if bmc is None else bmc.event_log,
        sel_timeout_s=ctx.cfg.bmc.sensors_timeout_s * (ctx.cfg.bmc.retries + 2),
        sel_reads=ctx.services.sel_reads,
        workflow=claim_workflow(ctx),
    )


def claims(req: ApiRequest) -> Claims:
    return Claims(req.ctx.store, claim_workflow(req.ctx))


def elastic(req: ApiRequest) -> ElasticPools:
    rt = tenant_runtime(req.ctx)
    return ElasticPools(
        req.ctx.store, claim_workflow(req.ctx), changed=rt.elastic_changed if rt else None
    )


def elastic_handler(ctx: AppContext) -> Any:
    """What the tenant runtime calls with a control plane's spool request (docs/elastic.md)."""

    async def handle(tenant_id: str, op: str, names: list[str]) -> dict[str, str]:
        pools = ElasticPools(ctx.store, claim_workflow(ctx))
        actor = f"slurmctld:{tenant_id}"
        if op == "resume":
            return await pools.resume(tenant_id, names, actor=actor)
        if op == "suspend":
            await pools.suspend(tenant_id, names, actor=actor)
        # resume-fail: slurmctld already set the nodes down; their claims stay until the
        # pool's suspend releases them (or an operator releases them).
        return {}

    return handle


def elastic_retry(ctx: AppContext) -> Any:
    """What the tenant runtime calls with the pool nodes set down for want of a machine."""

    async def retry(tenant_id: str, stuck: dict[str, bool]) -> list[str]:
        pools = ElasticPools(ctx.store, claim_workflow(ctx))
        return await pools.retry(tenant_id, stuck, actor=f"slurmctld:{tenant_id}")

    return retry


def instances(req: ApiRequest) -> Instances:
    ctx = req.ctx
    return Instances(ctx.store, ctx.cfg.fleet.dead_after_s, fleet=ctx.services.fleet)


def topology(req: ApiRequest) -> Topology:
    ctx = req.ctx
    return Topology(ctx.store, ctx.instance, ctx.bus.notify)


def events(req: ApiRequest) -> Events:
    return Events(req.ctx.store)


def agent(req: ApiRequest) -> Agent:
    ctx = req.ctx
    return Agent(
        ctx.store,
        req,  # an agent token's first use is stamped in its request's first commit
        ctx.instance,
        ctx.bus.notify,
        enroll=ctx.cfg.enroll,
        progress_interval_s=ctx.cfg.provision.progress_event_interval_s,
        join_token_ttl_s=ctx.cfg.tenants.join_token_ttl_s,
        bmc=ctx.services.bmc,
        workflow=claim_workflow(ctx),
    )


def attestation(req: ApiRequest) -> Attestation:
    ctx = req.ctx
    return Attestation(
        ctx.store,
        req,  # an agent token's first use is stamped in its request's first commit
        ctx.instance,
        ctx.bus.notify,
        cfg=ctx.cfg.attestation,
    )


def repairs(req: ApiRequest) -> Repairs:
    ctx = req.ctx
    return Repairs(
        ctx.store, ctx.instance, ctx.bus.notify, rules=ctx.cfg.enroll.rules,
        workflow=claim_workflow(ctx),
    )  # fmt: skip


def bmcs(req: ApiRequest) -> Bmcs:
    ctx = req.ctx
    return Bmcs(
        ctx.store,
        ctx.instance,
        ctx.bus.notify,
        ctx.services.bmc,
        provisioner(ctx).spawn,
        boot_url_problem=boot_url_problem(ctx.cfg),
    )


def mesh_nodes(req: ApiRequest) -> Mesh:
    return Mesh(req.ctx.store, req.ctx.services.mesh_watch, req.ctx.mesh_polls)


def firmware(req: ApiRequest) -> Firmware:
    ctx = req.ctx
    return Firmware(
        ctx.store, ctx.instance, rules=ctx.cfg.enroll.rules, updates=ctx.services.firmware
    )


def rollouts(req: ApiRequest) -> Rollouts:
    ctx = req.ctx
    driver = ctx.services.firmware_rollouts
    return Rollouts(
        ctx.store,
        ctx.instance,
        rules=ctx.cfg.enroll.rules,
        wake=driver.wake if driver is not None else None,
    )
