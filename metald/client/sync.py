"""The synchronous metald client, on the standard library's HTTP (no extra dependency)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from metald.client.core import (
    ApiError,
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


class Client:
    """``Client("https://metald:8080", token)``: every call returns the decoded JSON answer
    and raises ApiError (PreconditionFailed for 412) with the problem document."""

    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        #: The ETag of the last answer (send it back as ``if_match``).
        self.etag: str | None = None

    # ---- transport -------------------------------------------------------------------

    def _open(self, method: str, path: str, body: Any, if_match: str | None, timeout: float | None):  # type: ignore[no-untyped-def]
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers=headers(self.token, if_match=if_match, body=data is not None),
        )
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            try:
                payload = json.loads(e.read() or b"{}")
            except ValueError:
                payload = {"detail": f"HTTP {e.code}"}
            raise error_for(e.code, payload) from None

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Query | None = None,
        *,
        if_match: str | None = None,
    ) -> Any:
        """One request; the decoded JSON body (None when empty)."""
        with self._open(method, with_query(path, query), body, if_match, self.timeout) as r:
            self.etag = r.headers.get("ETag")
            raw = r.read()
            return json.loads(raw) if raw else None

    def page(self, path: str, query: Query | None = None) -> Page:
        return Page.of(self.call("GET", path, query=query))

    def iterate(self, path: str, query: Query | None = None) -> Iterator[Json]:
        """Every item of a list, following its ``next`` links."""
        page = self.page(path, query)
        while True:
            yield from page.items
            if page.next is None:
                return
            page = self.page(page.next)

    def stream(self, path: str, query: Query | None = None) -> Iterator[Any]:
        """Decoded server-sent ``data`` payloads, until the server ends the stream."""
        resp = self._open("GET", with_query(path, query), None, None, None)
        data: list[str] = []
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and data:
                yield json.loads("\n".join(data))
                data = []

    # ---- machines --------------------------------------------------------------------

    def machine(self, ref: str) -> Json:
        """A machine by id, name or 8+ character id prefix."""
        return self.call("GET", f"/api/v1/machines/{ref}")

    def machines(self, **filters: str) -> Iterator[Json]:
        return self.iterate("/api/v1/machines", list(filters.items()))

    def machine_action(
        self, ref: str, action: str, reason: str | None = None, *, if_match: str | None = None
    ) -> Json:
        body: Json = {"action": action}
        if reason:
            body["reason"] = reason
        return self.call("POST", f"/api/v1/machines/{ref}/actions", body, if_match=if_match)

    def rename_machine(self, ref: str, name: str, *, if_match: str | None = None) -> Json:
        return self.call("PATCH", f"/api/v1/machines/{ref}", {"name": name}, if_match=if_match)

    # ---- the repair queue (staff tokens) -------------------------------------------

    def repairs(self, **filters: str) -> Iterator[Json]:
        """The repair queue: ``status`` open (default), closed, taken, verifying or all;
        ``rack``, ``taken_by``, ``machine``."""
        return self.iterate("/api/v1/repairs", list(filters.items()))

    def repair(self, ref: str) -> Json:
        return self.call("GET", f"/api/v1/repairs/{ref}")

    def open_repair(self, machine: str, summary: str, *, part: str | None = None) -> Json:
        """Put a machine in the queue by hand (it is marked broken)."""
        return self.call("POST", "/api/v1/repairs", repair_body(machine, summary, part))

    def take_repair(self, ref: str) -> Json:
        return self.call("POST", f"/api/v1/repairs/{ref}/take")

    def release_repair(self, ref: str) -> Json:
        """Let go of a taken repair: open in the queue again, the machine broken again."""
        return self.call("POST", f"/api/v1/repairs/{ref}/release")

    def note_repair(self, ref: str, text: str) -> Json:
        return self.call("POST", f"/api/v1/repairs/{ref}/note", {"text": text})

    def repaired(self, ref: str, note: str | None = None) -> Json:
        """Done: the machine goes back through commissioning."""
        body: Json = {"note": note} if note else {}
        return self.call("POST", f"/api/v1/repairs/{ref}/repaired", body)

    # ---- claims ----------------------------------------------------------------------

    def claim(
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
        """Claim ``count`` machines for ``tenant`` (retry with the same idempotency key
        after a lost answer: the same claim comes back, nothing new is allocated)."""
        body = claim_body(
            tenant,
            count,
            image,
            selector=selector,
            ssh_keys=ssh_keys,
            idempotency_key=idempotency_key,
            os=os,
        )
        return self.call("POST", "/api/v1/claims", body)

    def get_claim(self, ref: str) -> Json:
        return self.call("GET", f"/api/v1/claims/{ref}")

    def wait_claim(self, ref: str, timeout: float = 3600.0, interval: float = 5.0) -> Json:
        """Poll the claim until every machine settles (active, provisioned or failed);
        TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            claim = self.get_claim(ref)
            if claim_settled(claim):
                return claim
            if time.monotonic() >= deadline:
                raise TimeoutError(f"claim {ref} did not settle within {timeout:g} s")
            time.sleep(interval)

    def release_claim(self, ref: str, *, if_match: str | None = None) -> Json:
        return self.call("POST", f"/api/v1/claims/{ref}/release", if_match=if_match)


__all__ = ["ApiError", "Client"]
