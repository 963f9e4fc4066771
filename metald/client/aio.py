"""The asynchronous metald client, on aiohttp (already a dependency of metald)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from metald.client.core import (
    Json,
    Page,
    Query,
    claim_body,
    claim_settled,
    error_for,
    headers,
    repair_body,
    with_query,
)


class AsyncClient:
    """``async with AsyncClient(url, token) as c: await c.claim(...)``."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.etag: str | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncClient:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _s(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Query | None = None,
        *,
        if_match: str | None = None,
    ) -> Any:
        data = json.dumps(body) if body is not None else None
        async with self._s().request(
            method,
            self.url + with_query(path, query),
            data=data,
            headers=headers(self.token, if_match=if_match, body=data is not None),
        ) as r:
            raw = await r.read()
            if r.status >= 400:
                try:
                    payload = json.loads(raw or b"{}")
                except ValueError:
                    payload = {"detail": f"HTTP {r.status}"}
                raise error_for(r.status, payload)
            self.etag = r.headers.get("ETag")
            return json.loads(raw) if raw else None

    async def page(self, path: str, query: Query | None = None) -> Page:
        return Page.of(await self.call("GET", path, query=query))

    async def iterate(self, path: str, query: Query | None = None) -> AsyncIterator[Json]:
        page = await self.page(path, query)
        while True:
            for item in page.items:
                yield item
            if page.next is None:
                return
            page = await self.page(page.next)

    async def machine(self, ref: str) -> Json:
        return await self.call("GET", f"/api/v1/machines/{ref}")

    def machines(self, **filters: str) -> AsyncIterator[Json]:
        return self.iterate("/api/v1/machines", list(filters.items()))

    async def machine_action(
        self, ref: str, action: str, reason: str | None = None, *, if_match: str | None = None
    ) -> Json:
        body: Json = {"action": action}
        if reason:
            body["reason"] = reason
        return await self.call("POST", f"/api/v1/machines/{ref}/actions", body, if_match=if_match)

    def repairs(self, **filters: str) -> AsyncIterator[Json]:
        return self.iterate("/api/v1/repairs", list(filters.items()))

    async def repair(self, ref: str) -> Json:
        return await self.call("GET", f"/api/v1/repairs/{ref}")

    async def open_repair(self, machine: str, summary: str, *, part: str | None = None) -> Json:
        return await self.call("POST", "/api/v1/repairs", repair_body(machine, summary, part))

    async def take_repair(self, ref: str) -> Json:
        return await self.call("POST", f"/api/v1/repairs/{ref}/take")

    async def release_repair(self, ref: str) -> Json:
        return await self.call("POST", f"/api/v1/repairs/{ref}/release")

    async def note_repair(self, ref: str, text: str) -> Json:
        return await self.call("POST", f"/api/v1/repairs/{ref}/note", {"text": text})

    async def repaired(self, ref: str, note: str | None = None) -> Json:
        body: Json = {"note": note} if note else {}
        return await self.call("POST", f"/api/v1/repairs/{ref}/repaired", body)

    async def claim(
        self,
        tenant: str,
        count: int,
        image: str,
        *,
        selector: Json | None = None,
        ssh_keys: list[str] | None = None,
        idempotency_key: str | None = None,
        os: Json | None = None,
    ) -> Json:
        body = claim_body(
            tenant,
            count,
            image,
            selector=selector,
            ssh_keys=ssh_keys,
            idempotency_key=idempotency_key,
            os=os,
        )
        return await self.call("POST", "/api/v1/claims", body)

    async def get_claim(self, ref: str) -> Json:
        return await self.call("GET", f"/api/v1/claims/{ref}")

    async def wait_claim(self, ref: str, timeout: float = 3600.0, interval: float = 5.0) -> Json:
        async with asyncio.timeout(timeout):
            while True:
                claim = await self.get_claim(ref)
                if claim_settled(claim):
                    return claim
                await asyncio.sleep(interval)

    async def release_claim(self, ref: str, *, if_match: str | None = None) -> Json:
        return await self.call("POST", f"/api/v1/claims/{ref}/release", if_match=if_match)


__all__ = ["AsyncClient"]
