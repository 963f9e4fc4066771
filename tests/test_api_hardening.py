"""The HTTP API under hostile or unusual input: bodies read whole (slow, fragmented, large),
bounded JSON, integers beyond 64 bits, bad label keys and Last-Event-IDs, pagination with
api.page_size, and the header-read timeout. Every refusal is a problem+json 4xx, never a 500."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from metald import machines
from metald.auth import issue_token
from metald.claims.allocation import Selector, create_claim
from metald.lifecycle import Trigger
from metald.store.models import Image
from tests.api_helpers import LiveApi, live_api, until
from tests.claims.helpers import DEPLOY, add_image, add_ready
from tests.inventory.conftest import fixture_text, payload


@pytest.fixture
async def live(aiohttp_client, store, tmp_path) -> LiveApi:  # type: ignore[no-untyped-def]
    return await live_api(aiohttp_client, store, tmp_path)


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return status, json.loads(await reader.readexactly(length))


async def post_in_pieces(
    live: LiveApi, path: str, token: str, body: bytes, cuts: list[int]
) -> tuple[int, dict[str, Any]]:
    """POST ``body`` over a raw socket in pieces (split at ``cuts``), each sent only once the
    server's handler has taken the previous one out of its buffer: a slow or fragmented client
    whose body is never all buffered at once."""
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: metald\r\nContent-Type: application/json\r\n".encode()
        + f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n".encode()
        + b"Connection: close\r\n\r\n"
    )
    await writer.drain()
    before = len(live.requests)
    await until(lambda: len(live.requests) > before, "the server to start the request")
    request = live.requests[-1]
    sent = 0
    for lo, hi in zip([0, *cuts], [*cuts, len(body)], strict=True):
        writer.write(body[lo:hi])
        await writer.drain()
        sent = hi
        # Next piece once the handler has taken this one out of the server's buffer, or has
        # answered (as the old code did, with the first piece only).
        await until(
            lambda sent=sent: (
                request in live.answered
                or (request.content.total_bytes == sent and request.content._size == 0)
            ),  # type: ignore[attr-defined]
            f"the server to consume {sent} bytes",
        )
        if request in live.answered:
            break  # it answered early: the caller's assertion says what
    try:
        return await _response(reader)
    finally:
        writer.close()


async def test_body_sent_in_pieces_is_read_whole(live: LiveApi) -> None:
    """A client that sends a few hundred KB in pieces gets its machine created (not
    'Malformed JSON' for the first piece)."""
    body = json.dumps({"macs": ["02:00:00:00:0a:01"], "name": "slow"}).encode()
    body = body[:-1] + b" " * 300_000 + b"}"  # valid JSON, a few hundred KB
    status, answer = await post_in_pieces(
        live, "/api/v1/machines", live.tokens.technician, body, [1000, 150_000]
    )
    assert status == 201, answer
    assert answer["name"] == "slow"


async def test_chunked_body_past_the_limit_is_413(live: LiveApi) -> None:
    """Without Content-Length, a body is refused once it passes the limit, not after."""
    limit = live.ctx.cfg.api.max_body_bytes

    async def endless():  # type: ignore[no-untyped-def]
        yield b'{"macs": ["' + b"a" * 1000
        for _ in range(limit // 65536 + 4):
            yield b"a" * 65536

    r = await live.client.post(
        "/api/v1/machines",
        data=endless(),
        headers={**live.tokens.header("admin"), "Content-Type": "application/json"},
    )
    assert r.status == 413
    assert r.headers["Content-Type"].startswith("application/problem+json")
    assert str(limit) in (await r.json(content_type=None))["detail"]


async def test_large_gpu_inventory_is_accepted(live: LiveApi) -> None:
    """A 700 KB nvidia-smi XML (the schema allows 768 KB) arrives whole and is stored."""
    with live.store.session() as s:
        m = machines.create_machine(s, macs=["02:00:00:00:0b:01"], actor="test")
        machines.transition(s, m.id, Trigger.INSPECT, actor="test")
        _row, agent = issue_token(s, name="agent-big", role="agent", scope=[m.id])
    xml = fixture_text("nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml")
    pad = "<!-- " + "x" * (700 * 1024 - len(xml)) + " -->"
    xml = xml.replace("<nvidia_smi_log>", "<nvidia_smi_log>" + pad, 1)
    assert 690 * 1024 < len(xml) < 768 * 1024
    body = json.dumps(payload(machine_id=m.id, raw={"nvidia_smi_xml": xml})).encode()
    # Over a slow provisioning network the body arrives in pieces; here 64 KB at a time.
    status, answer = await post_in_pieces(
        live, "/api/v1/agent/inventory", agent, body, list(range(65536, len(body), 65536))
    )
    assert status == 200, answer
    r = await live.client.get(f"/api/v1/machines/{m.id}", headers=live.tokens.header("admin"))
    assert (await r.json())["state"] != "inspecting"


HOSTILE = [
    # (description, method, path, raw body or None, status, phrase in detail)
    ("deep nesting", "POST", "/api/v1/machines", b"[" * 100_000 + b"]" * 100_000, 400, "nested"),
    (
        "nesting past the limit",
        "POST",
        "/api/v1/machines",
        b'{"macs": ' + b"[" * 70 + b"]" * 70 + b"}",
        400,
        "nested",
    ),
    ("NaN", "POST", "/api/v1/machines", b'{"macs": [NaN]}', 400, "not a JSON number"),
    (
        "huge version in a body",
        "POST",
        "/api/v1/machines/{free}/actions",
        b'{"action": "maintenance-on", "version": 99999999999999999999}',
        422,
        "version",
    ),
    ("huge offset", "GET", "/api/v1/machines?offset=99999999999999999999", None, 422, "offset"),
    ("huge after", "GET", "/api/v1/events?after=99999999999999999999", None, 422, "after"),
    (
        "huge min_gpu_count",
        "GET",
        "/api/v1/machines?min_gpu_count=99999999999999999999",
        None,
        422,
        "min_gpu_count",
    ),
    (
        "huge min_memory_mb",
        "POST",
        "/api/v1/claims",
        b'{"tenant_id": "{tenant}", "count": 1, "image_id": "x", '
        b'"selector": {"min_memory_mb": 99999999999999999999}}',
        422,
        "min_memory_mb",
    ),
    ("quote in a label key", "GET", '/api/v1/machines?label=a"b=x', None, 422, "label"),
]


@pytest.mark.parametrize("case", HOSTILE, ids=[c[0] for c in HOSTILE])
async def test_hostile_input_is_a_4xx_problem(live: LiveApi, case) -> None:  # type: ignore[no-untyped-def]
    _desc, method, path, body, status, phrase = case
    path = path.format(free=live.tokens.machine_free)
    if body is not None:
        body = body.replace(b"{tenant}", live.tokens.tenant_a.encode())
    r = await live.client.request(
        method,
        path,
        data=body,
        headers={**live.tokens.header("admin"), "Content-Type": "application/json"},
    )
    assert r.status == status, await r.text()
    assert r.headers["Content-Type"].startswith("application/problem+json")
    assert phrase in (await r.json(content_type=None))["detail"]


@pytest.mark.parametrize("last_id", ["9" * 5000, "²", "-1", "1" * 20])
async def test_bad_last_event_id_is_400(live: LiveApi, last_id: str) -> None:
    r = await live.client.get(
        "/api/v1/events/stream",
        headers={**live.tokens.header("admin"), "Last-Event-ID": last_id},
    )
    assert r.status == 400, r.status  # (the old code streamed, or answered 500)
    assert "Last-Event-ID" in (await r.json(content_type=None))["detail"]


async def test_page_size_is_the_default_page_size(aiohttp_client, store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    live = await live_api(aiohttp_client, store, tmp_path, env={"METALD_API__PAGE_SIZE": "2"})
    with store.session() as s:
        for name in ("img-a", "img-b", "img-c"):
            s.add(Image(name=name, kind="stateless", spec={}))
        for i in range(3):
            issue_token(s, name=f"extra-{i}", role="technician")
        s.commit()
    h = live.tokens.header("admin")
    for path, total in [
        ("/api/v1/machines", 3),
        ("/api/v1/tokens", 8),
        ("/api/v1/images", 3),
        ("/api/v1/tenants", 2),
    ]:
        page = await (await live.client.get(path, headers=h)).json()
        assert (page["limit"], len(page["items"]), page["total"]) == (2, 2, total), path
        rest = await (await live.client.get(f"{path}?offset=2&limit=10", headers=h)).json()
        assert len(rest["items"]) == total - 2 and rest["limit"] == 10, path
        ids = [x["id"] for x in page["items"] + rest["items"]]
        assert len(set(ids)) == total, path  # pages do not overlap
    events = await (await live.client.get("/api/v1/events", headers=h)).json()
    assert len(events["items"]) == 2
    add_ready(store, 3, prefix="pg")
    image = add_image(store, "claim-image")
    with store.session() as s:
        for _ in range(3):
            create_claim(s, live.tokens.tenant_a, 1, Selector(), image, None, "t", deploy=DEPLOY)
    claims = await (await live.client.get("/api/v1/claims", headers=h)).json()
    assert (len(claims["items"]), claims["total"]) == (2, 3)
    # An orchestrator's tenants list counts only its tenants.
    page = await (
        await live.client.get("/api/v1/tenants", headers=live.tokens.header("orchestrator"))
    ).json()
    assert page["total"] == 1 and [t["id"] for t in page["items"]] == [live.tokens.tenant_a]


async def test_half_sent_headers_are_dropped(store, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A client that never finishes its headers is disconnected after the header timeout
    (the server settings the daemon uses), while a prompt client is served."""
    from api.app import create_app, server_settings
    from api.context import AppContext
    from metald.config import load_config
    from metald.events import EventBus
    from metald.secrets import SecretBox

    cfg = load_config(
        None, environ={"METALD_STATE_DIR": str(tmp_path / "s"), "METALD_STORE__URL": store.url}
    )
    ctx = AppContext(cfg, store, SecretBox.from_file(cfg.secrets_key_path), EventBus())
    runner = web.AppRunner(create_app(ctx), **server_settings(header_timeout_s=0.5))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        for _reader, writer in conns:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: metald\r\nX-Slow: ")
            await writer.drain()
        # Each half-sent request is closed by the server: its reader reaches EOF.
        for reader, _writer in conns:
            assert await asyncio.wait_for(reader.read(), 30) == b""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: metald\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 30)).startswith(b"HTTP/1.1 200")
        for _r, w in [*conns, (reader, writer)]:
            w.close()
    finally:
        await runner.cleanup()
