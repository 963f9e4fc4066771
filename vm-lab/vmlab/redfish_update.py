"""The lab Redfish BMC's firmware updates: ``UpdateService`` (SimpleUpdate, where the BMC pulls
the image by URL, and a ``MultipartHttpPushUri`` a client pushes the image to), a
``TaskService`` whose tasks report progress, and a ``FirmwareInventory`` whose versions change
only once the new firmware is applied: the host's firmware (BIOS, NIC ROM) at the machine's
next reset through this BMC, the BMC's own at a ``Manager.Reset``.

A lab image is a first line ``VMLAB-FIRMWARE {"item": ..., "version": ..., "sha256": ...}``
and a payload whose SHA-256 the header names: the BMC refuses an image whose payload does not
match (as real BMCs check a signature) or that is for another item than the update targets.

Faults a test injects (``UpdateState.faults``): ``checksum`` (the BMC finds the image corrupt),
``timeout`` (the task stops making progress), ``bmc-reboot`` (mid-flash the BMC restarts: it
answers 503 for ``reboot_s``, then the task carries on where it was).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from vmlab import redfish_events
from vmlab.redfish_json import ODATA, collection
from vmlab.redfish_json import error as _error
from vmlab.redfish_json import json_response as _json

UPDATE = "/redfish/v1/UpdateService"
INVENTORY = UPDATE + "/FirmwareInventory"
PUSH = UPDATE + "/upload"
TASKS = "/redfish/v1/TaskService/Tasks"
MAGIC = b"VMLAB-FIRMWARE "
#: The largest image the lab BMC takes.
MAX_IMAGE = 64 << 20
#: How each item's new firmware is applied: at the host's reset, or at the BMC's own.
HOST_ITEMS = ("BIOS", "NIC.1")
BMC_ITEMS = ("BMC",)


def make_image(item: str, version: str, payload: bytes = b"", *, corrupt: bool = False) -> bytes:
    """A lab firmware image for ``item`` at ``version`` (``corrupt``: its checksum lies)."""
    body = payload or f"{item} {version} ".encode() * 64
    digest = hashlib.sha256(body + (b"x" if corrupt else b"")).hexdigest()
    header = json.dumps({"item": item, "version": version, "sha256": digest}).encode()
    return MAGIC + header + b"\n" + body


@dataclass
class Task:
    id: str
    item: str
    payload: dict[str, Any]
    state: str = "New"
    status: str = "OK"
    percent: int = 0
    messages: list[str] = field(default_factory=list)
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    ended: str | None = None

    def end(self, state: str, status: str, message: str) -> None:
        self.state, self.status = state, status
        self.messages.append(message)
        self.ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class UpdateState:
    firmware: str  # "bios" or "uefi"
    versions: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: item -> version written, applied at the next reset (host's or BMC's).
    pending: dict[str, str] = field(default_factory=dict)
    tasks: dict[str, Task] = field(default_factory=dict)
    #: Injected: "checksum", "timeout", "bmc-reboot" (each used once, then cleared).
    faults: set[str] = field(default_factory=set)
    #: Seconds a flash takes (progress in ten steps) and a BMC reboot lasts.
    flash_s: float = 1.0
    reboot_s: float = 1.5
    rebooting_until: float = 0.0
    #: Every image accepted for flashing, in order (item, version): a test counts flashes.
    flashed: list[tuple[str, str]] = field(default_factory=list)
    _next: int = 1
    _runs: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.versions:
            fw = ("SeaBIOS", "1.16.2") if self.firmware == "bios" else ("OVMF", "2022.11")
            self.versions = {
                "BMC": ("vm-lab virtual BMC", "1.4.0"),
                "BIOS": fw,
                "NIC.1": ("virtio-net iPXE ROM", "1.21.1"),
            }

    def host_reset(self) -> None:
        """The machine restarted through this BMC: host firmware written meanwhile applies."""
        self._apply(HOST_ITEMS)

    def bmc_reset(self) -> None:
        self._apply(BMC_ITEMS)
        self.rebooting_until = time.monotonic() + self.reboot_s

    def _apply(self, items: tuple[str, ...]) -> None:
        for item in items:
            if item in self.pending:
                name, _ = self.versions[item]
                self.versions[item] = (name, self.pending.pop(item))

    def new_task(self, item: str, payload: dict[str, Any]) -> Task:
        task = Task(str(self._next), item, payload)
        self._next += 1
        self.tasks[task.id] = task
        return task

    def run(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._runs.add(t)
        t.add_done_callback(self._runs.discard)

    async def close(self) -> None:
        for t in list(self._runs):
            t.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)


UPDATES = web.AppKey("updates", UpdateState)


@web.middleware
async def rebooting(request: web.Request, handler: Any) -> web.StreamResponse:
    """While the BMC restarts it answers nothing useful (503), as a real one does."""
    state = request.app.get(UPDATES)
    if state is not None and time.monotonic() < state.rebooting_until:
        return _error(503, "ServiceTemporarilyUnavailable", "the BMC is restarting")
    return await handler(request)


def parse_image(data: bytes) -> tuple[str, str]:
    """(item, version) of a lab image; ValueError naming what is wrong."""
    if not data.startswith(MAGIC) or b"\n" not in data:
        raise ValueError("not a firmware image for this BMC")
    head, body = data[len(MAGIC) :].split(b"\n", 1)
    try:
        meta = json.loads(head)
        item, version, digest = meta["item"], meta["version"], meta["sha256"]
    except (ValueError, KeyError, TypeError):
        raise ValueError("the image header is unreadable") from None
    if hashlib.sha256(body).hexdigest() != digest:
        raise ValueError("the image failed its integrity check (SHA-256 mismatch)")
    return str(item), str(version)


async def _flash(state: UpdateState, task: Task, data: bytes | None, url: str | None) -> None:
    task.state = "Running"
    if data is None:
        assert url is not None
        task.messages.append(f"downloading {url}")
        try:
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as r:
                if r.status != 200:
                    task.end("Exception", "Critical", f"image download failed: HTTP {r.status}")
                    return
                data = await r.content.read(MAX_IMAGE + 1)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            task.end("Exception", "Critical", f"image download failed: {type(e).__name__}")
            return
        if len(data) > MAX_IMAGE:
            task.end("Exception", "Critical", "the image is larger than this BMC takes")
            return
    try:
        if "checksum" in state.faults:
            state.faults.discard("checksum")
            raise ValueError("the image failed its integrity check (SHA-256 mismatch)")
        item, version = parse_image(data)
    except ValueError as e:
        task.end("Exception", "Critical", str(e))
        return
    if item != task.item:
        task.end("Exception", "Critical", f"the image is for {item}, not {task.item}")
        return
    state.flashed.append((item, version))
    for step in range(1, 11):
        await asyncio.sleep(state.flash_s / 10)
        if step == 5 and "timeout" in state.faults:
            state.faults.discard("timeout")
            task.messages.append("flash stalled")
            return  # Running forever at 40 %: the client's deadline must end it
        if step == 3 and "bmc-reboot" in state.faults:
            state.faults.discard("bmc-reboot")
            state.rebooting_until = time.monotonic() + state.reboot_s
            await asyncio.sleep(state.reboot_s)
        task.percent = step * 10
    state.pending[item] = version
    when = "the BMC's next reset" if item in BMC_ITEMS else "the system's next reset"
    task.end("Completed", "OK", f"{item} {version} written; it takes effect at {when}")


def _task_body(task: Task) -> dict[str, Any]:
    path = f"{TASKS}/{task.id}"
    body: dict[str, Any] = {
        "@odata.type": "#Task.v1_5_0.Task",
        "@odata.id": path,
        "Id": task.id,
        "Name": f"Update {task.item}",
        "TaskState": task.state,
        "TaskStatus": task.status,
        "PercentComplete": task.percent,
        "StartTime": task.started,
        "TaskMonitor": f"{path}/Monitor",
        "Payload": task.payload,
        "Messages": [
            {"@odata.type": "#Message.v1_1_1.Message", "MessageId": "Update.1.0.UpdateInProgress"
             if task.state == "Running" else "Base.1.8.Success", "Message": m, "Severity": "OK"}
            for m in task.messages[-8:]
        ],
    }  # fmt: skip
    if task.ended:
        body["EndTime"] = task.ended
    return body


def _targets_item(state: UpdateState, targets: Any) -> str | web.Response:
    if not isinstance(targets, list) or len(targets) != 1 or not isinstance(targets[0], str):
        return _error(400, "ActionParameterMissing", "Targets: one FirmwareInventory URI")
    item = targets[0].rstrip("/").rsplit("/", 1)[-1]
    if not targets[0].startswith(INVENTORY + "/") or item not in state.versions:
        return _error(400, "ActionParameterValueNotInList", f"no updatable target {targets[0]!r}")
    return item


def _accepted(task: Task) -> web.Response:
    return _json(_task_body(task), 202, {"Location": f"{TASKS}/{task.id}/Monitor"})


async def simple_update(request: web.Request) -> web.Response:
    state = request.app[UPDATES]
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "MalformedJSON", "the request body is not valid JSON")
    if not isinstance(body, dict) or not isinstance(body.get("ImageURI"), str):
        return _error(400, "ActionParameterMissing", "SimpleUpdate needs ImageURI")
    uri = body["ImageURI"]
    if body.get("TransferProtocol", "HTTP") not in ("HTTP", "HTTPS") or not uri.startswith(
        ("http://", "https://")
    ):
        return _error(400, "ActionParameterNotSupported", "only HTTP(S) image URIs")
    item = _targets_item(state, body.get("Targets"))
    if isinstance(item, web.Response):
        return item
    task = state.new_task(
        item,
        {"HttpOperation": "POST", "TargetUri": request.path, "JsonBody": json.dumps(body),
         "HttpHeaders": []},
    )  # fmt: skip
    state.run(_flash(state, task, None, uri))
    return _accepted(task)


async def multipart_push(request: web.Request) -> web.Response:
    state = request.app[UPDATES]
    if not request.content_type.startswith("multipart/form-data"):
        return _error(415, "UnsupportedMediaType", "multipart/form-data with UpdateFile")
    params: dict[str, Any] | None = None
    data: bytes | None = None
    reader = await request.multipart()
    while (part := await reader.next()) is not None:
        if not isinstance(part, aiohttp.BodyPartReader):
            continue
        if part.name == "UpdateParameters":
            try:
                params = json.loads(await part.read())
            except ValueError:
                return _error(400, "MalformedJSON", "UpdateParameters is not JSON")
        elif part.name == "UpdateFile":
            data = bytes(await part.read())
            if len(data) > MAX_IMAGE:
                return _error(413, "PayloadTooLarge", "the image is larger than this BMC takes")
    if params is None or data is None:
        return _error(400, "ActionParameterMissing", "UpdateParameters and UpdateFile")
    item = _targets_item(state, params.get("Targets"))
    if isinstance(item, web.Response):
        return item
    task = state.new_task(
        item,
        {"HttpOperation": "POST", "TargetUri": request.path, "JsonBody": json.dumps(params),
         "HttpHeaders": []},
    )  # fmt: skip
    state.run(_flash(state, task, data, None))
    return _accepted(task)


async def update_service(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#UpdateService.v1_11_0.UpdateService",
            "@odata.id": UPDATE,
            "Id": "UpdateService",
            "Name": "Update Service",
            "ServiceEnabled": True,
            "Status": {"State": "Enabled", "Health": "OK"},
            "FirmwareInventory": {"@odata.id": INVENTORY},
            "MultipartHttpPushUri": PUSH,
            "MaxImageSizeBytes": MAX_IMAGE,
            "Actions": {
                "#UpdateService.SimpleUpdate": {
                    "target": UPDATE + "/Actions/UpdateService.SimpleUpdate",
                    "TransferProtocol@Redfish.AllowableValues": ["HTTP", "HTTPS"],
                }
            },
        }
    )


async def firmware_inventory(request: web.Request) -> web.Response:
    items = request.app[UPDATES].versions
    return _json(
        {
            "@odata.type": "#SoftwareInventoryCollection.SoftwareInventoryCollection",
            "@odata.id": INVENTORY,
            "Name": "Firmware Inventory",
            "Members@odata.count": len(items),
            "Members": [{"@odata.id": f"{INVENTORY}/{k}"} for k in items],
        }
    )


async def firmware_item(request: web.Request) -> web.Response:
    items = request.app[UPDATES].versions
    key = request.match_info["item"]
    if key not in items:
        return _error(404, "ResourceMissingAtURI", f"no firmware item {key!r}")
    name, version = items[key]
    return _json(
        {
            "@odata.type": "#SoftwareInventory.v1_3_0.SoftwareInventory",
            "@odata.id": f"{INVENTORY}/{key}",
            "Id": key,
            "Name": name,
            "Version": version,
            "Updateable": True,
            "Status": {"State": "Enabled", "Health": "OK"},
        }
    )


async def task_service(request: web.Request) -> web.Response:
    return _json(
        {
            "@odata.type": "#TaskService.v1_2_0.TaskService",
            "@odata.id": "/redfish/v1/TaskService",
            "Id": "TaskService",
            "Name": "Task Service",
            "ServiceEnabled": True,
            "CompletedTaskOverWritePolicy": "Oldest",
            "LifeCycleEventOnTaskStateChange": False,
            "Status": {"State": "Enabled", "Health": "OK"},
            "Tasks": {"@odata.id": TASKS},
        }
    )


async def tasks(request: web.Request) -> web.Response:
    ids = list(request.app[UPDATES].tasks)
    return collection("#TaskCollection.TaskCollection", TASKS, "Task Collection", ids)


async def task(request: web.Request) -> web.Response:
    t = request.app[UPDATES].tasks.get(request.match_info["task_id"])
    if t is None:
        return _error(404, "ResourceMissingAtURI", f"no task at {request.path}")
    return _json(_task_body(t))


async def task_monitor(request: web.Request) -> web.Response:
    """202 and the task while it runs; once it has ended, the task with 200 (the operation's
    own answer carries nothing more here)."""
    t = request.app[UPDATES].tasks.get(request.match_info["task_id"])
    if t is None:
        return _error(404, "ResourceMissingAtURI", f"no task at {request.path}")
    running = t.state in ("New", "Running")
    headers = {"Location": f"{TASKS}/{t.id}/Monitor"} if running else {}
    return _json(_task_body(t), 202 if running else 200, headers)


async def manager_reset(request: web.Request) -> web.Response:
    if request.match_info["manager_id"] != "BMC":
        return _error(404, "ResourceMissingAtURI", f"no manager at {request.path}")
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "MalformedJSON", "the request body is not valid JSON")
    if not isinstance(body, dict) or body.get("ResetType", "GracefulRestart") not in (
        "GracefulRestart",
        "ForceRestart",
    ):
        return _error(400, "ActionParameterValueNotInList", "ResetType: GracefulRestart")
    request.app[UPDATES].bmc_reset()
    if redfish_events.EVENTS in request.app:  # a restarted BMC forgets its subscriptions
        request.app[redfish_events.EVENTS].lose_subscriptions()
    return web.Response(status=204, headers=ODATA)


def install(app: web.Application, firmware: str) -> UpdateState:
    """Add the update, task and firmware-inventory resources (and ``rebooting``'s state)."""
    state = app[UPDATES] = UpdateState(firmware)
    app.router.add_get(UPDATE, update_service)
    app.router.add_post(UPDATE + "/Actions/UpdateService.SimpleUpdate", simple_update)
    app.router.add_post(PUSH, multipart_push)
    app.router.add_get(INVENTORY, firmware_inventory)
    app.router.add_get(INVENTORY + "/{item}", firmware_item)
    app.router.add_get("/redfish/v1/TaskService", task_service)
    app.router.add_get(TASKS, tasks)
    app.router.add_get(TASKS + "/{task_id}", task)
    app.router.add_get(TASKS + "/{task_id}/Monitor", task_monitor)
    app.router.add_post("/redfish/v1/Managers/{manager_id}/Actions/Manager.Reset", manager_reset)

    async def stop(_: web.Application) -> None:
        await state.close()

    app.on_cleanup.append(stop)
    return state
