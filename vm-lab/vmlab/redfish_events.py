"""The lab Redfish BMC's event log and EventService.

- ``/redfish/v1/Managers/BMC/LogServices/SEL`` with its ``Entries`` (``LogEntry``), what
  ``metald.bmc.redfish.RedfishDriver.event_log`` reads;
- ``/redfish/v1/EventService`` with its ``Subscriptions``: ``POST`` a subscription
  (``Destination``, ``EventTypes`` or ``RegistryPrefixes``, ``Context``, ``HttpHeaders``,
  ``Protocol`` ``Redfish``) answers 201 with its ``Location``; ``DELETE`` ends it. The
  ``HttpHeaders`` are kept and sent with each event but never shown on a ``GET`` (DSP0266);
- each entry added (``EventLog.add``: the lab's fault injection, or the lab-only ``POST`` to
  ``Entries``) is pushed to every subscription as a standard ``#Event.v1_7_0.Event`` whose
  ``OriginOfCondition`` links the new ``LogEntry``. A push that fails is dropped (the log keeps
  the entry; a subscriber that polls finds it there);
- a BMC restart (``Manager.Reset``) loses the subscriptions, as many real BMCs do.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from vmlab.redfish_json import collection, error, json_response

log = logging.getLogger("vmlab.redfish")

SERVICE = "/redfish/v1/EventService"
SUBSCRIPTIONS = SERVICE + "/Subscriptions"
LOG_SERVICES = "/redfish/v1/Managers/BMC/LogServices"
SEL = LOG_SERVICES + "/SEL"
ENTRIES = SEL + "/Entries"
#: Subscriptions one BMC keeps at most, entries its log keeps (the oldest go first).
MAX_SUBSCRIPTIONS = 8
MAX_ENTRIES = 512
SEVERITIES = ("OK", "Warning", "Critical")
EVENT_TYPES = ["Alert"]
PUSH_TIMEOUT_S = 5.0


@dataclass
class Subscription:
    id: str
    destination: str
    context: str
    headers: dict[str, str]
    event_types: list[str]
    registry_prefixes: list[str]


@dataclass
class Entry:
    id: str
    created: str
    severity: str
    message: str
    message_id: str


@dataclass
class EventLog:
    subscriptions: dict[str, Subscription] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    #: Every push tried: (subscription id, HTTP status or 0 for no answer).
    pushes: list[tuple[str, int]] = field(default_factory=list)
    _next_sub: int = 1
    _next_entry: int = 1
    _runs: set[asyncio.Task[None]] = field(default_factory=set)
    _http: aiohttp.ClientSession | None = None

    def subscribe(self, sub: Subscription) -> None:
        while len(self.subscriptions) >= MAX_SUBSCRIPTIONS:
            self.subscriptions.pop(next(iter(self.subscriptions)))
        self.subscriptions[sub.id] = sub

    def new_sub_id(self) -> str:
        sid = str(self._next_sub)
        self._next_sub += 1
        return sid

    def add(self, message: str, severity: str = "Critical",
            message_id: str = "EventLog.1.0.SensorEvent") -> Entry:  # fmt: skip
        """A log entry, pushed to every subscription (in the background)."""
        e = Entry(str(self._next_entry), _now(), severity, message, message_id)
        self._next_entry += 1
        self.entries = [*self.entries, e][-MAX_ENTRIES:]
        for sub in list(self.subscriptions.values()):
            t = asyncio.get_running_loop().create_task(self._push(sub, e))
            self._runs.add(t)
            t.add_done_callback(self._runs.discard)
        return e

    def lose_subscriptions(self) -> None:
        self.subscriptions.clear()

    async def _push(self, sub: Subscription, e: Entry) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PUSH_TIMEOUT_S))
        try:
            async with self._http.post(sub.destination, json=event_body(sub, e),
                                       headers=sub.headers) as r:  # fmt: skip
                await r.read()
                self.pushes.append((sub.id, r.status))
        except (aiohttp.ClientError, TimeoutError, OSError) as ex:
            log.info("event push to %s failed: %s", sub.destination, ex)
            self.pushes.append((sub.id, 0))

    async def idle(self) -> None:
        """Until every push started so far has ended."""
        while self._runs:
            await asyncio.gather(*list(self._runs), return_exceptions=True)

    async def close(self) -> None:
        for t in list(self._runs):
            t.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)
        if self._http is not None:
            await self._http.close()


EVENTS = web.AppKey("events", EventLog)


def _now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def entry_resource(e: Entry) -> dict[str, Any]:
    return {
        "@odata.type": "#LogEntry.v1_4_0.LogEntry",
        "@odata.id": f"{ENTRIES}/{e.id}",
        "Id": e.id,
        "Name": f"Log Entry {e.id}",
        "EntryType": "Event",
        "Severity": e.severity,
        "Created": e.created,
        "Message": e.message,
        "MessageId": e.message_id,
    }


def event_body(sub: Subscription, e: Entry) -> dict[str, Any]:
    return {
        "@odata.type": "#Event.v1_7_0.Event",
        "Id": e.id,
        "Name": "vm-lab BMC event",
        "Context": sub.context,
        "Events": [
            {
                "EventType": "Alert",
                "EventId": e.id,
                "EventTimestamp": e.created,
                "Severity": e.severity,
                "MessageSeverity": e.severity,
                "Message": e.message,
                "MessageId": e.message_id,
                "OriginOfCondition": {"@odata.id": f"{ENTRIES}/{e.id}"},
                "LogEntry": {"@odata.id": f"{ENTRIES}/{e.id}"},
            }
        ],
    }


async def event_service(request: web.Request) -> web.Response:
    return json_response(
        {
            "@odata.type": "#EventService.v1_5_0.EventService",
            "@odata.id": SERVICE,
            "Id": "EventService",
            "Name": "Event Service",
            "ServiceEnabled": True,
            "DeliveryRetryAttempts": 0,
            "DeliveryRetryIntervalSeconds": 0,
            "EventTypesForSubscription": EVENT_TYPES,
            "RegistryPrefixes": ["EventLog"],
            "Status": {"State": "Enabled", "Health": "OK"},
            "Subscriptions": {"@odata.id": SUBSCRIPTIONS},
        }
    )


async def subscriptions(request: web.Request) -> web.Response:
    return collection(
        "#EventDestinationCollection.EventDestinationCollection",
        SUBSCRIPTIONS,
        "Event Subscriptions",
        request.app[EVENTS].subscriptions,
    )


def _sub_resource(sub: Subscription) -> dict[str, Any]:
    return {
        "@odata.type": "#EventDestination.v1_7_0.EventDestination",
        "@odata.id": f"{SUBSCRIPTIONS}/{sub.id}",
        "Id": sub.id,
        "Name": f"Subscription {sub.id}",
        "Destination": sub.destination,
        "Context": sub.context,
        "Protocol": "Redfish",
        "EventTypes": sub.event_types,
        "RegistryPrefixes": sub.registry_prefixes,
        "HttpHeaders": [],  # never shown back (DSP0266)
        "SubscriptionType": "RedfishEvent",
    }


async def subscription(request: web.Request) -> web.Response:
    sub = request.app[EVENTS].subscriptions.get(request.match_info["sub_id"])
    if sub is None:
        return error(404, "ResourceMissingAtURI", f"no resource at {request.path}")
    return json_response(_sub_resource(sub))


def _strings(v: Any, limit: int = 16) -> list[str] | None:
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > limit or not all(isinstance(x, str) for x in v):
        return None
    return list(v)


async def subscribe(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return error(400, "MalformedJSON", "the request body is not JSON")
    if not isinstance(body, dict):
        return error(400, "MalformedJSON", "the request body must be a JSON object")
    dest = body.get("Destination")
    if not isinstance(dest, str) or urlsplit(dest).scheme not in ("http", "https"):
        return error(400, "PropertyValueFormatError", "Destination must be an http(s) URI")
    if body.get("Protocol", "Redfish") != "Redfish":
        return error(400, "PropertyValueNotInList", "Protocol must be Redfish")
    types, prefixes = _strings(body.get("EventTypes")), _strings(body.get("RegistryPrefixes"))
    if types is None or prefixes is None or any(t not in EVENT_TYPES for t in types):
        return error(400, "PropertyValueNotInList", f"EventTypes must be among {EVENT_TYPES}")
    headers: dict[str, str] = {}
    raw = body.get("HttpHeaders") or []
    if not isinstance(raw, list) or len(raw) > 8:
        return error(400, "PropertyValueFormatError", "HttpHeaders must be a list of objects")
    for h in raw:
        if not isinstance(h, dict) or not all(isinstance(v, str) for v in h.values()):
            return error(400, "PropertyValueFormatError", "HttpHeaders must map names to strings")
        headers.update(h)
    context = body.get("Context", "")
    if not isinstance(context, str) or len(context) > 256:
        return error(400, "PropertyValueFormatError", "Context must be a string")
    state = request.app[EVENTS]
    sub = Subscription(state.new_sub_id(), dest, context, headers, types, prefixes)
    state.subscribe(sub)
    return json_response(_sub_resource(sub), 201, {"Location": f"{SUBSCRIPTIONS}/{sub.id}"})


async def unsubscribe(request: web.Request) -> web.Response:
    if request.app[EVENTS].subscriptions.pop(request.match_info["sub_id"], None) is None:
        return error(404, "ResourceMissingAtURI", f"no resource at {request.path}")
    return web.Response(status=204)


async def log_services(request: web.Request) -> web.Response:
    return collection(
        "#LogServiceCollection.LogServiceCollection", LOG_SERVICES, "Log Services", ["SEL"]
    )


async def log_service(request: web.Request) -> web.Response:
    return json_response(
        {
            "@odata.type": "#LogService.v1_1_0.LogService",
            "@odata.id": SEL,
            "Id": "SEL",
            "Name": "System Event Log",
            "MaxNumberOfRecords": MAX_ENTRIES,
            "OverWritePolicy": "WrapsWhenFull",
            "ServiceEnabled": True,
            "Status": {"State": "Enabled", "Health": "OK"},
            "Entries": {"@odata.id": ENTRIES},
        }
    )


async def entries(request: web.Request) -> web.Response:
    members = [entry_resource(e) for e in request.app[EVENTS].entries]
    return json_response(
        {
            "@odata.type": "#LogEntryCollection.LogEntryCollection",
            "@odata.id": ENTRIES,
            "Name": "System Event Log Entries",
            "Members@odata.count": len(members),
            "Members": members,
        }
    )


async def entry(request: web.Request) -> web.Response:
    for e in request.app[EVENTS].entries:
        if e.id == request.match_info["entry_id"]:
            return json_response(entry_resource(e))
    return error(404, "ResourceMissingAtURI", f"no resource at {request.path}")


async def add_entry(request: web.Request) -> web.Response:
    """Lab only (fault injection, behind the BMC's credentials): ``{"Message", "Severity"}``."""
    try:
        body = await request.json()
    except ValueError:
        return error(400, "MalformedJSON", "the request body is not JSON")
    msg, sev = body.get("Message") if isinstance(body, dict) else None, None
    if isinstance(body, dict):
        sev = body.get("Severity", "Critical")
    if not isinstance(msg, str) or not msg or len(msg) > 512 or sev not in SEVERITIES:
        return error(400, "PropertyValueFormatError",
                     f"Message (text) and Severity (one of {SEVERITIES}) are required")  # fmt: skip
    e = request.app[EVENTS].add(msg, sev)
    return json_response(entry_resource(e), 201, {"Location": f"{ENTRIES}/{e.id}"})


async def _close(app: web.Application) -> None:
    await app[EVENTS].close()


def install(app: web.Application) -> EventLog:
    state = EventLog()
    app[EVENTS] = state
    app.router.add_get(SERVICE, event_service)
    app.router.add_get(SUBSCRIPTIONS, subscriptions)
    app.router.add_post(SUBSCRIPTIONS, subscribe)
    app.router.add_get(SUBSCRIPTIONS + "/{sub_id}", subscription)
    app.router.add_delete(SUBSCRIPTIONS + "/{sub_id}", unsubscribe)
    app.router.add_get(LOG_SERVICES, log_services)
    app.router.add_get(SEL, log_service)
    app.router.add_get(ENTRIES, entries)
    app.router.add_post(ENTRIES, add_entry)
    app.router.add_get(ENTRIES + "/{entry_id}", entry)
    app.on_cleanup.append(_close)
    return state
