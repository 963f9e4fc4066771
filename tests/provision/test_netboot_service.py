"""Who owns the network-boot steps the API starts: the daemon's ``provision`` service (its runner,
given by constructor), or, for an app run without the daemon, the one its ``Services`` made.
No module-level registry: two apps on one event loop never share a runner."""

from __future__ import annotations

import asyncio

from api.context import AppContext
from api.workflows import claim_workflow, provisioner
from metald.config import Config
from metald.events import EventBus
from metald.provision.netboot import Provisioner, StepRunner
from metald.secrets import SecretBox
from metald.store import Store


def _ctx(cfg: Config, store: Store) -> AppContext:
    return AppContext(
        cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path), bus=EventBus()
    )


def test_the_daemon_s_provision_service_owns_the_api_s_steps(cfg: Config) -> None:
    from metald.daemon import Daemon

    d = Daemon(cfg)
    try:
        svc = d.ctx.services.provision
        assert isinstance(svc, Provisioner)
        assert provisioner(d.ctx) is svc
        assert claim_workflow(d.ctx).boot is svc
    finally:
        d.store.close()


async def test_apps_without_the_daemon_each_keep_their_own_runner(
    cfg: Config, store: Store
) -> None:
    a, b = _ctx(cfg, store), _ctx(cfg, store)
    assert provisioner(a) is provisioner(a)
    assert provisioner(a).steps is not provisioner(b).steps
    started = asyncio.Event()

    async def step() -> None:
        started.set()
        await asyncio.Event().wait()

    task = provisioner(a).spawn(step())
    await started.wait()
    await provisioner(b).steps.drain()  # b's runner has nothing of a's
    assert not task.done()
    await provisioner(a).stop()
    assert task.cancelled()


async def test_the_runner_is_the_one_given_by_constructor() -> None:
    steps = StepRunner()
    svc = Provisioner(steps)
    assert svc.steps is steps
    task = svc.spawn(asyncio.sleep(0))
    await steps.drain()
    assert task.done()
