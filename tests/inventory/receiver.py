"""A stand-in for metald's agent endpoints: records inventory posts, hands out actions.

Used in-process by the host agent tests and as a script inside the QEMU test's network
namespace (``python receiver.py HOST PORT OUTFILE``), where it writes each post to OUTFILE.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web


@dataclass
class Receiver:
    token: str = "agent-token"
    #: HTTP statuses for the first posts (then 200): exercises the agent's retries.
    post_statuses: list[int] = field(default_factory=list)
    #: Actions /next hands out in turn; the last one repeats.
    actions: list[dict[str, Any]] = field(default_factory=lambda: [{"action": "poweroff"}])
    posts: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    next_calls: int = 0
    out: Path | None = None
    #: Credential activation, done for real (metald's MakeCredential): the pending secret and
    #: the enrolled AK's name, which the nonce answer names on the next boot.
    pending: bytes | None = None
    ak_name: str | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=2 << 20)
        app.router.add_post("/api/v1/agent/inventory", self.inventory)
        app.router.add_get("/api/v1/agent/next", self.next_action)
        # Measured-boot attestation (docs/attestation.md): key, nonce and quote are recorded
        # as they come (kind "attestation/..."); the test verifies them with metald's core.
        app.router.add_post("/api/v1/agent/attestation/key", self.attestation)
        app.router.add_post("/api/v1/agent/attestation/nonce", self.attestation)
        app.router.add_post("/api/v1/agent/attestation", self.attestation)
        return app

    async def attestation(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"title": "Unauthorized"}, status=401)
        kind = request.path.removeprefix("/api/v1/agent/")
        raw = await request.read()
        answer: dict[str, Any] = {"machine_id": "lab", "ak_name": "", "ek_check": "recorded"}
        status = 200
        if kind.endswith("/nonce"):
            answer = {
                "nonce": secrets.token_hex(32),
                "expires_at": "2099-01-01T00:00:00Z",
                "pcrs": [0, 1, 2, 3, 4, 5, 6, 7],
                "ak_name": self.ak_name,
            }
        elif kind.endswith("/key"):
            answer, status = self._activation(json.loads(raw))
        elif kind == "attestation":
            answer = {"machine_id": "lab", "id": "x", "status": "recorded", "reason": None,
                      "summary": "recorded", "changes": [], "state": "inspecting"}  # fmt: skip
        record = {"kind": kind, "at": time.time(), "body": json.loads(raw) if raw else None}
        record["answer"] = answer
        if self.out:
            with self.out.with_suffix(".attestation.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
        return web.json_response(answer, status=status)

    def _activation(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """metald's two enrollment calls: a real credential for the EK over the AK's name,
        then the secret the guest's TPM recovered."""
        import base64

        from cryptography.hazmat.primitives import serialization

        from metald.attestation.credential import make_credential
        from metald.attestation.tpm import parse_public

        name = parse_public(base64.b64decode(body["ak_public"])).name
        base = {"machine_id": "lab", "ak_name": name.hex(), "ek_check": None}
        if "activation_secret" not in body:
            self.pending = secrets.token_bytes(32)
            ek = serialization.load_pem_public_key(body["ek_public"].encode())
            cred = make_credential(ek, name, self.pending).tpm2_tools_file()  # type: ignore[arg-type]
            return {**base, "status": "challenge",
                    "credential": base64.b64encode(cred).decode()}, 200  # fmt: skip
        if self.pending is None or bytes.fromhex(body["activation_secret"]) != self.pending:
            return {"title": "the activated credential does not match"}, 422
        self.ak_name, self.pending = name.hex(), None
        return {**base, "status": "enrolled", "ek_check": "activated", "credential": None}, 200

    def _authorised(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def inventory(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"title": "Unauthorized"}, status=401)
        body = await request.read()
        self.headers.append(dict(request.headers))
        status = self.post_statuses.pop(0) if self.post_statuses else 200
        record = {"status": status, "at": time.time(), "body": json.loads(body)}
        self.posts.append(record)
        if self.out:
            with self.out.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return web.json_response({"ok": status == 200}, status=status)

    async def next_action(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"title": "Unauthorized"}, status=401)
        action = self.actions[min(self.next_calls, len(self.actions) - 1)]
        self.next_calls += 1
        return web.json_response(action)


if __name__ == "__main__":
    # python receiver.py HOST PORT OUTFILE READYFILE: READYFILE appears once it listens
    host, port, out, ready = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    app = Receiver(out=out).app()

    async def _ready(_: web.Application) -> None:
        ready.touch()

    app.on_startup.append(_ready)
    web.run_app(app, host=host, port=port, print=None)
