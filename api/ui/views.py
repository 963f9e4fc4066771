"""The console's pages and actions. Each reads and acts through the API's routes
(``api.ui.dispatch``), so a page shows exactly what the API would answer its caller."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from api.ui import actions as machine_actions
from api.ui.dispatch import Api, Refused
from api.ui.guard import UI_CTX, UiRequest, clear_cookie, current, origin_ok, set_cookie
from api.ui.render import error, fragment, page, wants_json
from metald.usecases import ui_sessions as sessions
from metald.usecases.console import Console, FleetQuery

#: Bulk actions: the API route each one calls, its body, and whether it must be confirmed
#: (destructive: it takes a machine away from whoever uses it) or needs a reason.
BULK: dict[str, dict[str, Any]] = {
    "power-on": {"path": "/api/v1/machines/{id}/power", "body": {"action": "on", "wait_s": 0}},
    "power-off": {
        "path": "/api/v1/machines/{id}/power",
        "body": {"action": "off", "wait_s": 0},
        "confirm": True,
    },
    "power-cycle": {
        "path": "/api/v1/machines/{id}/power",
        "body": {"action": "cycle", "wait_s": 0},
        "confirm": True,
    },
    "maintenance-on": {
        "path": "/api/v1/machines/{id}/actions",
        "body": {"action": "maintenance-on"},
        "confirm": True,
        "reason": True,
    },
    "maintenance-off": {
        "path": "/api/v1/machines/{id}/actions",
        "body": {"action": "maintenance-off"},
    },
    "mark-broken": {
        "path": "/api/v1/machines/{id}/actions",
        "body": {"action": "mark-broken"},
        "confirm": True,
        "reason": True,
    },
}
#: Claim machines that wait on nothing (the claims page shows no blocking event for them).
DONE = frozenset({"provisioned", "joining", "active"})
#: Machines one bulk request may act on.
BULK_MAX = 500
NAV = (
    ("fleet", "/ui/", "Fleet", ("GET", "/api/v1/machines")),
    ("claims", "/ui/claims", "Claims", ("GET", "/api/v1/claims")),
    ("tenants", "/ui/tenants", "Tenants", ("GET", "/api/v1/tenants")),
    ("repairs", "/ui/repairs", "Repairs", ("GET", "/api/v1/repairs")),
    ("events", "/ui/events", "Events", ("GET", "/api/v1/events")),
    ("firmware", "/ui/firmware", "Firmware", ("GET", "/api/v1/firmware/compliance")),
    ("topology", "/ui/topology", "Topology", ("GET", "/api/v1/nvlink-domains")),
    ("instances", "/ui/instances", "Instances", ("GET", "/api/v1/instances")),
    ("tokens", "/ui/tokens", "Tokens", ("GET", "/api/v1/tokens")),
)


class Views:
    def __init__(self, api: Api) -> None:
        self.api = api

    # --- shared ---

    def base(self, ui: UiRequest, nav: str) -> dict[str, Any]:
        links = [(k, href, label) for k, href, label, (m, p) in NAV if self.api.allows(ui, m, p)]
        return {"me": ui.principal, "csrf": ui.csrf, "nav": nav, "links": links}

    def need(self, ui: UiRequest, method: str, path: str) -> None:
        """Refuse the page as the API refuses its route (same roles, same sentence)."""
        if not self.api.allows(ui, method, path):
            spec = self.api.spec(method, path)
            allowed = ", ".join(sorted(r.value for r in spec.roles or ()))
            raise Refused(
                403,
                "Forbidden",
                f"a {ui.principal.role.value} token cannot {spec.summary.lower()}; this needs "
                f"one of: {allowed}",
            )

    def refused(self, ui: UiRequest, r: Refused, nav: str = "") -> web.Response:
        return error(ui.raw, r.status, r.title, r.detail, **self.base(ui, nav))

    # --- login ---

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        ctx = request.app[UI_CTX]
        if await current(request, ctx) is not None:
            raise web.HTTPSeeOther("/ui/")
        return page(
            "login.html",
            title="Log in",
            next=_safe_next(request.query.get("next")),
            problem=None,
            me=None,
            csrf="",
            nav="",
        )

    async def login(self, request: web.Request) -> web.StreamResponse:
        ctx = request.app[UI_CTX]
        if not origin_ok(request, required=False):
            return error(
                request,
                403,
                "Cross-site request refused",
                "this login came from another site's page; log in from the console's own page",
            )
        form = await request.post()
        secret = str(form.get("token", ""))
        target = _safe_next(str(form.get("next", "")))
        try:
            opened = await sessions.UiSessions(ctx.store).open(secret)
        except sessions.LoginRefused as e:
            return page(
                "login.html",
                status=401,
                title="Log in",
                next=target,
                problem={"status": 401, "title": "Login refused", "detail": str(e)},
                me=None,
                csrf="",
                nav="",
            )
        resp = web.HTTPSeeOther(target)
        set_cookie(resp, request, opened.session_id)
        raise resp

    async def logout(self, ui: UiRequest) -> web.StreamResponse:
        await sessions.UiSessions(ui.ctx.store).close(ui.session_id)
        resp = web.HTTPSeeOther("/ui/login")
        clear_cookie(resp)
        raise resp

    # --- fleet ---

    async def fleet(self, ui: UiRequest) -> web.StreamResponse:
        try:
            self.need(ui, "GET", "/api/v1/machines")
        except Refused as r:
            return self.refused(ui, r, "fleet")
        f = FleetQuery.from_params(ui.raw.query)
        data = await _console(ui).fleet_page(ui.principal, f)
        last_event = await _console(ui).last_event_id()
        tenants = dict(data.tenants)

        def glabel(key: tuple[Any, ...]) -> str:
            """A group's heading."""
            if f.group == "tenant":
                return tenants.get(key[0], key[0][:8]) if key[0] else "no tenant"
            if f.group == "sku":
                product, model, count = key
                gpus = f"{count}× {model}" if count else "no GPU"
                return f"{product or 'unknown product'} · {gpus}"
            if f.group == "rack":
                return f"rack {key[0]}" if key[0] else "no rack"
            return str(key[0])

        return page(
            "fleet.html",
            title="Fleet",
            f=f,
            fleet=data,
            glabel=glabel,
            bulk=BULK,
            can_act=self.api.allows(ui, "POST", "/api/v1/machines/{id}/actions"),
            last_event=last_event,
            **self.base(ui, "fleet"),
        )

    async def racks(self, ui: UiRequest) -> web.StreamResponse:
        """The rack view: each rack as an elevation, its machines in their units, coloured by
        state, power or GPU health (``colour``); the fleet's filters apply (same parameters)."""
        try:
            self.need(ui, "GET", "/api/v1/machines")
        except Refused as r:
            return self.refused(ui, r, "fleet")
        f = FleetQuery.from_params(ui.raw.query)
        colour = ui.raw.query.get("colour", "state")
        if colour not in ("state", "power", "gpu"):
            colour = "state"
        start = ui.raw.query.get("from", "").strip()[:128]
        found = await _console(ui).racks(ui.principal, f, start)
        return page(
            "racks.html",
            title="Racks",
            f=f,
            racks=found.racks,
            found=found,
            start=start,
            colour=colour,
            query=f.link(after="", sort="", group="")[5:],
            **self.base(ui, "fleet"),
        )

    async def fleet_rows(self, ui: UiRequest) -> web.StreamResponse:
        """Rows of the table again, for the live page: {"rows": {id: html}, "added": [{id,
        key, html}], "counts": {...}}. ``id``: rows on the page, refreshed in place. ``add``:
        machines the page does not show yet (an event named them), answered only when the
        page's own query (scope, filters, search: the page's query parameters) lists them."""
        ids = ui.raw.query.getall("id", [])
        add = ui.raw.query.getall("add", [])
        console = _console(ui)
        rows = await console.rows_by_id(ui.principal, ids)
        f = FleetQuery.from_params(ui.raw.query)
        added = await console.rows_matching(ui.principal, f, add)
        can_act = self.api.allows(ui, "POST", "/api/v1/machines/{id}/actions")
        counts = await console.counts(ui.principal)
        return web.json_response(
            {
                "rows": {r.m.id: fragment("_row.html", r=r, can_act=can_act) for r in rows},
                "added": [
                    {
                        "id": r.m.id,
                        "key": r.key,
                        "html": fragment("_row.html", r=r, can_act=can_act),
                    }
                    for r in added
                ],
                "counts": counts,
            },
            headers={"Cache-Control": "no-store"},
        )

    async def bulk(self, ui: UiRequest) -> web.StreamResponse:
        form = await ui.raw.post()
        action = str(form.get("action", ""))
        ids = [str(i) for i in form.getall("id", [])][:BULK_MAX]
        reason = str(form.get("reason", "")).strip()[:500]
        spec = BULK.get(action)
        ctx = self.base(ui, "fleet")
        if spec is None:
            return error(
                ui.raw,
                422,
                "Unknown action",
                f"{action[:40]!r} is not one of: {', '.join(BULK)}",
                **ctx,
            )
        if not ids:
            return error(
                ui.raw,
                422,
                "Nothing selected",
                "select at least one machine, then choose the action",
                **ctx,
            )
        if spec.get("confirm") and form.get("confirm") != "yes":
            return error(
                ui.raw,
                428,
                "Confirmation required",
                f"{action} takes machines away from whoever uses them: confirm it in the dialog "
                "(the form must carry confirm=yes)",
                **ctx,
            )
        if spec.get("reason") and not reason:
            return error(
                ui.raw,
                422,
                "Reason required",
                f"{action} needs a reason: say why, for the event log",
                **ctx,
            )
        body = dict(spec["body"])
        if reason and body.get("action", "").startswith(("maintenance", "mark")):
            body["reason"] = reason

        async def one(mid: str) -> tuple[str, str | None]:
            try:
                await self.api.call(ui, "POST", spec["path"], params={"id": mid}, body=body)
            except Refused as r:
                return mid, f"{r.title}: {r.detail}"
            return mid, None

        results = await asyncio.gather(*(one(i) for i in ids))
        ui.ctx.bus.notify()
        failed = [(m, e) for m, e in results if e]
        if wants_json(ui.raw):  # the fleet page's script: it stays where it is
            labels = await _console(ui).names_of(ui.principal, [m for m, _ in failed])
            return web.json_response(
                {
                    "action": action,
                    "done": len(results) - len(failed),
                    "failed": [
                        {"id": m, "name": labels.get(m, m[:8]), "why": e} for m, e in failed
                    ],
                },
                status=200 if not failed else 207,
            )
        return page(
            "bulk.html",
            status=200 if not failed else 207,
            title=f"{action}: results",
            action=action,
            done=len(results) - len(failed),
            failed=failed,
            back=_safe_next(str(form.get("back", "/ui/"))),
            **ctx,
        )

    # --- one machine ---

    async def machine(self, ui: UiRequest) -> web.StreamResponse:
        mid = ui.raw.match_info["id"]
        try:
            m = await self.api.call(ui, "GET", "/api/v1/machines/{id}", params={"id": mid})
            events = await self.api.call(
                ui,
                "GET",
                "/api/v1/events",
                query={"machine_id": m["id"], "sort": "-id", "limit": 50},
            )
        except Refused as r:
            return self.refused(ui, r, "fleet")
        commissioning = None
        if self.api.allows(ui, "GET", "/api/v1/machines/{id}/commissioning"):
            try:
                commissioning = await self.api.call(
                    ui, "GET", "/api/v1/machines/{id}/commissioning", params={"id": m["id"]}
                )
            except Refused:
                commissioning = None
        attestation = None
        if self.api.allows(ui, "GET", "/api/v1/machines/{id}/attestation"):
            try:
                attestation = await self.api.call(
                    ui, "GET", "/api/v1/machines/{id}/attestation", params={"id": m["id"]}
                )
            except Refused:
                attestation = None
        repair = None
        if self.api.allows(ui, "GET", "/api/v1/repairs"):
            found = await self.api.call(
                ui, "GET", "/api/v1/repairs", query={"machine": m["id"], "limit": 1}
            )
            repair = found["items"][0] if found["items"] else None
        staff = self.api.allows(ui, "GET", "/api/v1/bmcs")
        bmc = await _console(ui).bmc_of(m["id"]) if staff else None
        if bmc is not None:
            # What its driver can be asked: the page offers only those actions (None: unknown,
            # every action is offered and the API refuses what the BMC lacks).
            try:
                shown = await self.api.call(
                    ui, "GET", "/api/v1/bmcs/{id}", params={"id": bmc["id"]}
                )
                bmc["capabilities"] = shown.get("capabilities")
            except Refused:
                bmc["capabilities"] = None
        console = None
        if self.api.allows(ui, "GET", "/api/v1/machines/{id}/console"):
            svc = ui.ctx.services.console
            console = (
                svc.status(m["id"]) if svc is not None else {"state": "unavailable", "watching": []}
            )
        caps = (bmc or {}).get("capabilities")
        if caps is not None and "serial-console" not in caps:
            console = None  # the machine's BMC has none metald speaks: no console offered
        if staff and bmc is None:
            console = None  # no BMC registered: nothing to open a serial console through
        inv = (m.get("inventory") or {}).get("normalized") or {}
        topology = None
        if self.api.allows(ui, "GET", "/api/v1/machines/{id}/topology"):
            try:
                topology = await self.api.call(
                    ui, "GET", "/api/v1/machines/{id}/topology", params={"id": m["id"]}
                )
            except Refused:
                topology = None
        last_event = max((e["id"] for e in events["items"]), default=0)
        names = await self.names(ui, m)
        return page(
            "machine.html",
            title=m.get("name") or m["id"],
            m=m,
            inv=inv,
            events=events["items"],
            commissioning=commissioning,
            attestation=attestation,
            repair=repair,
            bmc=bmc,
            console=console,
            actions=self.offered(ui, m, bmc, staff),
            names=names,
            mnames={m["id"]: m.get("name") or m["id"][:8]},
            topology=topology,
            last_event=last_event,
            **self.base(ui, "fleet"),
        )

    def offered(
        self, ui: UiRequest, m: dict[str, Any], bmc: dict[str, Any] | None, staff: bool
    ) -> list[machine_actions.Action]:
        """The machine's actions for this caller (``api.ui.actions.offered``). ``staff``:
        the caller may see BMCs, so "no BMC" is known (an orchestrator is offered no BMC
        actions at all)."""
        if not staff:
            bmc = {"capabilities": []}  # not the caller's to see: nothing needing a BMC
        acts = machine_actions.offered(m, bmc, lambda meth, path: self.api.allows(ui, meth, path))
        return [a for a in acts if staff or a.name != "register-bmc"]

    async def names(self, ui: UiRequest, m: dict[str, Any]) -> dict[str, str]:
        """The tenant's and the claim's image name (what the page shows instead of ids)."""
        out: dict[str, str] = {}
        tid = m.get("tenant_id")
        if tid and self.api.allows(ui, "GET", "/api/v1/tenants/{id}"):
            try:
                t = await self.api.call(ui, "GET", "/api/v1/tenants/{id}", params={"id": tid})
                out["tenant"] = t.get("name") or tid
            except Refused:
                pass
        return out

    async def act(self, ui: UiRequest) -> web.StreamResponse:
        """One action of the machine page, through its API route, answered in place: JSON
        {"ok", "message", "state", "actions" (the panel's new HTML)} to the page's script (the
        page does not navigate: an open console stays attached), or the machine page again
        without script. A refusal is the API's problem, with its sentence."""
        mid = ui.raw.match_info["id"]
        form = await ui.raw.post()
        name = str(form.get("action", ""))
        action = machine_actions.ACTIONS.get(name)
        if action is None:
            return error(
                ui.raw, 422, "Unknown action", f"{name[:40]!r} is not an action of the machine page"
            )
        try:
            m = await self.api.call(ui, "GET", "/api/v1/machines/{id}", params={"id": mid})
        except Refused as r:
            return error(ui.raw, r.status, r.title, r.detail)
        label = m.get("name") or m["id"]
        if action.confirm and form.get("confirm") != "yes":
            return error(
                ui.raw,
                428,
                "Confirmation required",
                f"{action.label.lower()} on {label} {action.why}: confirm it in the dialog "
                "(the form must carry confirm=yes)",
            )
        body = machine_actions.body_of(action, m, form)
        if isinstance(body, str):
            return error(ui.raw, 422, "Missing input", body)
        params = {"id": m["id"]}
        if action.name == "release":  # the claim's route: /claims/{id}/machines/{machine_id}
            params = {"id": m.get("claim_id") or "", "machine_id": m["id"]}
        try:
            await self.api.call(ui, action.method, action.path, params=params, body=body)
        except Refused as r:
            return error(ui.raw, r.status, r.title, r.detail)
        finally:
            ui.ctx.bus.notify()
        if not wants_json(ui.raw):
            raise web.HTTPSeeOther(f"/ui/machines/{m['id']}")
        m = await self.api.call(ui, "GET", "/api/v1/machines/{id}", params={"id": m["id"]})
        staff = self.api.allows(ui, "GET", "/api/v1/bmcs")
        bmc = await _console(ui).bmc_of(m["id"]) if staff else None
        if bmc is not None:
            bmc["capabilities"] = await self.capabilities(ui, bmc["id"])
        html = fragment(
            "_machine_actions.html",
            m=m,
            actions=self.offered(ui, m, bmc, staff),
            csrf=ui.csrf,
        )
        return web.json_response(
            {
                "ok": True,
                "message": f"{action.label.lower()}: done on {m.get('name') or m['id']}",
                "state": m["state"],
                "name": m.get("name"),
                "actions": html,
            },
            headers={"Cache-Control": "no-store"},
        )

    async def capabilities(self, ui: UiRequest, bmc_id: str) -> list[str] | None:
        try:
            shown = await self.api.call(ui, "GET", "/api/v1/bmcs/{id}", params={"id": bmc_id})
        except Refused:
            return None
        caps = shown.get("capabilities")
        return None if caps is None else list(caps)

    async def sensors(self, ui: UiRequest) -> web.StreamResponse:
        """Sensors or the BMC's event log, read on demand (a BMC round trip)."""
        which = ui.raw.match_info["what"]
        path = {
            "sensors": "/api/v1/machines/{id}/sensors",
            "bmc-log": "/api/v1/machines/{id}/bmc-log",
        }[which]
        try:
            data = await self.api.call(ui, "GET", path, params={"id": ui.raw.match_info["id"]})
        except Refused as r:
            return web.Response(
                text=fragment(
                    "_problem.html",
                    problem={"status": r.status, "title": r.title, "detail": r.detail},
                ),
                status=r.status,
                content_type="text/html",
            )
        return web.Response(
            text=fragment("_readings.html", data=data, what=which), content_type="text/html"
        )

    # --- lists ---

    async def listing(
        self,
        ui: UiRequest,
        nav: str,
        path: str,
        template: str,
        query: dict[str, Any] | None = None,
        **extra: Any,
    ) -> web.StreamResponse:
        try:
            self.need(ui, "GET", path)
            data = await self.api.call(ui, "GET", path, query=query or {"limit": 200})
        except Refused as r:
            return self.refused(ui, r, nav)
        return page(template, title=nav.capitalize(), data=data, **extra, **self.base(ui, nav))

    async def claims(self, ui: UiRequest) -> web.StreamResponse:
        """Claims with their machines' progress, the tenant and image by name, and what each
        unfinished machine waits on (its newest event: ``provision.no-bmc``, a failure)."""
        console = _console(ui)
        last_event = await console.last_event_id()
        try:
            self.need(ui, "GET", "/api/v1/claims")
            data = await self.api.call(ui, "GET", "/api/v1/claims", query={"limit": 200})
        except Refused as r:
            return self.refused(ui, r, "claims")
        return page(
            "claims.html",
            title="Claims",
            data=data,
            last_event=last_event,
            **await self.claim_context(ui, data["items"]),
            **self.base(ui, "claims"),
        )

    async def claim_context(self, ui: UiRequest, claims: list[dict[str, Any]]) -> dict[str, Any]:
        console = _console(ui)
        mids = [m["id"] for c in claims for m in c["machines"] if m["state"] not in DONE]
        refs = await console.ref_names(
            sorted({c["tenant_id"] for c in claims}),
            sorted({c["image_id"] for c in claims if c.get("image_id")}),
        )
        return {"blocking": await console.latest_events(ui.principal, mids), "refs": refs}

    async def claim_fragment(self, ui: UiRequest) -> web.StreamResponse:
        try:
            c = await self.api.call(
                ui, "GET", "/api/v1/claims/{id}", params={"id": ui.raw.match_info["id"]}
            )
        except Refused as r:
            return web.Response(text=r.detail, status=r.status)
        extra = await self.claim_context(ui, [c])
        return web.Response(text=fragment("_claim.html", c=c, **extra), content_type="text/html")

    async def tenants(self, ui: UiRequest) -> web.StreamResponse:
        try:
            self.need(ui, "GET", "/api/v1/tenants")
            self.need(ui, "GET", "/api/v1/tenants/{id}/hub")
            data = await self.api.call(ui, "GET", "/api/v1/tenants", query={"limit": 200})
        except Refused as r:
            return self.refused(ui, r, "tenants")
        ids = [t["id"] for t in data["items"]]
        details = await _console(ui).tenant_details(ui.principal, ids)
        return page(
            "tenants.html",
            title="Tenants",
            data=data,
            hubs=details.hubs,
            nodes=details.nodes,
            **self.base(ui, "tenants"),
        )

    async def events(self, ui: UiRequest) -> web.StreamResponse:
        q = {k: v for k in ("machine_id", "kind") if (v := ui.raw.query.get(k, "").strip())}
        machine: dict[str, Any] | None = None
        try:
            self.need(ui, "GET", "/api/v1/events")
            if "machine_id" in q:  # a name, an id or an 8+ prefix: the live tail needs the id
                machine = await self.api.call(
                    ui, "GET", "/api/v1/machines/{id}", params={"id": q["machine_id"]}
                )
            data = await self.api.call(
                ui, "GET", "/api/v1/events", query={**q, "sort": "-id", "limit": 100}
            )
        except Refused as r:
            return self.refused(ui, r, "events")
        last = max((e["id"] for e in data["items"]), default=0)
        last = max(last, await _console(ui).last_event_id())
        return page(
            "events.html",
            title="Events",
            data=data,
            filters=q,
            machine=machine,
            mnames=await _console(ui).names_of(
                ui.principal, sorted({e["machine_id"] for e in data["items"] if e["machine_id"]})
            ),
            last_event=last,
            **self.base(ui, "events"),
        )

    async def repairs(
        self, ui: UiRequest, *, problem: dict[str, Any] | None = None, done: str | None = None
    ) -> web.StreamResponse:
        """The repair queue: machine, rack position, fault, evidence, part, who took it, and
        the actions the caller's role allows (the API's own routes)."""
        f = RepairFilter.from_params(ui.raw.query)
        if done is None and (last := ui.raw.query.get("done", "").strip()[:80]):
            done = f"Done: {last}"
        try:
            self.need(ui, "GET", "/api/v1/repairs")
            data = await self.api.call(ui, "GET", "/api/v1/repairs", query=f.query())
        except Refused as r:
            return self.refused(ui, r, "repairs")
        return page(
            "repairs.html",
            status=problem["status"] if problem else 200,
            title="Repairs",
            data=data,
            f=f,
            problem=problem,
            done=done,
            can_act=self.api.allows(ui, "POST", "/api/v1/repairs/{id}/take"),
            **self.base(ui, "repairs"),
        )

    async def repair_action(self, ui: UiRequest) -> web.StreamResponse:
        """Take, note, repaired or release, through the API's route; back to the queue (303) or the
        queue with the API's refusal."""
        rid, action = ui.raw.match_info["id"], ui.raw.match_info["action"]
        form = await ui.raw.post()
        body: dict[str, Any] | None = None
        if action == "note":
            body = {"text": str(form.get("text", "")).strip()[:2000]}
        elif action == "repaired":
            body = {}
        try:
            r = await self.api.call(
                ui, "POST", f"/api/v1/repairs/{{id}}/{action}", params={"id": rid}, body=body
            )
        except Refused as e:
            return await self.repairs(
                ui, problem={"status": e.status, "title": e.title, "detail": e.detail}
            )
        finally:
            ui.ctx.bus.notify()
        name = (r.get("machine") or {}).get("name") or r["machine_id"][:8]
        raise web.HTTPSeeOther(f"/ui/repairs?status=open&done={action}+{name}")

    async def topology(self, ui: UiRequest) -> web.StreamResponse:
        """NVLink domains with their trays, and the InfiniBand leaves (docs/inventory.md)."""
        try:
            self.need(ui, "GET", "/api/v1/ib-fabric")
            leaves = await self.api.call(ui, "GET", "/api/v1/ib-fabric")
        except Refused as r:
            return self.refused(ui, r, "topology")
        return await self.listing(
            ui, "topology", "/api/v1/nvlink-domains", "topology.html", query={}, leaves=leaves
        )

    async def instances(self, ui: UiRequest) -> web.StreamResponse:
        return await self.listing(ui, "instances", "/api/v1/instances", "instances.html")

    async def firmware(self, ui: UiRequest) -> web.StreamResponse:
        """Firmware rollouts with their progress, and the machines off their profile's
        firmware baseline (docs/firmware.md)."""
        try:
            self.need(ui, "GET", "/api/v1/firmware/rollouts")
            rollouts = await self.api.call(
                ui, "GET", "/api/v1/firmware/rollouts", query={"limit": 20}
            )
        except Refused as r:
            return self.refused(ui, r, "firmware")
        return await self.listing(
            ui, "firmware", "/api/v1/firmware/compliance", "firmware.html", rollouts=rollouts
        )

    async def tokens(self, ui: UiRequest) -> web.StreamResponse:
        """API tokens, their scopes by name (tenants for orchestrators, machines for agents)."""
        try:
            self.need(ui, "GET", "/api/v1/tokens")
            data = await self.api.call(ui, "GET", "/api/v1/tokens", query={"limit": 200})
        except Refused as r:
            return self.refused(ui, r, "tokens")
        ids = sorted({i for t in data["items"] for i in t.get("scope") or []})
        console = _console(ui)
        scoped = await console.ref_names(ids, []) | await console.names_of(ui.principal, ids)
        return page(
            "tokens.html", title="Tokens", data=data, scoped=scoped, **self.base(ui, "tokens")
        )


