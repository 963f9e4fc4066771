"""The ``redfish`` driver on aiohttp.

Finds its ComputerSystem through the Systems collection (the first member unless one is
named), resets it only with the ResetType values the BMC advertises, sets a boot source
override Once or Continuous, and follows 202 task monitors to their end. It logs in with a
Redfish session (X-Auth-Token) and falls back to HTTP basic auth where the BMC has no session
service or refuses to create one. TLS is verified against the system store, a pinned per-BMC CA,
or not at all when the BMC is registered with verify off.

Every URL the BMC hands back (members, action targets, session and task ``Location``) is
followed only on the BMC's own scheme, host and port: a relative path, or an absolute URL of
that same origin. Anything else is refused (``BmcProtocolError``, counted in
``metald_bmc_redfish_foreign_urls_total``) before a byte is sent, so a hostile BMC cannot send
metald's credentials (session login body, basic auth, X-Auth-Token) to another host.

VirtualMedia (insert an ISO by URL into the BMC's virtual CD, boot from it once, eject it) goes
through the same requests, so the same guards hold. The virtual CD is looked for under the
system (newer Redfish) and under its managers (older). The fenced, journaled commands that use
it are ``metald.bmc.media``'s.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from prometheus_client import Counter
from yarl import URL

from metald.bmc.base import (
    BiosSettings,
    BmcAccount,
    BmcAuthError,
    BmcDriver,
    BmcEndpoint,
    BmcProtocolError,
    BmcTimeout,
    BmcUnreachable,
    BmcUnsupported,
    BootDevice,
    BootTarget,
    FirmwareItem,
    LogEntry,
    PowerAction,
    PowerState,
    SecureBootState,
    Sensor,
    SystemIdentity,
    UpdateTask,
)
from metald.bmc.capabilities import Capability

log = logging.getLogger(__name__)

#: Preferred ResetType values per action, best first; the first one the BMC advertises wins.
RESET_CHOICES: dict[PowerAction, tuple[str, ...]] = {
    PowerAction.ON: ("On", "ForceOn"),
    PowerAction.OFF: ("ForceOff",),
    PowerAction.SOFT_OFF: ("GracefulShutdown",),
    PowerAction.CYCLE: ("PowerCycle", "ForceRestart", "GracefulRestart"),
    PowerAction.RESET: ("ForceRestart", "PowerCycle"),
}
_TASK_DONE = {"Completed", "Exception", "Killed", "Cancelled"}
#: VirtualMedia devices metald boots from.
CD_TYPES = {"CD", "DVD"}

foreign_urls = Counter(
    "metald_bmc_redfish_foreign_urls_total",
    "URLs a Redfish BMC handed back that point off the BMC (refused, never followed)",
)


def same_origin_url(base: URL, link: str) -> URL | None:
    """``link`` resolved against the BMC's ``base`` when it stays on base's scheme, host and
    port (a path starting with one "/", or an absolute URL of the same origin); else None."""
    if link.startswith("/") and not link.startswith("//") and "\\" not in link:
        url = base.join(URL(link, encoded=True))
    else:
        try:
            url = URL(link)
        except ValueError:
            return None
        if not url.is_absolute() or url.user is not None or url.password is not None:
            return None
    if (url.scheme, url.host, url.port) != (base.scheme, base.host, base.port):
        return None
    return url


class RedfishDriver(BmcDriver):
    protocol = "redfish"
    capabilities = frozenset(
        {
            Capability.POWER,
            Capability.BOOT_DEVICE,
            Capability.INDICATOR,
            Capability.SENSORS,
            Capability.EVENT_LOG,
            Capability.EVENT_PUSH,
            Capability.FIRMWARE,
            Capability.FIRMWARE_UPDATE,
            Capability.ACCOUNTS,
            Capability.BIOS,
            Capability.SECURE_BOOT,
            Capability.VIRTUAL_MEDIA,
        }
    )

    def __init__(
        self,
        endpoint: BmcEndpoint,
        *,
        scheme: str = "https",
        system: str | None = None,
        request_timeout_s: float = 10.0,
        task_poll_s: float = 0.5,
    ) -> None:
        self.ep = endpoint
        port = endpoint.port or (443 if scheme == "https" else 80)
        host = endpoint.address.strip("[]")
        self.base = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
        self._origin = URL(self.base)
        self.system_hint = system
        self.request_timeout_s = request_timeout_s
        self.task_poll_s = task_poll_s
        self._http: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._session_uri: str | None = None
        self._basic = False
        self._system: dict[str, Any] | None = None
        self._system_uri: str | None = None

    def __repr__(self) -> str:
        return f"RedfishDriver({self.base})"

    @property
    def _where(self) -> str:
        return f"Redfish BMC {self.base}"

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.base.startswith("https"):
            return True
        if not self.ep.verify_tls:
            return False
        if self.ep.ca_cert:
            return ssl.create_default_context(cadata=self.ep.ca_cert)
        return ssl.create_default_context()

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=4),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            )
        return self._http

    # --- HTTP with auth ---

    async def _raw(
        self,
        method: str,
        path: str,
        body: Any = None,
        auth: bool = True,
        *,
        form: Callable[[], aiohttp.FormData] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        headers = {"Accept": "application/json", "OData-Version": "4.0"}
        if auth:
            if self._token:
                headers["X-Auth-Token"] = self._token
            elif self._basic:
                headers["Authorization"] = _basic_auth(self.ep.username, self.ep.password)
        url = same_origin_url(self._origin, path)
        if url is None:
            foreign_urls.inc()
            log.warning("%s: refused to follow %r: not on the BMC's own address", self._where, path)
            raise BmcProtocolError(
                f"{self._where} handed back a link off the BMC ({path[:200]!r}); metald follows "
                f"only relative paths or {self.base} URLs, so it sent nothing there"
            )
        send: dict[str, Any] = {"data": form()} if form is not None else {"json": body}
        if timeout_s is not None:
            send["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._client().request(
                method, url, headers=headers, allow_redirects=False, **send
            ) as r:
                data: Any = None
                if r.content_type == "application/json":
                    data = await r.json()
                else:
                    await r.read()
                return r.status, dict(r.headers), data
        except TimeoutError:
            err = BmcTimeout(
                f"{self._where}: no reply to {method} {path} within "
                f"{timeout_s or self.request_timeout_s:g} s"
            )
            err.maybe_delivered = method != "GET"
            raise err from None
        except aiohttp.ClientConnectorCertificateError as e:
            raise BmcUnreachable(
                f"{self._where}: TLS certificate not trusted ({e.certificate_error})"
            ) from None
        except aiohttp.ClientSSLError as e:
            raise BmcUnreachable(
                f"{self._where}: TLS handshake failed ({type(e).__name__})"
            ) from None
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise BmcUnreachable(f"{self._where}: {_conn_text(e)}") from None
        except aiohttp.ClientResponseError as e:
            raise BmcProtocolError(f"{self._where}: bad HTTP reply ({e.status})") from None

    async def _login(self) -> None:
        status, _, root = await self._raw("GET", "/redfish/v1/", auth=False)
        if status != 200 or not isinstance(root, dict):
            raise BmcProtocolError(
                f"{self._where}: /redfish/v1/ answered {status}, not a service root"
            )
        sessions = (root.get("Links") or {}).get("Sessions", {}).get("@odata.id")
        if sessions:
            body = {"UserName": self.ep.username, "Password": self.ep.password}
            status, headers, _ = await self._raw("POST", sessions, body, auth=False)
            token = headers.get("X-Auth-Token")
            if status in (200, 201) and token:
                self._token, self._session_uri = token, headers.get("Location")
                return
            if status == 401:
                raise BmcAuthError(f"{self._where}: login refused (HTTP 401)")
            log.debug("%s: session refused (HTTP %s); using basic auth", self._where, status)
        self._basic = True

    async def _req(
        self, method: str, path: str, body: Any = None, **kw: Any
    ) -> tuple[int, dict[str, str], Any]:
        if not self._token and not self._basic:
            await self._login()
        status, headers, data = await self._raw(method, path, body, **kw)
        if status == 401 and self._token:
            self._token = None  # the session expired: log in once more
            await self._login()
            status, headers, data = await self._raw(method, path, body, **kw)
        if status == 401:
            raise BmcAuthError(f"{self._where}: credentials refused (HTTP 401)")
        if status == 403:
            raise BmcAuthError(f"{self._where}: user lacks the privilege for {method} {path}")
        if status >= 500:
            raise BmcProtocolError(
                f"{self._where}: {method} {path} failed: HTTP {status}{_msg(data)}"
            )
        return status, headers, data

    async def _get(self, path: str) -> dict[str, Any]:
        status, _, data = await self._req("GET", path)
        if status == 404:
            raise BmcUnsupported(f"{self._where}: {path} does not exist")
        if status != 200 or not isinstance(data, dict):
            raise BmcProtocolError(f"{self._where}: GET {path} answered HTTP {status}{_msg(data)}")
        return data

    async def _act(self, method: str, path: str, body: Any) -> None:
        status, headers, data = await self._req(method, path, body)
        if status == 202 and headers.get("Location"):
            await self._wait_task(headers["Location"])
            return
        if status in (400, 405, 501):
            raise BmcUnsupported(
                f"{self._where}: {method} {path} refused: HTTP {status}{_msg(data)}"
            )
        if status not in (200, 202, 204):
            raise BmcProtocolError(
                f"{self._where}: {method} {path} answered HTTP {status}{_msg(data)}"
            )

    async def _wait_task(self, monitor: str) -> None:
        """Poll a task monitor until the task ends; the caller's timeout bounds the wait."""
        while True:
            status, _, data = await self._req("GET", monitor)
            state = data.get("TaskState") if isinstance(data, dict) else None
            if status in (200, 201, 204) and (state is None or state in _TASK_DONE):
                if state in ("Exception", "Killed", "Cancelled"):
                    raise BmcProtocolError(f"{self._where}: task ended {state}{_msg(data)}")
                return
            if status not in (200, 202):
                raise BmcProtocolError(f"{self._where}: task monitor answered HTTP {status}")
            await asyncio.sleep(self.task_poll_s)

    async def _system_resource(self, refresh: bool = False) -> dict[str, Any]:
        if self._system_uri is None:
            coll = await self._get("/redfish/v1/Systems")
            members = [m["@odata.id"] for m in coll.get("Members", []) if "@odata.id" in m]
            if not members:
                raise BmcProtocolError(f"{self._where}: the Systems collection is empty")
            if self.system_hint:
                members = [m for m in members if m.rstrip("/").endswith("/" + self.system_hint)]
                if not members:
                    raise BmcProtocolError(f"{self._where}: no system {self.system_hint!r}")
            self._system_uri = members[0]
        if self._system is None or refresh:
            self._system = await self._get(self._system_uri)
        return self._system

    # --- the driver interface ---

    async def identify(self) -> SystemIdentity:
        s = await self._system_resource(refresh=True)
        macs: list[str] = []
        nics = (s.get("EthernetInterfaces") or {}).get("@odata.id")
        if nics:
            try:
                coll = await self._get(nics)
                for m in coll.get("Members", [])[:16]:
                    nic = await self._get(m["@odata.id"])
                    if nic.get("MACAddress"):
                        macs.append(nic["MACAddress"].lower())
            except BmcUnsupported:
                pass
        return SystemIdentity(
            system_uuid=(s.get("UUID") or None),
            serial=s.get("SerialNumber") or None,
            macs=macs,
            extra={"reset_types": self._reset_types(s), "system": self._system_uri},
        )

    @staticmethod
    def _reset_types(s: dict[str, Any]) -> list[str]:
        action = (s.get("Actions") or {}).get("#ComputerSystem.Reset") or {}
        return list(action.get("ResetType@Redfish.AllowableValues") or [])

    async def get_power(self) -> PowerState:
        s = await self._system_resource(refresh=True)
        state = s.get("PowerState")
        if state in ("On", "PoweringOff"):
            return PowerState.ON
        if state in ("Off", "PoweringOn"):
            return PowerState.OFF
        raise BmcProtocolError(f"{self._where}: PowerState is {state!r}")

    async def set_power(self, action: PowerAction) -> None:
        s = await self._system_resource()
        action_obj = (s.get("Actions") or {}).get("#ComputerSystem.Reset")
        if not action_obj or "target" not in action_obj:
            raise BmcUnsupported(f"{self._where}: the system offers no ComputerSystem.Reset")
        allowed = self._reset_types(s)
        choices = RESET_CHOICES[PowerAction(action)]
        # A BMC that lists no allowable values is taken to accept the standard ones.
        chosen = next((c for c in choices if not allowed or c in allowed), None)
        if chosen is None:
            raise BmcUnsupported(
                f"{self._where}: cannot {action.value}: it offers only {', '.join(allowed)}"
            )
        await self._act("POST", action_obj["target"], {"ResetType": chosen})

    async def set_boot_device(self, boot: BootDevice) -> None:
        s = await self._system_resource()
        target = "Pxe" if boot.device is BootTarget.PXE else "Hdd"
        allowed = (s.get("Boot") or {}).get("BootSourceOverrideTarget@Redfish.AllowableValues")
        if allowed and target not in allowed:
            raise BmcUnsupported(f"{self._where}: boot target {target} not offered ({allowed})")
        override: dict[str, str] = {
            "BootSourceOverrideTarget": target,
            "BootSourceOverrideEnabled": "Continuous" if boot.persistent else "Once",
        }
        if boot.uefi is not None:
            override["BootSourceOverrideMode"] = "UEFI" if boot.uefi else "Legacy"
        body = {"Boot": override}
        assert self._system_uri is not None
        await self._act("PATCH", self._system_uri, body)

    async def set_locate(self, on: bool) -> None:
        # LocationIndicatorActive (ComputerSystem 1.13+) where offered, else IndicatorLED
        # (deprecated but what most BMCs, sushy-emulator included, still have).
        s = await self._system_resource(refresh=True)
        if "LocationIndicatorActive" in s:
            body: dict[str, Any] = {"LocationIndicatorActive": on}
        elif "IndicatorLED" in s:
            body = {"IndicatorLED": "Lit" if on else "Off"}
        else:
            raise BmcUnsupported(f"{self._where}: the system has no locate indicator")
        assert self._system_uri is not None
        await self._act("PATCH", self._system_uri, body)

    async def get_locate(self) -> bool | None:
        s = await self._system_resource(refresh=True)
        if isinstance(s.get("LocationIndicatorActive"), bool):
            return bool(s["LocationIndicatorActive"])
        led = s.get("IndicatorLED")
        return None if led in (None, "Unknown") else led in ("Lit", "Blinking")

    async def firmware_inventory(self) -> list[FirmwareItem]:
        root = await self._get("/redfish/v1/")
        svc = (root.get("UpdateService") or {}).get("@odata.id")
        if not svc:
            raise BmcUnsupported(f"{self._where}: no UpdateService")
        inv = ((await self._get(svc)).get("FirmwareInventory") or {}).get("@odata.id")
        if not inv:
            raise BmcUnsupported(f"{self._where}: the UpdateService has no FirmwareInventory")
        out: list[FirmwareItem] = []
        for m in (await self._get(inv)).get("Members", [])[:MAX_FIRMWARE_ITEMS]:
            if not isinstance(m, dict) or not isinstance(m.get("@odata.id"), str):
                continue
            x = await self._get(m["@odata.id"])
            version = x.get("Version")
            out.append(
                FirmwareItem(
                    _text(x.get("Id")) or m["@odata.id"].rstrip("/").rsplit("/", 1)[-1],
                    _text(x.get("Name")) or "",
                    _text(version) if version is not None else None,
                    x.get("Updateable") if isinstance(x.get("Updateable"), bool) else None,
                )
            )
        return out

    # --- firmware updates (UpdateService, TaskService) ---

    async def _update_service(self) -> dict[str, Any]:
        root = await self._get("/redfish/v1/")
        svc = (root.get("UpdateService") or {}).get("@odata.id")
        if not svc:
            raise BmcUnsupported(f"{self._where}: no UpdateService")
        return await self._get(svc)

    async def _item_uri(self, svc: dict[str, Any], item: str) -> str:
        inv = (svc.get("FirmwareInventory") or {}).get("@odata.id")
        if not inv:
            raise BmcUnsupported(f"{self._where}: the UpdateService has no FirmwareInventory")
        for m in (await self._get(inv)).get("Members", [])[:MAX_FIRMWARE_ITEMS]:
            uri = m.get("@odata.id") if isinstance(m, dict) else None
            if isinstance(uri, str) and uri.rstrip("/").rsplit("/", 1)[-1] == item:
                return uri
        raise BmcUnsupported(f"{self._where}: no firmware inventory item {item!r}")

    async def update_methods(self) -> frozenset[str]:
        svc = await self._update_service()
        out = set()
        if (svc.get("Actions") or {}).get("#UpdateService.SimpleUpdate"):
            out.add("simple-update")
        if isinstance(svc.get("MultipartHttpPushUri"), str):
            out.add("multipart")
        if not out:
            raise BmcUnsupported(
                f"{self._where}: its UpdateService offers neither SimpleUpdate nor a "
                "MultipartHttpPushUri"
            )
        return frozenset(out)

    def _task_of(self, status: int, headers: dict[str, str], data: Any, what: str) -> UpdateTask:
        if status not in (200, 201, 202, 204):
            if status in (400, 405, 415, 501):
                raise BmcUnsupported(f"{self._where}: {what} refused: HTTP {status}{_msg(data)}")
            raise BmcProtocolError(f"{self._where}: {what} answered HTTP {status}{_msg(data)}")
        uri = data.get("@odata.id") if isinstance(data, dict) and "TaskState" in data else None
        uri = uri or headers.get("Location")
        if not isinstance(uri, str) or not uri:
            raise BmcProtocolError(f"{self._where}: {what} was accepted but names no task")
        if same_origin_url(self._origin, uri) is None:
            foreign_urls.inc()
            raise BmcProtocolError(
                f"{self._where}: {what} named a task off the BMC ({uri[:200]!r})"
            )
        if isinstance(data, dict) and "TaskState" in data:
            return _update_task(uri, data)
        return UpdateTask(uri, "New")

    async def simple_update(self, image_url: str, item: str) -> UpdateTask:
        svc = await self._update_service()
        action = (svc.get("Actions") or {}).get("#UpdateService.SimpleUpdate") or {}
        target = action.get("target")
        if not isinstance(target, str):
            raise BmcUnsupported(f"{self._where}: the UpdateService has no SimpleUpdate")
        body: dict[str, Any] = {"ImageURI": image_url, "Targets": [await self._item_uri(svc, item)]}
        allowed = action.get("TransferProtocol@Redfish.AllowableValues")
        scheme = image_url.split(":", 1)[0].upper()
        if isinstance(allowed, list) and scheme in allowed:
            body["TransferProtocol"] = scheme
        status, headers, data = await self._req("POST", target, body)
        return self._task_of(status, headers, data, "SimpleUpdate")

    async def push_update(self, image: bytes, item: str, marker: str) -> UpdateTask:
        svc = await self._update_service()
        push = svc.get("MultipartHttpPushUri")
        if not isinstance(push, str):
            raise BmcUnsupported(f"{self._where}: the UpdateService has no MultipartHttpPushUri")
        params = json.dumps(
            {"Targets": [await self._item_uri(svc, item)], "Oem": {"metald": {"update": marker}}}
        )

        def form() -> aiohttp.FormData:
            f = aiohttp.FormData()
            f.add_field("UpdateParameters", params, content_type="application/json")
            f.add_field(
                "UpdateFile", image, filename="image.bin", content_type="application/octet-stream"
            )
            return f

        # An image takes longer than a command: a megabyte per second at least, on top.
        timeout = self.request_timeout_s + len(image) / 1_000_000
        status, headers, data = await self._req("POST", push, form=form, timeout_s=timeout)
        return self._task_of(status, headers, data, "the multipart push")

    async def update_task(self, uri: str) -> UpdateTask:
        status, _, data = await self._req("GET", uri)
        if status == 404:
            raise BmcUnsupported(f"{self._where}: the task {uri} is gone")
        if status not in (200, 202) or not isinstance(data, dict) or "TaskState" not in data:
            raise BmcProtocolError(f"{self._where}: task {uri} answered HTTP {status}{_msg(data)}")
        return _update_task(uri, data)

    async def find_update_task(self, marker: str) -> UpdateTask | None:
        root = await self._get("/redfish/v1/")
        # The service root links the TaskService as "Tasks" (some BMCs: "TaskService").
        ts = (root.get("Tasks") or root.get("TaskService") or {}).get("@odata.id")
        if not ts:
            return None
        svc = ((await self._get(ts)).get("Tasks") or {}).get("@odata.id")
        if not svc:
            return None
        members = (await self._get(svc)).get("Members", [])
        for m in reversed(members[-MAX_TASKS:]):
            uri = m.get("@odata.id") if isinstance(m, dict) else None
            if not isinstance(uri, str):
                continue
            t = await self.update_task(uri)
            if marker in t.request:
                return t
        return None

    async def reset_bmc(self) -> None:
        s = await self._system_resource()
        managers = (s.get("Links") or {}).get("ManagedBy") or []
        uri = managers[0].get("@odata.id") if managers and isinstance(managers[0], dict) else None
        if not isinstance(uri, str):
            raise BmcUnsupported(f"{self._where}: the system names no managing BMC")
        manager = await self._get(uri)
        action = (manager.get("Actions") or {}).get("#Manager.Reset") or {}
        target = action.get("target")
        if not isinstance(target, str):
            raise BmcUnsupported(f"{self._where}: the BMC offers no Manager.Reset")
        allowed = action.get("ResetType@Redfish.AllowableValues") or ["GracefulRestart"]
        kind = "GracefulRestart" if "GracefulRestart" in allowed else str(allowed[0])
        await self._act("POST", target, {"ResetType": kind})

    # --- user accounts (AccountService) ---

    async def _accounts_uri(self) -> str:
        root = await self._get("/redfish/v1/")
        svc = (root.get("AccountService") or {}).get("@odata.id")
        if not svc:
            raise BmcUnsupported(f"{self._where}: no AccountService")
        uri = ((await self._get(svc)).get("Accounts") or {}).get("@odata.id")
        if not uri:
            raise BmcUnsupported(f"{self._where}: the AccountService lists no Accounts")
        return str(uri)

    async def accounts(self) -> list[BmcAccount]:
        out = []
        for m in (await self._get(await self._accounts_uri())).get("Members", [])[:MAX_ACCOUNTS]:
            uri = m.get("@odata.id") if isinstance(m, dict) else None
            if not isinstance(uri, str):
                continue
            a = await self._get(uri)
            user = a.get("UserName")
            if not isinstance(user, str) or not user:
                continue  # an empty slot (IPMI-style user tables show them)
            out.append(
                BmcAccount(
                    _text(a.get("Id")) or uri.rstrip("/").rsplit("/", 1)[-1],
                    _text(user),
                    _text(a.get("RoleId")) or None,
                    a.get("Enabled") if isinstance(a.get("Enabled"), bool) else None,
                )
            )
        return out

    async def delete_account(self, account_id: str) -> None:
        base = await self._accounts_uri()
        if "/" in account_id or not account_id:
            raise BmcProtocolError(f"{self._where}: account id {account_id[:40]!r} is not one")
        await self._act("DELETE", f"{base.rstrip('/')}/{account_id}", None)

    async def _bios_links(self) -> tuple[str, str | None]:
        s = await self._system_resource()
        path = (s.get("Bios") or {}).get("@odata.id")
        if not path:
            raise BmcUnsupported(f"{self._where}: the system has no Bios resource")
        bios = await self._get(path)
        settings = ((bios.get("@Redfish.Settings") or {}).get("SettingsObject") or {}).get(
            "@odata.id"
        )
        return path, settings

    async def bios(self) -> BiosSettings:
        path, settings = await self._bios_links()
        current = (await self._get(path)).get("Attributes") or {}
        pending = (await self._get(settings)).get("Attributes") or {} if settings else {}
        if not isinstance(current, dict) or not isinstance(pending, dict):
            raise BmcProtocolError(f"{self._where}: BIOS Attributes is not an object")
        return BiosSettings(current, pending)

    async def set_bios_pending(self, attributes: dict[str, Any]) -> None:
        _, settings = await self._bios_links()
        if not settings:
            raise BmcUnsupported(f"{self._where}: the Bios resource has no settings object")
        await self._act("PATCH", settings, {"Attributes": attributes})

    # --- UEFI Secure Boot (SecureBoot, SecureBootDatabases) ---

    async def _secure_boot_uri(self) -> str:
        path = ((await self._system_resource()).get("SecureBoot") or {}).get("@odata.id")
        if not isinstance(path, str) or not path:
            raise BmcUnsupported(f"{self._where}: the system has no SecureBoot resource")
        return path

    async def _certificates_uri(self, sb: dict[str, Any], database: str) -> str:
        coll = (sb.get("SecureBootDatabases") or {}).get("@odata.id")
        if not isinstance(coll, str):
            raise BmcUnsupported(f"{self._where}: SecureBoot lists no SecureBootDatabases")
        for m in (await self._get(coll)).get("Members", [])[:MAX_SB_DATABASES]:
            uri = m.get("@odata.id") if isinstance(m, dict) else None
            if isinstance(uri, str) and uri.rstrip("/").rsplit("/", 1)[-1] == database:
                certs = ((await self._get(uri)).get("Certificates") or {}).get("@odata.id")
                if isinstance(certs, str):
                    return certs
                raise BmcUnsupported(f"{self._where}: Secure Boot {database} has no Certificates")
        raise BmcUnsupported(f"{self._where}: no Secure Boot database {database}")

    async def _fingerprints(self, certs_uri: str) -> list[str]:
        out = []
        for m in (await self._get(certs_uri)).get("Members", [])[:MAX_SB_CERTS]:
            uri = m.get("@odata.id") if isinstance(m, dict) else None
            if isinstance(uri, str):
                fp = _cert_fingerprint(await self._get(uri))
                if fp:
                    out.append(fp)
        return out

    async def secure_boot(self) -> SecureBootState:
        sb = await self._get(await self._secure_boot_uri())
        enable, current, mode = (
            sb.get("SecureBootEnable"),
            sb.get("SecureBootCurrentBoot"),
            sb.get("SecureBootMode"),
        )
        certificates: dict[str, list[str]] = {}
        for db in ("PK", "KEK", "db", "dbx"):
            with contextlib.suppress(BmcUnsupported):  # the switch without the databases
                certificates[db] = await self._fingerprints(await self._certificates_uri(sb, db))
        return SecureBootState(
            enabled=enable if isinstance(enable, bool) else None,
            current_boot={"Enabled": True, "Disabled": False}.get(str(current)),
            mode=_text(mode, 32) or None,
            certificates=certificates,
        )

    async def set_secure_boot(self, enable: bool) -> None:
        await self._act("PATCH", await self._secure_boot_uri(), {"SecureBootEnable": enable})

    async def enroll_certificate(self, database: str, pem: str) -> bool:
        sb = await self._get(await self._secure_boot_uri())
        certs = await self._certificates_uri(sb, database)
        if pem_fingerprint(pem) in await self._fingerprints(certs):
            return False
        status, _, data = await self._req(
            "POST", certs, {"CertificateString": pem, "CertificateType": "PEM"}
        )
        if status in (400, 405, 501):
            raise BmcUnsupported(
                f"{self._where}: enrolling a {database} certificate refused: "
                f"HTTP {status}{_msg(data)}"
            )
        if status not in (200, 201, 204):
            raise BmcProtocolError(
                f"{self._where}: POST {certs} answered HTTP {status}{_msg(data)}"
            )
        return True

    async def sensors(self) -> list[Sensor]:
        s = await self._system_resource()
        out: list[Sensor] = []
        for link in (s.get("Links") or {}).get("Chassis", [])[:4]:
            chassis = await self._get(link["@odata.id"])
            if thermal := (chassis.get("Thermal") or {}).get("@odata.id"):
                t = await self._get(thermal)
                for x in t.get("Temperatures", []):
                    out.append(
                        Sensor(
                            x.get("Name", "?"),
                            "temperature",
                            x.get("ReadingCelsius"),
                            "C",
                            _health(x),
                        )
                    )
                for x in t.get("Fans", []):
                    out.append(
                        Sensor(
                            x.get("Name") or x.get("FanName", "?"),
                            "fan",
                            x.get("Reading"),
                            x.get("ReadingUnits", "RPM"),
                            _health(x),
                        )
                    )
            if power := (chassis.get("Power") or {}).get("@odata.id"):
                try:
                    p = await self._get(power)
                except BmcUnsupported:
                    continue
                for x in p.get("PowerControl", []):
                    out.append(
                        Sensor(
                            x.get("Name", "power"),
                            "power",
                            x.get("PowerConsumedWatts"),
                            "W",
                            _health(x),
                        )
                    )
        return out

    async def event_log(self) -> list[LogEntry]:
        s = await self._system_resource()
        managers = (s.get("Links") or {}).get("ManagedBy", [])
        for m in managers[:2]:
            mgr = await self._get(m["@odata.id"])
            services = (mgr.get("LogServices") or {}).get("@odata.id")
            if not services:
                continue
            coll = await self._get(services)
            for svc in coll.get("Members", []):
                service = await self._get(svc["@odata.id"])
                entries_uri = (service.get("Entries") or {}).get("@odata.id")
                if not entries_uri:
                    continue
                entries = await self._get(entries_uri)
                return [
                    LogEntry(
                        id=str(e.get("Id", "")),
                        at=_parse_time(e.get("Created")),
                        severity=str(e.get("Severity", "OK")).lower(),
                        message=str(e.get("Message", "")),
                    )
                    for e in entries.get("Members", [])
                ]
        raise BmcUnsupported(f"{self._where}: the BMC exposes no log service")

    # --- EventService (pushed log entries) ---

    async def event_subscribe(self, destination: str, secret: str) -> str | None:
        """A Redfish event subscription (``Alert`` events, i.e. log entries) for
        ``destination``, with ``secret`` in an ``HttpHeaders`` entry (never shown back by the
        BMC) and in ``Context`` (for BMCs that drop HttpHeaders). None where the service root
        names no EventService or it is disabled."""
        root = await self._get("/redfish/v1/")
        svc_uri = (root.get("EventService") or {}).get("@odata.id")
        if not isinstance(svc_uri, str):
            return None
        svc = await self._get(svc_uri)
        subs = (svc.get("Subscriptions") or {}).get("@odata.id")
        if svc.get("ServiceEnabled") is False or not isinstance(subs, str):
            return None
        body: dict[str, Any] = {
            "Destination": destination,
            "Protocol": "Redfish",
            "Context": secret,
            "HttpHeaders": [{"X-Metald-Event-Secret": secret}],
        }
        if "Alert" in (svc.get("EventTypesForSubscription") or []):
            body["EventTypes"] = ["Alert"]
        status, headers, data = await self._req("POST", subs, body)
        if status in (400, 405, 501):
            raise BmcUnsupported(f"{self._where}: event subscription refused: HTTP {status}"
                                 f"{_msg(data)}")  # fmt: skip
        if status not in (200, 201, 204):
            raise BmcProtocolError(f"{self._where}: POST {subs} answered HTTP {status}{_msg(data)}")
        loc = headers.get("Location") or (data.get("@odata.id") if isinstance(data, dict) else None)
        if not isinstance(loc, str) or not loc:
            raise BmcProtocolError(f"{self._where}: the event subscription has no Location")
        url = same_origin_url(self._origin, loc)
        if url is None:
            raise BmcProtocolError(f"{self._where}: the event subscription is elsewhere ({loc})")
        return url.path

    async def event_subscription_alive(self, uri: str) -> bool:
        status, _, _ = await self._req("GET", uri)
        return status == 200

    async def event_unsubscribe(self, uri: str) -> None:
        status, _, data = await self._req("DELETE", uri)
        if status not in (200, 202, 204, 404):
            raise BmcProtocolError(
                f"{self._where}: DELETE {uri} answered HTTP {status}{_msg(data)}"
            )

    # --- VirtualMedia ---

    async def find_virtual_cd(self) -> tuple[str, dict[str, Any]]:
        """The path and resource of the first virtual media device that takes a CD or DVD."""
        system = await self._system_resource()
        collections: list[str] = []
        if vm := (system.get("VirtualMedia") or {}).get("@odata.id"):
            collections.append(vm)
        managers = [m["@odata.id"] for m in (system.get("Links") or {}).get("ManagedBy", [])]
        if not managers:
            coll = await self._get("/redfish/v1/Managers")
            managers = [m["@odata.id"] for m in coll.get("Members", []) if "@odata.id" in m]
        for path in managers:
            mgr = await self._get(path)
            if vm := (mgr.get("VirtualMedia") or {}).get("@odata.id"):
                collections.append(vm)
        for coll_path in collections:
            coll = await self._get(coll_path)
            for member in coll.get("Members", []):
                if "@odata.id" not in member:
                    continue
                res = await self._get(member["@odata.id"])
                if CD_TYPES & set(res.get("MediaTypes") or []):
                    return member["@odata.id"], res
        raise BmcUnsupported(f"{self._where}: the BMC offers no virtual CD or DVD")

    async def insert_media(self, image_url: str) -> str:
        """Insert ``image_url`` (ejecting what was there); returns the device's path once the
        BMC reports the image inserted."""
        path, res = await self.find_virtual_cd()
        if res.get("Inserted"):
            await self._act("POST", _media_action(path, res, "EjectMedia"), {})
        body = {"Image": image_url, "Inserted": True, "WriteProtected": True}
        await self._act("POST", _media_action(path, res, "InsertMedia"), body)
        now = await self._get(path)
        if not now.get("Inserted") or now.get("Image") != image_url:
            raise BmcProtocolError(
                f"{self._where}: asked to insert {image_url}, the BMC reports "
                f"Inserted={now.get('Inserted')!r} Image={now.get('Image')!r}"
            )
        return path

    async def eject_media(self) -> None:
        path, res = await self.find_virtual_cd()
        if res.get("Inserted"):
            await self._act("POST", _media_action(path, res, "EjectMedia"), {})

    async def boot_cd_once(self) -> None:
        """The next boot (only) from the virtual CD."""
        s = await self._system_resource()
        allowed = (s.get("Boot") or {}).get("BootSourceOverrideTarget@Redfish.AllowableValues")
        if allowed and "Cd" not in allowed:
            raise BmcUnsupported(f"{self._where}: boot target Cd not offered ({allowed})")
        assert self._system_uri is not None
        body = {"Boot": {"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once"}}
        await self._act("PATCH", self._system_uri, body)

    async def close(self) -> None:
        if self._http is not None and not self._http.closed:
            if self._token and self._session_uri:
                try:
                    await self._raw("DELETE", self._session_uri)
                except Exception as e:  # best effort: the BMC expires idle sessions anyway
                    log.debug("%s: session delete failed: %s", self._where, type(e).__name__)
            await self._http.close()
        self._http = None
        self._token = None


