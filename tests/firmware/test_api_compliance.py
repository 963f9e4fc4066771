"""Firmware baselines and compliance over the API (issue 27, item 1): admins write baselines,
staff read them and the compliance list, others are refused."""

from __future__ import annotations

from typing import Any

import pytest
from sqlmodel import select

from api.app import create_app
from api.context import AppContext
from metald.config import Config
from metald.events import EventBus
from metald.inventory.normalize import NormalizedInventory
from metald.inventory.rules import EnrollmentRule
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Event, Machine
from tests.conftest import Tokens, seed

SHA = "ab" * 32
H100 = EnrollmentRule.model_validate(
    {"match": {"gpu_model": "NVIDIA H100*"}, "commissioning": {"name": "h100-8x"}}
)


@pytest.fixture
async def fw(cfg: Config, store: Store, aiohttp_client: Any) -> Any:
    cfg.enroll.rules = [H100]
    ctx = AppContext(
        cfg=cfg, store=store, secrets=SecretBox.from_file(cfg.secrets_key_path), bus=EventBus()
    )
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    return client, tokens


def _set(store: Store, mid: str, gpu: str, versions: dict[str, str]) -> None:
    with store.session() as s:
        m = s.get(Machine, mid)
        assert m is not None
        inv = NormalizedInventory(gpu_model=gpu, gpu_count=8)
        m.inventory = {"normalized": inv.model_dump(mode="json")}
        m.firmware_versions = versions
        s.add(m)
        s.commit()


BASELINE = {
    "components": [
        {"id": "BIOS", "version": "2.19.1", "url": "http://repo/bios.bin", "sha256": SHA,
         "apply": "host-reset"},
        {"id": "GPU*", "version": "96.00.89"},
    ],
    "note": "autumn wave",
}  # fmt: skip


async def test_baseline_versions_and_compliance(fw: Any, store: Store) -> None:
    client, tokens = fw
    t: Tokens = tokens
    _set(store, t.machine_a, "NVIDIA H100 80GB HBM3", {"BIOS": "2.19.1", "GPU0": "96.00.89"})
    _set(store, t.machine_b, "NVIDIA H100 80GB HBM3", {"BIOS": "2.18.0", "GPU0": "96.00.89"})
    _set(store, t.machine_free, "NVIDIA A100-SXM4-40GB", {"BIOS": "1.0"})  # no baseline

    r = await client.get("/api/v1/firmware/compliance", headers=t.header("technician"))
    assert r.status == 200 and (await r.json())["items"] == []  # no baseline yet

    r = await client.put(
        "/api/v1/firmware/baselines/h100-8x", json=BASELINE, headers=t.header("admin")
    )
    assert r.status == 200, await r.text()
    first = await r.json()
    assert first["version"] == 1 and first["components"][0]["apply"] == "host-reset"
    second = dict(
        BASELINE, components=[{"id": "BIOS", "version": "2.19.1"}, BASELINE["components"][1]]
    )
    r = await client.put(
        "/api/v1/firmware/baselines/h100-8x", json=second, headers=t.header("admin")
    )
    assert (await r.json())["version"] == 2
    r = await client.get("/api/v1/firmware/baselines/h100-8x", headers=t.header("technician"))
    shown = await r.json()
    assert shown["version"] == 2 and [h["version"] for h in shown["history"]] == [1]
    r = await client.get("/api/v1/firmware/baselines", headers=t.header("technician"))
    assert [b["profile"] for b in (await r.json())["items"]] == ["h100-8x"]

    r = await client.get("/api/v1/firmware/compliance", headers=t.header("technician"))
    body = await r.json()
    assert [i["machine_id"] for i in body["items"]] == [t.machine_b], body
    off = body["items"][0]["off_baseline"]
    assert off == [
        {"component": "BIOS", "item": "BIOS", "want": "2.19.1", "have": "2.18.0",
         "status": "differs", "direction": "older"}
    ]  # fmt: skip
    r = await client.get("/api/v1/firmware/compliance?all=true", headers=t.header("admin"))
    listed = {i["machine_id"]: i["compliant"] for i in (await r.json())["items"]}
    assert listed == {t.machine_a: True, t.machine_b: False}
    r = await client.get(
        "/api/v1/firmware/compliance?profile=other", headers=t.header("technician")
    )
    assert (await r.json())["total"] == 0

    kinds = await store.run(
        lambda s: [
            e.data["version"]
            for e in s.exec(select(Event).where(Event.kind == "firmware.baseline"))
        ]
    )
    assert kinds == [1, 2]


async def test_roles_and_refusals(fw: Any) -> None:
    client, t = fw
    url = "/api/v1/firmware/baselines/h100-8x"
    # Technicians read baselines and compliance but do not choose what is flashed.
    r = await client.put(url, json=BASELINE, headers=t.header("technician"))
    assert r.status == 403
    for role in ("orchestrator", "agent"):
        for path in (url, "/api/v1/firmware/baselines", "/api/v1/firmware/compliance"):
            r = await client.get(path, headers=t.header(role))
            assert r.status == 403, (role, path)
    r = await client.get(url, headers=t.header("technician"))
    assert (
        r.status == 404 and "PUT /api/v1/firmware/baselines/h100-8x" in (await r.json())["detail"]
    )
    bad = {"components": [{"id": "BIOS", "version": "1", "url": "http://x/b.bin"}]}
    r = await client.put(url, json=bad, headers=t.header("admin"))
    assert r.status == 422 and "sha256" in await r.text()
    r = await client.put(
        "/api/v1/firmware/baselines/..bad", json=BASELINE, headers=t.header("admin")
    )
    assert r.status == 422