class RepairFilter:
    """The repair page's filters (its query parameters), as the API's list query."""

    STATUSES = ("open", "taken", "verifying", "closed", "all")

    def __init__(
        self, status: str, rack: str | None, taken_by: str | None, machine: str | None = None
    ) -> None:
        self.status, self.rack, self.taken_by, self.machine = status, rack, taken_by, machine

    @classmethod
    def from_params(cls, q: Any) -> RepairFilter:
        status = q.get("status", "open")
        return cls(
            status if status in cls.STATUSES else "open",
            (q.get("rack") or "").strip()[:128] or None,
            (q.get("taken_by") or "").strip()[:128] or None,
            (q.get("machine") or "").strip()[:128] or None,
        )

    def query(self) -> dict[str, Any]:
        q: dict[str, Any] = {"status": self.status, "limit": 200}
        if self.rack:
            q["rack"] = self.rack
        if self.taken_by:
            q["taken_by"] = self.taken_by
        if self.machine:
            q["machine"] = self.machine
        return q


def _safe_next(target: str | None) -> str:
    """Only a console path (no open redirect to another site)."""
    if not target or not target.startswith("/ui/") or target.startswith("//") or "\\" in target:
        return "/ui/"
    return target


def _console(ui: UiRequest) -> Console:
    """The console's own reads (``metald.usecases.console``)."""
    return Console(ui.ctx.store)
