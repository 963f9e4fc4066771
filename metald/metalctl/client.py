"""metalctl's HTTP client: the bearer token, JSON bodies, problem+json errors, SSE."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

Query = list[tuple[str, str]]


class ApiError(Exception):
    """The API answered with an error status; ``body`` is its problem+json document."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("detail") or body.get("title") or f"HTTP {status}")
        self.status = status
        self.body = body


class Client:
    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def _request(
        self, method: str, path: str, body: Any = None, query: Query | None = None
    ) -> urllib.request.Request:
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return req

    def call(self, method: str, path: str, body: Any = None, query: Query | None = None) -> Any:
        """One request; returns the decoded JSON body (None when empty), raises ApiError."""
        try:
            with urllib.request.urlopen(
                self._request(method, path, body, query), timeout=self.timeout
            ) as r:
                raw = r.read()
                return json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            try:
                payload = json.loads(e.read() or b"{}")
            except ValueError:
                payload = {"detail": f"HTTP {e.code}"}
            raise ApiError(e.code, payload) from None

    def stream(self, path: str, query: Query) -> Iterator[Any]:
        """Yield decoded SSE ``data`` payloads forever."""
        req = self._request("GET", path, query=query)
        try:
            resp = urllib.request.urlopen(req, timeout=None)
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, json.loads(e.read() or b"{}")) from None
        data: list[str] = []
        for raw in resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("data:"):
                data.append(line[5:].strip())
            elif not line and data:
                yield json.loads("\n".join(data))
                data = []
