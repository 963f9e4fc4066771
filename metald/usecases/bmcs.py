"""BMCs as the API registers, lists and commands them, and what a BMC does for a machine:
power, next boot device, locate light, firmware and BIOS, sensors, event log; vouching for a
machine without a BMC; booting a machine through its BMC.

The commands run in the BMC service (``metald.bmc.service.BmcService``, given as ``bmc``; None
where this instance runs no BMC control: every call is then a 503). In a fleet, a command
reaches this use case only on the instance that owns the BMC: the router carries it there
(``api.routing.Owner``). What changes something wakes the event streams (``notify``); reads
do not. No answer carries a BMC password.
"""

from __future__ import annotations

import builtins
import ipaddress
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from sqlmodel import Session, select

from metald import machines
from metald.bmc import media as virtual_media
from metald.errors import Conflict, ServiceUnavailable, Unprocessable
from metald.lifecycle import NETWORK_BOOT, State
from metald.provision import netboot
from metald.store import Store
from metald.store.models import Bmc, utcnow
from metald.usecases.reads import Page, Pager, page_items

#: By address.
DEFAULT_ORDER = ["address", "id"]

# ---- addresses ----------------------------------------------------------------------------

_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
_ADDRESS_FORMS = (
    'write a host name or IP ("10.0.0.5", "bmc-r1-07.example", "fd00::5"), optionally with '
    'a port ("10.0.0.5:623", "[fd00::5]:443"); for Redfish over plain HTTP or to force '
    'HTTPS, "http://10.0.0.5" or "https://10.0.0.5:8443"'
)


def parse_bmc_address(address: str, port: int | None, protocol: str) -> tuple[str, int | None]:
    """``address`` as stored (a host or IP, or ``http(s)://host`` for Redfish) and the port,
    taken from the address when it names one; Unprocessable with what to write otherwise."""
    raw = address.strip()
    scheme = ""
    for s in ("https://", "http://"):
        if raw.lower().startswith(s):
            scheme, raw = s, raw[len(s) :]
    if "://" in raw:
        raise Unprocessable(
            f"address: {address!r} has a scheme metald does not speak; {_ADDRESS_FORMS}"
        )
    if scheme and protocol == "ipmi":
        raise Unprocessable(
            f'address: {address!r} is a URL, but IPMI has none; write the host alone ("10.0.0.5")'
        )
    if scheme:
        raw = raw.removesuffix("/")
    if any(c in raw for c in "/?#@ \\"):
        raise Unprocessable(
            f"address: {address!r} is not a host: no path, user, query or spaces; {_ADDRESS_FORMS}"
        )
    host, named_port = raw, None
    if raw.startswith("["):
        end = raw.find("]")
        host, rest = raw[1:end], raw[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise Unprocessable(f"address: {address!r} is not [IPv6]:port; {_ADDRESS_FORMS}")
        named_port = rest[1:] or None
    elif raw.count(":") == 1:
        host, named_port = raw.split(":")
    if named_port is not None:
        if not named_port.isdigit() or not 0 < int(named_port) < 65536:
            raise Unprocessable(f"address: port {named_port!r} is not 1-65535; {_ADDRESS_FORMS}")
        if port is not None and port != int(named_port):
            raise Unprocessable(
                f"address names port {named_port} but port is {port}; give the port once"
            )
        port = int(named_port)
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host) or host.replace(".", "").isdigit():
            raise Unprocessable(
                f"address: {address!r} is not a host name or IP; {_ADDRESS_FORMS}"
            ) from None
        ip = None
    shown = f"[{ip}]" if scheme and ip is not None and ip.version == 6 else host
    return (f"{scheme}{shown}" if scheme else (str(ip) if ip is not None else host)), port


# ---- the use case ---------------------------------------------------------------------------

T = TypeVar("T")
View = dict[str, Any]


