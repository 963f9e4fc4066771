"""The claim workflow's release runs the BMC clean-up (metald.firmware.release) before it boots
the wipe, and does not wipe a machine the clean-up held (issue 27, item 4)."""

from __future__ import annotations

from typing import Any

from api.app import CTX_KEY
from tests.api_helpers import drain_steps, use_services
from tests.claims.fakes import FakeBmc
from tests.claims.helpers import add_ready
from tests.claims.test_api_claims import KEY, _image


class FakeCleanup:
    def __init__(self, hold: set[str]) -> None:
        self.hold = hold
        self.calls: list[tuple[list[str], str | None]] = []

    async def after_release(
        self, machine_ids: list[str], claim_id: str | None, actor: str
    ) -> list[str]:
        self.calls.append((sorted(machine_ids), claim_id))
        return [m for m in machine_ids if m in self.hold]

    async def start_update(self, *a: Any, **k: Any) -> list[dict[str, Any]]:
        return []

    async def updates_of(self, machine_id: str) -> list[dict[str, Any]]:
        return []


async def test_release_cleans_then_wipes_what_was_not_held(api: Any) -> None:
    client, tokens, store = api
    bmc = FakeBmc(power_state="off")
    cleanup = FakeCleanup(set())
    use_services(client.server.app[CTX_KEY], bmc=bmc, firmware=cleanup)
    image_id = await _image(client, tokens)
    add_ready(store, 2, labels={"pool": "fw"})
    body = {
        "tenant_id": tokens.tenant_a,
        "count": 2,
        "selector": {"labels": {"pool": "fw"}},
        "image_id": image_id,
        "ssh_authorized_keys": [KEY],
    }
    orch = tokens.header("orchestrator")
    r = await client.post("/api/v1/claims", json=body, headers=orch)
    assert r.status == 201, await r.text()
    claim = await r.json()
    ids = sorted(m["id"] for m in claim["machines"])
    await drain_steps(client)
    cleanup.hold = {ids[0]}
    bmc.calls.clear()
    r = await client.post(f"/api/v1/claims/{claim['id']}/release", headers=orch)
    assert r.status == 200, await r.text()
    await drain_steps(client)
    assert cleanup.calls == [(ids, claim["id"])]
    booted = {m for m, what, _ in bmc.calls if what == "boot"}
    assert booted == {ids[1]}  # the held machine is not booted into the wipe
