"""``metalctl``: operate the fleet from a terminal through metald's HTTP API.

Reads ``METALD_URL`` (default http://127.0.0.1:8080) and ``METALD_TOKEN``. Prints human tables
by default and the API's JSON with ``--json``. Exit status: 0 ok, 1 the API refused (its
problem+json detail is printed), 2 usage or connection errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from metald import __version__


class ApiError(Exception):
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
        self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None
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

    def call(
        self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None
    ) -> Any:
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

    def stream(self, path: str, query: list[tuple[str, str]]) -> Any:
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


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[h for h, _ in columns]] + [
        ["" if r.get(k) is None else str(r.get(k)) for _, k in columns] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c[i].ljust(widths[i]) for i in range(len(columns))).rstrip() for c in cells
    )


def _kv(items: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in items:
        if "=" in item:
            k, v = item.split("=", 1)
            out[k] = v
        elif item.endswith("-"):
            out[item[:-1]] = None
        else:
            raise SystemExit(f"metalctl: label {item!r} must be key=value, or key- to remove it")
    return out


def _print_event(ev: dict[str, Any]) -> None:
    what = ev["kind"]
    if ev.get("from_state") or ev.get("to_state"):
        what += f" {ev.get('from_state') or '-'} -> {ev.get('to_state')}"
    print(
        f"{ev['id']:>6} {ev['at'][:19]} {(ev.get('machine_id') or '-')[:8]:8} {what:40} {ev['actor']}  {ev.get('reason') or ''}".rstrip(),
        flush=True,
    )


MACHINE_COLUMNS = [
    ("ID", "id"),
    ("NAME", "name"),
    ("STATE", "state"),
    ("GPUS", "gpus"),
    ("MEM_GB", "mem"),
    ("RACK", "rack"),
    ("LABELS", "labels_s"),
    ("TENANT", "tenant_id"),
]


def _machine_row(m: dict[str, Any]) -> dict[str, Any]:
    r = dict(m)
    r["gpus"] = f"{m['gpu_count']}x {m['gpu_model']}" if m.get("gpu_count") else "-"
    r["mem"] = round(m["memory_mb"] / 1024) if m.get("memory_mb") else None
    r["labels_s"] = ",".join(f"{k}={v}" for k, v in sorted((m.get("labels") or {}).items()))
    return r


def run(args: argparse.Namespace, c: Client) -> int:
    out_json = args.json
    cmd = args.cmd
    if cmd == "machines":
        if args.sub == "list":
            q = [("state", s) for s in args.state] + [("label", lb) for lb in args.label]
            for key in ("gpu_model", "gpu_count", "min_gpu_count", "rack", "limit", "offset"):
                if getattr(args, key) is not None:
                    q.append((key, str(getattr(args, key))))
            page = c.call("GET", "/api/v1/machines", query=q)
            if out_json:
                print(json.dumps(page, indent=2))
            else:
                print(table([_machine_row(m) for m in page["items"]], MACHINE_COLUMNS))
                print(f"({len(page['items'])} of {page['total']})")
        elif args.sub == "show":
            m = c.call("GET", f"/api/v1/machines/{args.id}")
            if out_json:
                print(json.dumps(m, indent=2))
            else:
                for k in (
                    "id",
                    "name",
                    "state",
                    "version",
                    "rack",
                    "rack_position",
                    "firmware",
                    "vendor",
                    "product",
                    "serial",
                    "system_uuid",
                    "cpu_model",
                    "cpu_count",
                    "memory_mb",
                    "gpu_model",
                    "gpu_count",
                    "power_state",
                    "tenant_id",
                    "last_error",
                ):
                    print(f"{k + ':':15} {'' if m.get(k) is None else m[k]}")
                print(
                    f"{'labels:':15} {', '.join(f'{k}={v}' for k, v in sorted(m['labels'].items()))}"
                )
                print(
                    f"{'nics:':15} {', '.join(n['mac'] + (' (pxe)' if n['pxe'] else '') for n in m['nics'])}"
                )
                print(f"{'actions:':15} {', '.join(m['allowed_actions'])}")
        elif args.sub == "register":
            body: dict[str, Any] = {"macs": args.mac}
            if args.name:
                body["name"] = args.name
            if args.label:
                body["labels"] = _kv(args.label)
            m = c.call("POST", "/api/v1/machines", body)
            print(json.dumps(m, indent=2) if out_json else f"registered {m['id']} ({m['state']})")
        elif args.sub == "label":
            m = c.call("PATCH", f"/api/v1/machines/{args.id}/labels", {"labels": _kv(args.labels)})
            print(json.dumps(m, indent=2) if out_json else f"{m['id']}: {m['labels']}")
        else:  # an action
            body = {"action": args.sub}
            if args.reason:
                body["reason"] = args.reason
            m = c.call("POST", f"/api/v1/machines/{args.id}/actions", body)
            print(json.dumps(m, indent=2) if out_json else f"{m['id']}: {m['state']}")
    elif cmd == "events":
        q = [("after", str(args.after)), ("limit", str(args.limit))]
        if args.machine:
            q.append(("machine_id", args.machine))
        if args.follow:
            after = args.after
            try:
                while True:  # the server ends a stream after its maximum life: resume it
                    q[0] = ("after", str(after))
                    for ev in c.stream("/api/v1/events/stream", q):
                        print(json.dumps(ev)) if out_json else _print_event(ev)
                        sys.stdout.flush()
                        after = ev["id"]
            except KeyboardInterrupt:
                return 0
        else:
            page = c.call("GET", "/api/v1/events", query=q)
            if out_json:
                print(json.dumps(page, indent=2))
            else:
                for ev in page["items"]:
                    _print_event(ev)
    elif cmd == "tokens":
        if args.sub == "list":
            page = c.call("GET", "/api/v1/tokens")
            if out_json:
                print(json.dumps(page, indent=2))
            else:
                rows = [
                    dict(
                        t,
                        scope_s=",".join(t["scope"]),
                        status="revoked" if t["revoked_at"] else "active",
                    )
                    for t in page["items"]
                ]
                print(
                    table(
                        rows,
                        [
                            ("ID", "id"),
                            ("NAME", "name"),
                            ("ROLE", "role"),
                            ("SCOPE", "scope_s"),
                            ("STATUS", "status"),
                            ("EXPIRES", "expires_at"),
                        ],
                    )
                )
        elif args.sub == "create":
            body = {"name": args.name, "role": args.role, "scope": args.scope}
            if args.ttl:
                body["ttl_seconds"] = args.ttl
            t = c.call("POST", "/api/v1/tokens", body)
            if out_json:
                print(json.dumps(t, indent=2))
            else:
                print(f"token {t['id']} ({t['role']}) created; the secret is shown only now:")
                print(t["token"])
        elif args.sub == "revoke":
            t = c.call("DELETE", f"/api/v1/tokens/{args.id}")
            print(json.dumps(t, indent=2) if out_json else f"revoked {t['id']}")
    elif cmd == "tenants":
        if args.sub == "list":
            page = c.call("GET", "/api/v1/tenants")
            print(
                json.dumps(page, indent=2)
                if out_json
                else table(
                    page["items"],
                    [
                        ("ID", "id"),
                        ("NAME", "name"),
                        ("KIND", "cluster_kind"),
                        ("CONTROL PLANE", "control_plane"),
                        ("OVERLAY", "overlay_prefix"),
                        ("VLAN", "vlan"),
                    ],
                )
            )
        elif args.sub == "hub":
            if args.create:
                body: dict[str, Any] = {"listen_port": args.port}
                if args.endpoint_host:
                    body["endpoint_host"] = args.endpoint_host
                h = c.call("POST", f"/api/v1/tenants/{args.id}/hub", body)
            else:
                h = c.call("GET", f"/api/v1/tenants/{args.id}/hub")
            if out_json:
                print(json.dumps(h, indent=2))
            else:
                print(
                    f"hub {h['ifname']} endpoint {h['endpoint']} address {h['address']} "
                    f"overlay {h['overlay_prefix']} public key {h['public_key']}"
                )
                print(
                    table(
                        h["peers"],
                        [
                            ("MACHINE", "machine_id"),
                            ("ADDRESS", "address"),
                            ("PUBLIC KEY", "public_key"),
                            ("LAST HANDSHAKE", "last_handshake_at"),
                        ],
                    )
                )
        else:
            t = c.call("POST", "/api/v1/tenants", {"name": args.name, "cluster_kind": args.kind})
            print(
                json.dumps(t, indent=2) if out_json else f"tenant {t['id']} ({t['name']}) created"
            )
    elif cmd == "whoami":
        w = c.call("GET", "/api/v1/whoami")
        print(
            json.dumps(w, indent=2)
            if out_json
            else f"{w['name']} ({w['role']}) scope={','.join(w['scope']) or '-'}"
        )
    else:
        from metald.ctl_ext import run_extension

        return run_extension(args, c)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="metalctl", description="Operate a metald fleet (METALD_URL, METALD_TOKEN)"
    )
    ap.add_argument("--version", action="version", version=f"metalctl {__version__}")
    ap.add_argument("--url", default=os.environ.get("METALD_URL", "http://127.0.0.1:8080"))
    ap.add_argument("--json", action="store_true", help="print the API's JSON")
    sub = ap.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("machines", help="list, show, register, label and act on machines")
    msub = m.add_subparsers(dest="sub", required=True)
    ml = msub.add_parser("list")
    ml.add_argument("--state", action="append", default=[])
    ml.add_argument("--label", action="append", default=[], help="key=value")
    ml.add_argument("--gpu-model", dest="gpu_model")
    ml.add_argument("--gpu-count", dest="gpu_count", type=int)
    ml.add_argument("--min-gpu-count", dest="min_gpu_count", type=int)
    ml.add_argument("--rack")
    ml.add_argument("--limit", type=int)
    ml.add_argument("--offset", type=int)
    msub.add_parser("show").add_argument("id")
    mr = msub.add_parser("register")
    mr.add_argument("--mac", action="append", required=True)
    mr.add_argument("--name")
    mr.add_argument("--label", action="append", default=[])
    mlab = msub.add_parser("label", help="key=value sets, key- removes")
    mlab.add_argument("id")
    mlab.add_argument("labels", nargs="+")
    for action in (
        "inspect",
        "maintenance-on",
        "maintenance-off",
        "mark-broken",
        "repair",
        "retire",
    ):
        pa = msub.add_parser(action)
        pa.add_argument("id")
        pa.add_argument("--reason")

    e = sub.add_parser("events", help="list or follow events")
    e.add_argument("--machine")
    e.add_argument("--after", type=int, default=0)
    e.add_argument("--limit", type=int, default=100)
    e.add_argument("--follow", "-f", action="store_true")

    t = sub.add_parser("tokens", help="API tokens (admin)")
    tsub = t.add_subparsers(dest="sub", required=True)
    tsub.add_parser("list")
    tc = tsub.add_parser("create")
    tc.add_argument("--name", required=True)
    tc.add_argument(
        "--role", required=True, choices=["admin", "technician", "orchestrator", "agent"]
    )
    tc.add_argument("--scope", action="append", default=[])
    tc.add_argument("--ttl", type=int, help="seconds")
    tsub.add_parser("revoke").add_argument("id")

    tn = sub.add_parser("tenants", help="tenants (admin)")
    tnsub = tn.add_subparsers(dest="sub", required=True)
    tnsub.add_parser("list")
    tnc = tnsub.add_parser("create")
    tnc.add_argument("name")
    tnc.add_argument("--kind", default="slurm", choices=["slurm", "kubernetes"])
    tnh = tnsub.add_parser("hub", help="show a tenant's WireGuard hub, or --create it")
    tnh.add_argument("id", help="tenant id")
    tnh.add_argument("--create", action="store_true")
    tnh.add_argument(
        "--endpoint-host", help="underlay address nodes dial (default: from tenants.hub_addresses)"
    )
    tnh.add_argument("--port", type=int, default=51820)

    sub.add_parser("whoami", help="show the token in use")
    try:
        from metald.ctl_ext import add_extension_parsers
    except ImportError:
        pass
    else:
        add_extension_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.url, os.environ.get("METALD_TOKEN"))
    try:
        return run(args, client)
    except ApiError as e:
        print(f"metalctl: {e} (HTTP {e.status})", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(f"metalctl: cannot reach {args.url}: {e.reason}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
