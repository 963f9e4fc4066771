"""The one coupling between the boot plane and the rest of metald.

``BootHooks`` is what the boot plane calls: it reports clients it saw on DHCP and asks what a
machine should boot. ``StoreBootHooks`` implements it on the machine store; ``MemoryBootHooks``
is a plain in-memory one for tests and tools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

from sqlmodel import Session, select

from metald import machines
from metald.boot.dhcp.bootfile import Arch
from metald.errors import Conflict
from metald.lifecycle import UNINSPECTED, State
from metald.store.db import Store
from metald.store.models import Lease, Machine, as_utc

log = logging.getLogger(__name__)


class BootAction(StrEnum):
    DISCOVERY = "discovery"  # unknown or not yet inspected: boot the discovery image
    INSPECT = "inspect"  # re-inspection: the discovery image again
    PROVISION = "provision"  # boot the claim's image
    WIPE = "wipe"  # boot the wipe image
    LOCAL = "local"  # boot from local disk (exit iPXE)


@dataclass(frozen=True)
class BootTarget:
    action: BootAction
    #: Paths under the assets folder (or absolute URLs) for kernel and initrd.
    kernel: str | None = None
    initrd: str | None = None
    #: Extra kernel command-line arguments, e.g. ``metald.token=...`` for the agent.
    kernel_args: dict[str, str] = field(default_factory=dict)
    machine_id: str | None = None


class BootHooks(Protocol):
    async def client_seen(
        self, mac: str, *, arch: str, network: str | None, relay_agent: dict[str, str] | None
    ) -> None:
        """DHCP saw a network-booting client (called at most every few minutes per MAC)."""

    async def boot_target(self, mac: str, *, client: str | None = None) -> BootTarget:
        """What the iPXE script for ``mac`` should do; ``client`` is the address asking.
        Raises ``ScriptRefused`` when that address may not have this machine's script."""


class ScriptRefused(Exception):
    """The script would carry an agent token and the asking address does not hold the MAC's
    lease (``[boot] script_clients = "leased"``)."""


#: Kernel and initrd of the discovery image, under the assets folder (built by bootassets/).
DISCOVERY_KERNEL = "discovery/vmlinuz"
DISCOVERY_INITRD = "discovery/initrd.img"


def target_for_machine(m: Machine | None) -> BootTarget:
    """Pure: the boot target implied by a machine's state and boot intent."""
    if m is None:
        return BootTarget(BootAction.DISCOVERY, DISCOVERY_KERNEL, DISCOVERY_INITRD)
    intent = m.boot_intent or {}
    state = State(m.state)
    args = {str(k): str(v) for k, v in (intent.get("kernel_args") or {}).items()}
    if intent.get("action") in {a.value for a in BootAction}:
        action = BootAction(intent["action"])
    elif state in UNINSPECTED:
        action = BootAction.DISCOVERY
    elif state is State.PROVISIONING:
        action = BootAction.PROVISION
    elif state is State.WIPING:
        action = BootAction.WIPE
    else:
        action = BootAction.LOCAL
    if action in (BootAction.DISCOVERY, BootAction.INSPECT):
        kernel = intent.get("kernel", DISCOVERY_KERNEL)
        initrd = intent.get("initrd", DISCOVERY_INITRD)
    else:
        kernel, initrd = intent.get("kernel"), intent.get("initrd")
    if action in (BootAction.PROVISION, BootAction.WIPE) and not kernel:
        # Nothing to boot yet: stay on local disk rather than hang in iPXE.
        action = BootAction.LOCAL
    return BootTarget(action, kernel, initrd, args, m.id)


