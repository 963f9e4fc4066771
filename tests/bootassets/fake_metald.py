"""A stand-in for the metald endpoints a node image talks to: GET /api/v1/agent/provision, POST
/api/v1/agent/progress and POST /api/v1/join (which, given ``hub_ifname``, adds the node as a
peer of that WireGuard interface, as metald's hub does). A join token works once: a second join
with it is refused with 409, as metald does. Run in the QEMU test's network namespace as
``python fake_metald.py HOST PORT OUTFILE READYFILE CONFIG.json``; every request it gets is
appended to OUTFILE as a JSON line {"path", "auth", "body"}."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aiohttp import web


def main() -> None:
    host, port, out, ready = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    cfg = json.loads(Path(sys.argv[5]).read_text())
    burned: set[str] = set()

    def record(request: web.Request, body: object) -> None:
        with out.open("a") as f:
            entry = {
                "path": request.path,
                "auth": request.headers.get("Authorization"),
                "body": body,
            }
            f.write(json.dumps(entry) + "\n")

    def unauthorised(request: web.Request) -> bool:
        return request.headers.get("Authorization") != f"Bearer {cfg['agent_token']}"

    async def provision(request: web.Request) -> web.Response:
        record(request, None)
        if unauthorised(request):
            return web.json_response({"detail": "bad agent token"}, status=401)
        return web.json_response(cfg["provision"])

    async def progress(request: web.Request) -> web.Response:
        record(request, await request.json())
        if unauthorised(request):
            return web.json_response({"detail": "bad agent token"}, status=401)
        return web.json_response({"machine_id": "lab-n1", "state": "provisioned"})

    async def join(request: web.Request) -> web.Response:
        body = await request.json()
        record(request, body)
        status, detail = cfg.get("join_status", 200), cfg.get("join_detail", "")
        if body.get("token") in burned:
            status, detail = 409, "this join token was already used; a join token works once"
        burned.add(body.get("token"))
        if status != 200:
            return web.json_response(
                {"title": "Refused", "status": status, "detail": detail},
                status=status,
                content_type="application/problem+json",
            )
        if cfg.get("hub_ifname"):  # a real hub (wireguard-go) in this namespace: add the peer
            subprocess.run(
                ["wg", "set", cfg["hub_ifname"], "peer", body["public_key"], "allowed-ips"]
                + [cfg["join_response"]["overlay_address"].split("/")[0] + "/32"],
                check=True,
            )
        return web.json_response(cfg["join_response"])

    app = web.Application()
    app.router.add_get("/api/v1/agent/provision", provision)
    app.router.add_post("/api/v1/agent/progress", progress)
    app.router.add_post("/api/v1/join", join)

    async def _ready(_: web.Application) -> None:
        ready.touch()

    app.on_startup.append(_ready)
    web.run_app(app, host=host, port=port, print=None)


if __name__ == "__main__":
    main()