class BmcCommands(Protocol):
    """What this use case asks of the BMC service (``metald.bmc.service.BmcService``, which
    the layers above ``metald.bmc`` never import: it reaches the drivers)."""

    #: The fenced executor (``metald.bmc.executor``): virtual media and a machine's BMC row.
    control: Any

    async def register(self, *args: Any, **options: Any) -> View:
        """``BmcRegistry.register``'s arguments: connect, store, link."""
        ...

    async def list(self) -> builtins.list[View]: ...

    async def get(self, bmc_id: str) -> View: ...

    async def link(self, bmc_id: str, machine_id: str | None, actor: str = ...) -> View: ...

    async def remove(self, bmc_id: str, actor: str = ...) -> None: ...

    async def power(
        self, machine_id: str, action: str, actor: str = ..., wait_s: float | None = ...
    ) -> View: ...

    async def power_bmc(
        self, bmc_id: str, action: str, actor: str = ..., wait_s: float | None = ...
    ) -> View: ...

    def power_command(
        self, command_id: str, *, machine_id: str | None = ..., bmc_id: str | None = ...
    ) -> View: ...

    async def set_boot_device(
        self, machine_id: str, device: str, *, persistent: bool, uefi: bool, actor: str = ...
    ) -> View: ...

    async def locate(self, machine_id: str, on: bool | None, actor: str = ...) -> View: ...

    async def firmware(self, machine_id: str, actor: str = ...) -> View: ...

    async def bios(self, machine_id: str, actor: str = ...) -> View: ...

    async def set_bios(
        self, machine_id: str, attributes: dict[str, Any], actor: str = ...
    ) -> View: ...

    async def secure_boot(self, machine_id: str, actor: str = ...) -> View: ...

    async def set_secure_boot(
        self, machine_id: str, *, enable: bool, enroll: bool, actor: str = ...
    ) -> View: ...

    async def sensors(self, machine_id: str) -> builtins.list[View]: ...

    async def event_log(self, machine_id: str) -> builtins.list[View]: ...


