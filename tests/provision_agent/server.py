"""A stand-in for metald's deploy-agent endpoints: /agent/provision, /agent/progress, /next,
and the image itself. Used in-process by the host tests and as a script in the QEMU test's
network namespace (``python server.py HOST PORT OUTFILE READYFILE [CONFIG.json]``), where it
appends each progress report to OUTFILE as a JSON line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web


@dataclass
class AgentApi:
    token: str = "agent-token"
    #: The answer of GET /api/v1/agent/provision.
    provision: dict[str, Any] = field(
        default_factory=lambda: {"action": "none", "machine_id": "m1"}
    )
    #: Served at /image (and /image.gz): the disk image's bytes as they travel.
    image: bytes = b""
    #: Served at /image instead of ``image``, streamed from the file (large images).
    image_path: Path | None = None
    #: Stop sending the image after this many bytes (a broken download).
    cut_after: int | None = None
    progress: list[dict[str, Any]] = field(default_factory=list)
    next_calls: int = 0
    out: Path | None = None
    #: Called after each progress report is recorded, before it is answered (with the count).
    on_progress: Callable[[int], None] | None = None
    #: The Authorization header of every request, as received.
    seen_auth: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/agent/provision", self.get_provision)
        app.router.add_post("/api/v1/agent/progress", self.post_progress)
        app.router.add_get("/api/v1/agent/next", self.next_action)
        app.router.add_get("/image", self.get_image)
        app.router.add_get("/image.gz", self.get_image)
        return app

    def _authorised(self, request: web.Request) -> bool:
        self.seen_auth.append(request.headers.get("Authorization", ""))
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def get_provision(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"title": "Unauthorized"}, status=401)
        return web.json_response(self.provision)

    async def post_progress(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"title": "Unauthorized"}, status=401)
        body = await request.json()
        self.progress.append(body)
        if self.on_progress is not None:
            self.on_progress(len(self.progress))
        if self.out:
            with self.out.open("a") as f:
                f.write(json.dumps(body) + "\n")
        return web.json_response({"machine_id": "m1", "state": "provisioning"})

    async def next_action(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"title": "Unauthorized"}, status=401)
        self.next_calls += 1
        return web.json_response({"action": "poweroff"})

    async def get_image(self, request: web.Request) -> web.StreamResponse:
        if self.image_path is not None:
            return web.FileResponse(self.image_path)
        resp = web.StreamResponse()
        if self.cut_after is None:
            resp.content_length = len(self.image)
        await resp.prepare(request)
        data = self.image if self.cut_after is None else self.image[: self.cut_after]
        for i in range(0, len(data), 1 << 16):
            await resp.write(data[i : i + (1 << 16)])
        if self.cut_after is not None:
            # a connection that dies mid-image: no clean end of the chunked body
            assert request.transport is not None
            request.transport.close()
        return resp


if __name__ == "__main__":
    host, port, out, ready = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    api = AgentApi(out=out)
    if len(sys.argv) > 5:
        cfg = json.loads(Path(sys.argv[5]).read_text())
        api.provision = cfg.get("provision", api.provision)
        if cfg.get("image_path"):
            api.image_path = Path(cfg["image_path"])
        elif cfg.get("image_file"):
            api.image = Path(cfg["image_file"]).read_bytes()
    app = api.app()

    async def _ready(_: web.Application) -> None:
        ready.touch()

    app.on_startup.append(_ready)
    web.run_app(app, host=host, port=port, print=None)
