"""``BootHooks`` on metald's machine store: DHCP sightings create and update machines, and a
machine's iPXE script carries what its state and boot intent say, with a fresh agent token when
metald armed its boot.

One class, configured rather than subclassed: ``metald.enrollment.enrollment_boot_hooks``
turns on enrollment over HTTP, the agent console arguments and token minting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from metald import machines
from metald.arch import from_firmware
from metald.boot.dhcp.bootfile import Arch
from metald.boot.hooks import (
    BootAction,
    BootTarget,
    ScriptRefused,
    peer_urls,
    rack_position,
    target_for_machine,
    with_agent_console,
    with_agent_token,
    with_peer_urls,
)
from metald.errors import Conflict, MetaldError
from metald.macaddr import normalize_mac
from metald.store.db import Store
from metald.store.models import Event, Lease, Machine, as_utc, utcnow

if TYPE_CHECKING:
    from metald.fleet.membership import Membership

log = logging.getLogger(__name__)

#: At most one ``boot.image_refused`` event per machine this often (a machine loads its images
#: again every minute while something on the network keeps changing them).
REFUSED_EVERY_S = 30.0
#: Firmware names recorded on machines: the architectures DHCP can tell, not "unknown".
FIRMWARE = frozenset(a.value for a in Arch if a is not Arch.UNKNOWN)


class StoreBootHooks:
    """BootHooks on metald's store.

    - ``mint_agent_token(session, machine, mac, client)``, when given, adds
      ``metald.token=<token>`` to discovery/provision/wipe kernel arguments; it returns None
      when the machine has no boot armed (``metald.provision.boots``): the script is then
      served without a token.
    - ``leased_clients_only``: mint a token only for the address metald's DHCP leased to the
      MAC (see config).
    - ``enroll_unknown``: with ``leased_clients_only``, a MAC metald does not know yet is
      enrolled when the asking address holds its lease, and refused otherwise.
    - ``agent_console``: agent boots get the serial console and quiet kernel arguments
      (``hooks.with_agent_console``).
    - ``fleet`` (the daemon's ``Membership``): a script carrying a
      token also carries ``metald.urls=``, the boot URLs of the other live instances serving
      this instance's provisioning networks, so an agent whose instance dies finishes through
      another (agent tokens live in the store: every instance accepts them).
    """

    def __init__(
        self,
        store: Store,
        instance: str,
        *,
        mint_agent_token: Callable[[Session, Machine, str, str | None], str | None] | None = None,
        leased_clients_only: bool = False,
        enroll_unknown: bool = False,
        agent_console: bool = False,
        fleet: Membership | None = None,
    ) -> None:
        self.store = store
        self.instance = instance
        self.actor = f"metald:{instance}"
        self.mint_agent_token = mint_agent_token
        self.leased_clients_only = leased_clients_only
        self.enroll_unknown = enroll_unknown
        self.agent_console = agent_console
        self.fleet = fleet
        #: Firmware (DHCP architecture) -> why DHCP hands such a client no boot file (an arm64
        #: machine with no arm64 iPXE installed: ``metald.boot.plane.unbootable``). A sighting
        #: of one is logged and recorded on the machine as a ``machine.boot_unavailable`` event.
        self.unbootable: dict[str, str] = {}

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
        position = rack_position(relay_agent)
        firmware = arch if arch in FIRMWARE else None
        # Four columns, not a Machine: the sighting of a new MAC creates it (Core INSERTs,
        # ``insert_machine``), that of a known one compares where and how it booted.
        m = machines.sighting_by_mac(s, mac)
        if m is None:
            try:
                mid = machines.insert_machine(
                    s,
                    macs=[mac],
                    actor=self.actor,
                    rack_position=position,
                    firmware=firmware,
                    reason=f"seen on DHCP ({arch}, network {network})",
                    instance=self.instance,
                    macs_unknown=True,
                )
                s.commit()
            except (Conflict, IntegrityError):
                s.rollback()  # another instance created it at the same moment
                return
            self._unbootable(s, mid, mac, arch)
            return
        self._unbootable(s, m.id, mac, arch)
        # What DHCP tells of a known machine that changed: each change is its own event kind.
        changes: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        if position and m.rack_position != position:
            data = {"from": m.rack_position, "to": position, "relay_agent": relay_agent}
            changes.append(("machine.rack_position", {"rack_position": position}, data))
        if firmware and m.firmware != firmware:
            values: dict[str, Any] = {"firmware": firmware}
            implied = from_firmware(firmware)
            if implied and (m.arch is None or implied != m.arch):
                # The firmware the machine booted now says what it is (a board swapped under
                # the same MAC, or the first sighting of a machine enrolled by its BMC).
                values["arch"] = implied
            data = {"from": m.firmware, "to": firmware, **({"arch": implied} if implied else {})}
            changes.append(("machine.firmware", values, data))
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

    def _unbootable(self, s: Session, machine_id: str, mac: str, arch: str) -> None:
        """Say why a client DHCP cannot boot got no boot file (at most once per DHCP sighting
        report, every few minutes per MAC)."""
        reason = self.unbootable.get(arch)
        if reason is None:
            return
        log.warning("boot: %s (%s): %s", mac, arch, reason)
        machines.add_event(
            s,
            "machine.boot_unavailable",
            self.actor,
            machine_id=machine_id,
            reason=reason,
            data={"mac": mac, "arch": arch},
            instance=self.instance,
        )
        s.commit()

    async def boot_target(self, mac: str, *, client: str | None = None) -> BootTarget:
        return await self.store.run(self._target, mac, client)

    def _target(self, s: Session, mac: str, client: str | None = None) -> BootTarget:
        m = machines.find_by_mac(s, mac)
        if m is None and self.enroll_unknown and self.leased_clients_only:
            m = self._enroll(s, mac, client)
        t = target_for_machine(m)
        if m is not None and self.mint_agent_token and t.action != BootAction.LOCAL:
            if self.leased_clients_only and not holds_lease(s, mac, client):
                # Checked before minting: a refused request neither gets a token nor revokes
                # the machine's current one.
                raise ScriptRefused(
                    f"{client or 'an unknown address'} does not hold the lease of {mac}"
                )
            token = self.mint_agent_token(s, m, mac, client)
            if token is not None:
                t = with_peer_urls(with_agent_token(t, token), self.agent_peer_urls())
        return with_agent_console(t) if self.agent_console else t

    async def image_refused(self, mac: str, *, client: str | None, file: str, errno: str) -> bool:
        """A machine's iPXE says a boot image failed its signature check (metald.boot.signing):
        record ``boot.image_refused`` on the machine (at most one per ``REFUSED_EVERY_S``).
        Only from the address holding the MAC's lease when scripts go to leased clients only;
        ScriptRefused otherwise. Returns whether an event was recorded."""
        return await self.store.run(self._image_refused, mac, client, file, errno)

    def _image_refused(
        self, s: Session, mac: str, client: str | None, file: str, errno: str
    ) -> bool:
        m = machines.find_by_mac(s, mac)
        if m is None or (self.leased_clients_only and not holds_lease(s, mac, client)):
            raise ScriptRefused(
                f"{client or 'an unknown address'} does not hold the lease of {mac}"
            )
        last = s.exec(
            select(Event)
            .where(Event.machine_id == m.id, Event.kind == "boot.image_refused")
            .order_by(Event.id.desc())  # type: ignore[union-attr]
            .limit(1)
        ).first()
        if last is not None and (utcnow() - as_utc(last.at)).total_seconds() < REFUSED_EVERY_S:
            return False
        reason = (
            f"{file or 'a boot image'} failed iPXE's signature check (iPXE error {errno}): "
            "not booted; it came over plain HTTP, so something on the provisioning network "
            "changed it, or the file changed while being served"
        )
        log.warning("boot: %s (%s, from %s): %s", mac, m.id, client, reason)
        machines.add_event(
            s,
            "boot.image_refused",
            self.actor,
            machine_id=m.id,
            reason=reason,
            data={"mac": mac, "file": file, "errno": errno, "client": client},
            instance=self.instance,
        )
        s.commit()
        return True

    def agent_peer_urls(self) -> list[str]:
        """The other live instances' boot URLs an agent may fail over to (``metald.urls=``)."""
        fleet = self.fleet
        if fleet is None:
            return []
        serves = fleet.serves or {}
        own = str(serves.get("boot_url") or "")
        others = [m for m in fleet.live() if m.name != self.instance]
        return peer_urls(own, others, list(serves.get("provisioning_networks") or []))

    def _enroll(self, s: Session, mac: str, client: str | None) -> Machine | None:
        """Only a client holding the lease metald's DHCP gave this MAC is enrolled over HTTP;
        anyone else asking for a random MAC's script creates nothing (refused). In "any" mode
        the DHCP sighting (``client_seen``) enrolls machines, and an unknown MAC gets the
        discovery script with no token and no record."""
        if not holds_lease(s, mac, client):
            raise ScriptRefused(
                f"{client or 'an unknown address'} does not hold the lease of {mac}"
            )
        try:
            return machines.create_machine(
                s,
                macs=[mac],
                actor=self.actor,
                reason="asked for its boot script",
                instance=self.instance,
            )
        except MetaldError:
            s.rollback()  # created concurrently by DHCP or another instance
            return machines.find_by_mac(s, mac)


def holds_lease(s: Session, mac: str, client: str | None) -> bool:
    """Whether ``client`` is the address metald's DHCP has bound to ``mac`` (unexpired)."""
    if not client:
        return False
    now = datetime.now(UTC)
    for lease in s.exec(
        select(Lease).where(
            Lease.mac == normalize_mac(mac),
            Lease.ip == client,
            Lease.state == "bound",
        )
    ):
        if as_utc(lease.expires_at) > now:
            return True
    return False
