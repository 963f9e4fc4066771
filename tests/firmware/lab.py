"""The firmware tests' shared set-up: metald's API with the BMC and firmware services over
the lab Redfish BMC, an image route on loopback, and a machine ready to update."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from api.app import create_app
from api.context import AppContext, Services
from metald.bmc.service import BmcService
from metald.config import Config
from metald.events import EventBus
from metald.firmware.images import FirmwareImages
from metald.firmware.service import FirmwareUpdates
from metald.inventory.normalize import NormalizedInventory
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Machine
from tests.bmc.peers import LabRedfish
from tests.conftest import Tokens, seed
from tests.firmware.test_api_compliance import H100


@dataclass
class Env:
    client: Any
    tokens: Tokens
    bmc: BmcService
    fw: FirmwareUpdates
    images: FirmwareImages
    image_dir: Path
    boot_url: str
    cfg: Config
    store: Store


@pytest.fixture
async def env(cfg: Config, store: Store, aiohttp_client: Any, tmp_path: Path) -> AsyncIterator[Env]:
    cfg.enroll.rules = [H100]
    cfg.bmc.min_interval_ms = 0
    cfg.bmc.timeout_s = 3
    cfg.bmc.retries = 1
    cfg.firmware.poll_s = 0.1
    cfg.firmware.flash_timeout_s = 30
    cfg.firmware.verify_timeout_s = 30
    secrets = SecretBox.from_file(cfg.secrets_key_path)
    bmc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    images = FirmwareImages(tmp_path / "fw-store", max_bytes=1 << 24, timeout_s=10)
    # metald's image route on a loopback listener (the boot HTTP listener's part).
    runner = web.AppRunner(web.Application(), access_log=None)
    runner.app.router.add_routes(images.routes())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    boot_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    fw = _service(store, bmc, images, cfg, boot_url)
    ctx = AppContext(
        cfg=cfg,
        store=store,
        secrets=secrets,
        bus=EventBus(),
        services=Services(bmc=bmc, firmware=fw),
    )
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    (tmp_path / "src").mkdir()
    try:
        yield Env(client, tokens, bmc, fw, images, tmp_path / "src", boot_url, cfg, store)
    finally:
        await fw.stop()
        await bmc.stop()
        await runner.cleanup()


def _service(
    store: Store, bmc: BmcService, images: FirmwareImages, cfg: Config, boot: str | None
) -> FirmwareUpdates:
    return FirmwareUpdates(
        store, bmc.control, images, cfg.firmware, cfg.instance, rules=lambda: cfg.enroll.rules,
        boot_url=boot,
    )  # fmt: skip


async def _prepare(e: Env, peer: LabRedfish, baseline: list[dict[str, Any]]) -> str:
    """The free machine: an H100 inventory, the lab BMC linked, in maintenance, versions read,
    and the profile's baseline set."""
    t, c = e.tokens, e.client
    mid = t.machine_free
    with e.store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None
        m.inventory = {
            "normalized": NormalizedInventory(
                gpu_model="NVIDIA H100 80GB HBM3", gpu_count=8
            ).model_dump(mode="json")
        }
        s.add(m)
        s.commit()
    body = {"address": "http://127.0.0.1", "port": peer.port, "protocol": "redfish",
            "username": peer.username, "password": peer.password, "machine_id": mid}  # fmt: skip
    r = await c.post("/api/v1/bmcs", json=body, headers=t.header("technician"))
    assert r.status == 201, await r.text()
    r = await c.post(
        f"/api/v1/machines/{mid}/actions",
        json={"action": "maintenance-on"},
        headers=t.header("technician"),
    )
    assert r.status == 200, await r.text()
    r = await c.get(f"/api/v1/machines/{mid}/firmware", headers=t.header("technician"))
    assert r.status == 200
    r = await c.put(
        "/api/v1/firmware/baselines/h100-8x",
        json={"components": baseline},
        headers=t.header("admin"),
    )
    assert r.status == 200, await r.text()
    return mid


def _image(e: Env, name: str, data: bytes) -> tuple[str, str]:
    path = e.image_dir / name
    path.write_bytes(data)
    return f"file://{path}", hashlib.sha256(data).hexdigest()