class StoreBootHooks:
    """BootHooks on metald's store. ``mint_agent_token(session, machine, mac, client)``, when
    given, adds ``metald.token=<token>`` to discovery/provision/wipe kernel arguments; it
    returns None when the machine has no boot armed (``metald.provision.boots``): the script is
    then served without a token."""

    def __init__(
        self,
        store: Store,
        instance: str,
        *,
        mint_agent_token: Callable[[Session, Machine, str, str | None], str | None] | None = None,
        leased_clients_only: bool = False,
    ) -> None:
        self.store = store
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.mint_agent_token = mint_agent_token
        #: Mint a token only for the address metald's DHCP leased to the MAC (see config).
        self.leased_clients_only = leased_clients_only

    async def client_seen(
        self, mac: str, *, arch: str, network: str | None, relay_agent: dict[str, str] | None
    ) -> None:
        await self.store.run(self._seen, mac, arch, network, relay_agent)

    def _seen(
        self,
        s: Session,
        mac: str,
        arch: str,
        network: str | None,
        relay_agent: dict[str, str] | None,
    ) -> None:
        position = _rack_position(relay_agent)
        firmware = arch if arch in FIRMWARE else None
        m = machines.find_by_mac(s, mac)
        if m is None:
            try:
                machines.create_machine(
                    s,
                    macs=[mac],
                    actor=self.actor,
                    rack_position=position,
                    firmware=firmware,
                    reason=f"seen on DHCP ({arch}, network {network})",
                    instance=self.instance,
                )
            except Conflict:
                s.rollback()  # another instance created it at the same moment
            return
        # What DHCP tells of a known machine that changed: each change is its own event kind.
        changes: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        if position and m.rack_position != position:
            data = {"from": m.rack_position, "to": position, "relay_agent": relay_agent}
            changes.append(("machine.rack_position", {"rack_position": position}, data))
        if firmware and m.firmware != firmware:
            changes.append(
                ("machine.firmware", {"firmware": firmware}, {"from": m.firmware, "to": firmware})
            )
        for kind, values, data in changes:
            try:
                machines.update_fields(
                    s,
                    m.id,
                    actor=self.actor,
                    kind=kind,
                    values=values,
                    data=data,
                    instance=self.instance,
                )
            except Conflict:
                s.rollback()  # changed by someone else meanwhile: the next report retries
                return

    async def boot_target(self, mac: str, *, client: str | None = None) -> BootTarget:
        return await self.store.run(self._target, mac, client)

    def _target(self, s: Session, mac: str, client: str | None = None) -> BootTarget:
        return self._target_for(s, machines.find_by_mac(s, mac), mac, client)

    def _target_for(
        self, s: Session, m: Machine | None, mac: str, client: str | None
    ) -> BootTarget:
        t = target_for_machine(m)
        if m is not None and self.mint_agent_token and t.action != BootAction.LOCAL:
            if self.leased_clients_only and not holds_lease(s, mac, client):
                # Checked before minting: a refused request neither gets a token nor revokes
                # the machine's current one.
                raise ScriptRefused(
                    f"{client or 'an unknown address'} does not hold the lease of {mac}"
                )
            token = self.mint_agent_token(s, m, mac, client)
            if token is None:
                return t
            t = BootTarget(
                t.action, t.kernel, t.initrd, {**t.kernel_args, "metald.token": token}, t.machine_id
            )
        return t


#: Firmware names recorded on machines: the architectures DHCP can tell, not "unknown".
FIRMWARE = frozenset(a.value for a in Arch if a is not Arch.UNKNOWN)


def holds_lease(s: Session, mac: str, client: str | None) -> bool:
    """Whether ``client`` is the address metald's DHCP has bound to ``mac`` (unexpired)."""
    if not client:
        return False
    now = datetime.now(UTC)
    for lease in s.exec(
        select(Lease).where(
            Lease.mac == machines.normalize_mac(mac),
            Lease.ip == client,
            Lease.state == "bound",
        )
    ):
        if as_utc(lease.expires_at) > now:
            return True
    return False


def _rack_position(relay_agent: dict[str, str] | None) -> str | None:
    """Option 82 as one string: ``remote-id/circuit-id`` (switch / port)."""
    if not relay_agent:
        return None
    parts = [relay_agent.get("remote_id"), relay_agent.get("circuit_id")]
    joined = "/".join(p for p in parts if p)
    return joined or None


class MemoryBootHooks:
    """In-memory hooks: records what was seen, returns a per-MAC or default target."""

    def __init__(self, default: BootTarget | None = None) -> None:
        self.seen: list[dict[str, Any]] = []
        self.targets: dict[str, BootTarget] = {}
        self.default = default or target_for_machine(None)

    async def client_seen(
        self, mac: str, *, arch: str, network: str | None, relay_agent: dict[str, str] | None
    ) -> None:
        self.seen.append({"mac": mac, "arch": arch, "network": network, "relay_agent": relay_agent})

    async def boot_target(self, mac: str, *, client: str | None = None) -> BootTarget:
        return self.targets.get(mac, self.default)