#: A hostile BMC cannot make metald read an unbounded inventory (or task list).
MAX_FIRMWARE_ITEMS = 64
MAX_TASKS = 32
MAX_ACCOUNTS = 64
MAX_SB_DATABASES = 16
MAX_SB_CERTS = 64


def pem_fingerprint(pem: str) -> str | None:
    """SHA-256 of a PEM certificate's DER, upper-case hex; None when it is not one."""
    try:
        der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(Encoding.DER)
    except ValueError:
        return None
    return hashlib.sha256(der).hexdigest().upper()


def _cert_fingerprint(c: dict[str, Any]) -> str | None:
    """A Certificate resource's SHA-256 fingerprint: from its PEM where it carries one (the
    BMC's own Fingerprint may use another hash), else its SHA-256 Fingerprint property."""
    pem = c.get("CertificateString")
    if isinstance(pem, str) and len(pem) < 64 * 1024:
        fp = pem_fingerprint(pem)
        if fp:
            return fp
    fp, alg = c.get("Fingerprint"), str(c.get("FingerprintHashAlgorithm") or "")
    if isinstance(fp, str) and "SHA256" in alg.upper().replace("-", ""):
        hexed = fp.replace(":", "").upper()
        if len(hexed) == 64 and all(ch in "0123456789ABCDEF" for ch in hexed):
            return hexed
    return None


