"""The real agent (busybox sh) deploys a machine through two real metald API apps on one store:
the instance that served its boot is killed after the first progress report, and the agent
finishes through the other instance of its ``metald.urls``: the machine is provisioned."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlmodel import select

from api.app import create_app
from api.context import AppContext
from metald.config import load_config
from metald.events import EventBus
from metald.lifecycle import State
from metald.provision import netboot
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Event, Image, Machine
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import boot_token, claimed
from tests.provision_agent.conftest import MIB, cloud_image, needs_root_and_busybox, run_agent
from tests.provision_agent.server import AgentApi

pytestmark = needs_root_and_busybox


def _app(store: Store, tmp_path: Path, name: str) -> web.Application:
    cfg = load_config(
        None,
        environ={
            "METALD_STATE_DIR": str(tmp_path / "state"),
            "METALD_STORE__URL": store.url,
            "METALD_INSTANCE": name,
        },
    )
    ctx = AppContext(
        cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path), bus=EventBus()
    )
    return create_app(ctx)


async def test_a_deploy_finishes_through_a_live_instance(
    tmp_path, busybox_bin, loops, instances, store: Store
) -> None:
    image = cloud_image(tmp_path)
    files = await instances(AgentApi(image=image))  # an image server apart from metald
    mid = claimed(store, 1)[0]
    with store.session() as s:
        img = s.exec(select(Image)).one()
        img.spec = {
            "url": f"{files.url}/image",
            "sha256": hashlib.sha256(image).hexdigest(),
            "format": "raw",
            "size_bytes": len(image),
        }
        s.add(img)
        s.commit()
    assert await netboot.boot_from_network(store, FakeBmc(), mid, actor="t")
    token = boot_token(store, mid)  # the script instance a served
    assert token is not None

    a_app, b_app = _app(store, tmp_path, "a"), _app(store, tmp_path, "b")
    progress_seen: list[str] = []

    @web.middleware
    async def die_after_first_report(request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        if request.path == "/api/v1/agent/progress":
            progress_seen.append(request.path)
            a.kill()  # killed: this answer still goes out, nothing after it is accepted
        return resp

    a_app.middlewares.append(die_after_first_report)
    a = await instances(a_app)
    b = await instances(b_app)
    disk = tmp_path / "disk.img"
    disk.write_bytes(os.urandom(8 * MIB))
    rc, log = await run_agent(
        tmp_path,
        busybox_bin,
        0,
        "deploy",
        METALD_URL=a.url,
        METALD_URLS=b.url,
        METALD_TOKEN=token,
        METALD_MACHINE=mid,
        METALD_DISKS=loops.attach(disk),
        METALD_PARTITIONS=loops.attach(disk, "-o", str(MIB), "--sizelimit", str(4 * MIB)),
        METALD_CHUNK_MB="1",
        METALD_PROGRESS_S="0",
        METALD_MAX_TRIES="1",
    )
    assert progress_seen == ["/api/v1/agent/progress"], log
    assert log.count(f"metald at {a.url} does not answer; going on with {b.url}") == 1, log
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None
        assert m.state != State.PROVISIONING.value and m.state != State.PROVISION_FAILED.value, (
            m.state,
            m.last_error,
            log,
        )
        done = s.exec(select(Event).where(Event.machine_id == mid, Event.to_state == m.state)).all()
        assert done and done[-1].instance == "b", [(e.kind, e.instance) for e in done]
