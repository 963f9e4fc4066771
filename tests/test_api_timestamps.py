"""Every timestamp metald sends is an RFC 3339 date-time with its UTC offset, on every
backend: list and single answers, the events page and the live event stream (SQLite hands
back naive datetimes; a strict generated client rejects a date-time without an offset)."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime, timedelta
from typing import Any

from tests.api_helpers import LiveApi, live_api

#: A date-time as the API writes it (date, 'T', time), with or without an offset.
DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}")
#: RFC 3339 section 5.6: the offset is required.
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


def timestamps(value: Any) -> list[str]:
    """Every string in ``value`` that reads as a date-time."""
    if isinstance(value, str):
        return [value] if DATE_TIME.match(value) else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in timestamps(v)]
    if isinstance(value, list):
        return [t for v in value for t in timestamps(v)]
    return []


def assert_rfc3339_utc(value: Any) -> int:
    found = timestamps(value)
    for t in found:
        assert RFC3339.fullmatch(t), f"{t!r} is not RFC 3339 (no offset)"
        assert datetime.fromisoformat(t).utcoffset() == timedelta(0), t
    return len(found)


async def test_answers_and_the_event_stream_carry_utc_offsets(
    aiohttp_client, store, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    live: LiveApi = await live_api(aiohttp_client, store, tmp_path)
    tech = {"Authorization": f"Bearer {live.tokens.technician}"}
    admin = {"Authorization": f"Bearer {live.tokens.admin}"}
    r = await live.client.post(
        f"/api/v1/machines/{live.tokens.machine_free}/actions",
        json={"action": "maintenance-on"},
        headers=tech,
    )
    assert r.status == 200
    seen = 0
    for path, h in (
        ("/api/v1/machines", tech),
        (f"/api/v1/machines/{live.tokens.machine_free}", tech),
        ("/api/v1/events?sort=-id", tech),
        ("/api/v1/tenants", admin),
        ("/api/v1/tokens", admin),
    ):
        r = await live.client.get(path, headers=h)
        assert r.status == 200, path
        seen += assert_rfc3339_utc(await r.json())
    assert seen >= 10
    stream = await live.client.get("/api/v1/events/stream?after=0", headers=tech)
    data = None
    while data is None:
        line = (await asyncio.wait_for(stream.content.readline(), 20)).decode()
        assert line, "the stream ended before its first event"
        if line.startswith("data:"):
            data = json.loads(line[5:])
    stream.close()
    assert assert_rfc3339_utc(data) == 1 and data["at"]