def _update_task(uri: str, data: dict[str, Any]) -> UpdateTask:
    pct = data.get("PercentComplete")
    msgs = tuple(
        _text(m.get("Message"), 200)
        for m in (data.get("Messages") or [])[-8:]
        if isinstance(m, dict) and m.get("Message")
    )
    payload = data.get("Payload") or {}
    request = payload.get("JsonBody") if isinstance(payload, dict) else None
    return UpdateTask(
        uri,
        _text(data.get("TaskState")) or "Unknown",
        max(0, min(100, pct)) if isinstance(pct, int) and not isinstance(pct, bool) else None,
        msgs,
        request[:4096] if isinstance(request, str) else "",
    )


def _text(v: Any, limit: int = 128) -> str:
    return str(v)[:limit] if isinstance(v, str | int | float) else ""


def _basic_auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _health(x: dict[str, Any]) -> str:
    h = str((x.get("Status") or {}).get("Health"))
    return {"OK": "ok", "Warning": "warning", "Critical": "critical"}.get(h, "unknown")


def _msg(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error") or {}
        info = err.get("@Message.ExtendedInfo") or []
        text = info[0].get("Message") if info and isinstance(info[0], dict) else err.get("message")
        if text:
            return f": {str(text)[:200]}"
    return ""


def _conn_text(e: BaseException) -> str:
    os_err = getattr(e, "os_error", None)
    if isinstance(os_err, OSError) and os_err.strerror:
        return os_err.strerror
    return type(e).__name__


def _parse_time(v: Any) -> Any:
    from datetime import datetime

    try:
        return datetime.fromisoformat(str(v)) if v else None
    except ValueError:
        return None


def _media_action(path: str, res: dict[str, Any], name: str) -> str:
    target = ((res.get("Actions") or {}).get(f"#VirtualMedia.{name}") or {}).get("target")
    return target or f"{path.rstrip('/')}/Actions/VirtualMedia.{name}"