@dataclass
class Bmcs:
    store: Store
    instance: str
    notify: Callable[[], None]
    #: The BMC service (``metald.bmc.service.BmcService``); None: not run by this instance.
    bmc: BmcCommands | None
    #: Runs a boot in the background (``metald.provision.netboot.Provisioner.spawn``).
    spawn: Callable[[Coroutine[Any, Any, Any]], Any]
    #: Why this configuration gives BMCs no URL for a boot's ISO (``media.boot_url_problem``),
    #: named in the 409 that refuses a virtual-media boot then.
    boot_url_problem: str | None = None

    @property
    def service(self) -> BmcCommands:
        """The BMC service, or 503 where this instance runs none."""
        if self.bmc is None:
            raise ServiceUnavailable("BMC control is not running in this metald instance")
        return self.bmc

    async def _changing(self, call: Awaitable[T]) -> T:
        """``call``'s answer, the event streams woken after it (it records events)."""
        out = await call
        self.notify()
        return out

    # --- the registry ---

    async def register(
        self, address: str, port: int | None, protocol: str, **options: Any
    ) -> dict[str, Any]:
        """Register a BMC at ``address`` (``parse_bmc_address``); ``options`` as the BMC
        service's ``register`` takes them (username, password, machine_id, verify_tls,
        ca_cert, actor, verify, own_listeners)."""
        host, port = parse_bmc_address(address, port, protocol)
        return await self._changing(self.service.register(host, port, protocol, **options))

    async def list(self, pager: Pager) -> Page[View]:
        items = await self.service.list()
        return page_items(items, pager, DEFAULT_ORDER, lambda rows: rows, get=_field)

    async def show(self, bmc_id: str) -> dict[str, Any]:
        return await self.service.get(bmc_id)

    async def link(self, bmc_id: str, machine_id: str | None, *, actor: str) -> dict[str, Any]:
        return await self._changing(self.service.link(bmc_id, machine_id, actor=actor))

    async def remove(self, bmc_id: str, *, actor: str) -> None:
        await self._changing(self.service.remove(bmc_id, actor=actor))

    # --- power, by BMC (before its host enrolled) or by machine ---

    async def bmc_power(
        self, bmc_id: str, action: str, *, actor: str | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """Read (``status`` without an actor) or change the power of the BMC's host."""
        return await self._power(self.service.power_bmc, bmc_id, action, actor, wait_s)

    async def power(
        self, machine_id: str, action: str, *, actor: str | None = None, wait_s: float | None = None
    ) -> dict[str, Any]:
        """Read (``status`` without an actor) or change the machine's power."""
        return await self._power(self.service.power, machine_id, action, actor, wait_s)

    async def _power(
        self,
        command: Callable[..., Awaitable[View]],
        target: str,
        action: str,
        actor: str | None,
        wait_s: float | None,
    ) -> View:
        if actor is None:
            return await command(target, action)
        return await self._changing(command(target, action, actor=actor, wait_s=wait_s))

    def power_command(
        self, command_id: str, *, machine_id: str | None = None, bmc_id: str | None = None
    ) -> dict[str, Any]:
        """A power command's confirmation, as this instance (the BMC's owner) follows it."""
        return self.service.power_command(command_id, machine_id=machine_id, bmc_id=bmc_id)

    # --- what a BMC does for a machine ---

    async def set_boot_device(
        self, machine_id: str, device: str, *, persistent: bool, uefi: bool, actor: str
    ) -> dict[str, Any]:
        return await self._changing(
            self.service.set_boot_device(
                machine_id, device, persistent=persistent, uefi=uefi, actor=actor
            )
        )

    async def locate(
        self, machine_id: str, on: bool | None, *, actor: str = "system"
    ) -> dict[str, Any]:
        """Read (``on`` None) or turn the chassis identify light on or off."""
        if on is None:
            return await self.service.locate(machine_id, None)
        return await self._changing(self.service.locate(machine_id, on, actor=actor))

    async def firmware(self, machine_id: str, *, actor: str) -> dict[str, Any]:
        """Read the firmware inventory now (recorded on the machine)."""
        return await self._changing(self.service.firmware(machine_id, actor=actor))

    async def bios(self, machine_id: str, *, actor: str) -> dict[str, Any]:
        """Read the BIOS settings now (drift recorded on the machine)."""
        return await self._changing(self.service.bios(machine_id, actor=actor))

    async def set_bios(
        self, machine_id: str, attributes: dict[str, Any], *, actor: str
    ) -> dict[str, Any]:
        return await self._changing(self.service.set_bios(machine_id, attributes, actor=actor))

    async def secure_boot(self, machine_id: str, *, actor: str) -> dict[str, Any]:
        """Read the Secure Boot state now (recorded on the machine)."""
        return await self._changing(self.service.secure_boot(machine_id, actor=actor))

    async def set_secure_boot(
        self, machine_id: str, *, enable: bool, enroll: bool, actor: str
    ) -> dict[str, Any]:
        """Enroll metald's certificate in db and turn Secure Boot on or off (next boot)."""
        return await self._changing(
            self.service.set_secure_boot(machine_id, enable=enable, enroll=enroll, actor=actor)
        )

    async def sensors(self, machine_id: str) -> builtins.list[View]:
        return await self.service.sensors(machine_id)

    async def event_log(self, machine_id: str) -> builtins.list[View]:
        return await self.service.event_log(machine_id)

    # --- vouching for a machine without a BMC (enroll.require_bmc) ---

    async def approve(self, machine_id: str, reason: str, *, actor: str) -> dict[str, Any]:
        """A technician vouches for a self-enrolled machine; approving again keeps the first
        approval. Records ``machine.approved``."""

        def run(s: Session) -> dict[str, Any]:
            m = machines.get_machine(s, machine_id)
            linked = s.exec(select(Bmc.id).where(Bmc.machine_id == m.id)).first() is not None
            if m.approved_at is None:
                m = machines.update_fields(
                    s,
                    m.id,
                    actor=actor,
                    kind="machine.approved",
                    values={"approved_at": utcnow(), "approved_by": actor},
                    data={"reason": reason, "bmc_linked": linked},
                    instance=self.instance,
                )
            return {
                "machine_id": m.id,
                "approved_at": m.approved_at,
                "approved_by": m.approved_by,
                "bmc_linked": linked,
            }

        return await self._changing(self.store.run(run))

    # --- booting a machine through its BMC ---

    async def boot(self, machine_id: str, via: str, *, actor: str) -> dict[str, Any]:
        """Start the network-boot step in the background (confirmed power-off, then
        virtual media or a one-time PXE boot, armed, power on); only for a machine metald
        boots. The boot's ISO URL (virtual media) without its nonce, and the machine's state."""
        svc = self.service
        m = await self.store.run(machines.get_machine, machine_id)
        if State(m.state) not in NETWORK_BOOT:
            booting = ", ".join(sorted(s.value for s in NETWORK_BOOT))
            raise Conflict(
                f"machine {machine_id} is {m.state}: metald boots a machine only in {booting}; "
                "claim, inspect or release it first (or use PUT .../power for a plain power "
                "action)",
                state=m.state,
            )
        url = None
        if via == "virtual-media":
            base = virtual_media.boot_base(svc.control)
            if base is None:  # 409 with the keys to set, before any BMC command
                raise virtual_media.no_boot_url(self.boot_url_problem, machine_id)
            await virtual_media.check_for(svc.control, machine_id)
            url = f"{base}/boot/n/{machine_id}/"  # + the boot's nonce, once armed
        else:
            await svc.control.row_for_machine(machine_id)  # 404 with what to do: no BMC
        self.spawn(
            netboot.boot_from_network(
                self.store, svc, machine_id, actor=actor, instance=self.instance, via=via
            )
        )
        return {"machine_id": machine_id, "via": via, "image_url": url, "state": m.state}


def _field(item: dict[str, Any], name: str) -> Any:
    return item.get(name)
