"""Measured-boot attestation (``metald.provision.attestation``): the agent enrolls its
machine's attestation key, fetches a nonce and submits a quote with its event log; staff read
a machine's attestation and accept new golden values for a held machine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlmodel import Session

from metald import machines
from metald.auth import Principal, Role, require_agent_phase
from metald.provision import attestation as att
from metald.repairs import check_manual, open_of
from metald.store.db import Store
from metald.usecases import Writes
from metald.usecases.machines import load_visible, view_of


def _machine_id(p: Principal) -> str:
    return next(iter(p.scope))


#: Agent phases that attest: discovery (inspect) and wipe boots.
PHASES = {"inspect", "wipe"}


@dataclass
class Attestation:
    store: Store
    #: The request's transactions (an agent token's first use is stamped in the same commit).
    tx: Writes
    instance: str
    notify: Callable[[], None]
    #: The [attestation] settings.
    cfg: Any

    def _roots(self) -> bytes:
        return Path(self.cfg.ek_ca_file).read_bytes() if self.cfg.ek_ca_file else b""

    async def enroll_key(
        self, p: Principal, *, ak_public: bytes, ek_public: str | None,
        ek_certificate: bytes | None, activation_secret: bytes | None, actor: str,
    ) -> dict[str, Any]:  # fmt: skip
        mid, roots, ttl = _machine_id(p), self._roots(), self.cfg.nonce_ttl_s

        def run(s: Session) -> dict[str, Any]:
            require_agent_phase(p, machines.get_machine(s, mid).state, {"inspect"})
            row = att.enroll_key(
                s, mid, ak_public=ak_public, ek_public=ek_public, ek_certificate=ek_certificate,
                activation_secret=activation_secret, boot=p.boot, roots_pem=roots,
                ttl_s=ttl, actor=actor, instance=self.instance,
            )  # fmt: skip
            s.commit()
            if isinstance(row, att.Challenge):
                return {
                    "machine_id": mid, "status": "challenge", "ak_name": row.ak_name,
                    "ek_check": None, "credential": row.credential,
                }  # fmt: skip
            return {
                "machine_id": mid, "status": "enrolled", "ak_name": row.ak_name,
                "ek_check": row.ek_check, "credential": None,
            }  # fmt: skip

        try:
            return await self.tx.run(run)
        finally:
            self.notify()

    async def nonce(self, p: Principal) -> dict[str, Any]:
        mid, ttl = _machine_id(p), self.cfg.nonce_ttl_s

        def run(s: Session) -> dict[str, Any]:
            require_agent_phase(p, machines.get_machine(s, mid).state, PHASES)
            row = att.issue_nonce(s, mid, boot=p.boot, ttl_s=ttl)
            held = att.held_ak_name(s, mid)
            s.commit()
            return {
                "nonce": row.nonce, "expires_at": row.expires_at, "pcrs": self.cfg.pcrs,
                "ak_name": held,
            }  # fmt: skip

        return await self.tx.run(run)

    async def submit(
        self, p: Principal, *, nonce: str, quote: bytes, signature: bytes, event_log: bytes,
        actor: str,
    ) -> dict[str, Any]:  # fmt: skip
        mid, pcrs = _machine_id(p), tuple(self.cfg.pcrs)

        def run(s: Session) -> dict[str, Any]:
            require_agent_phase(p, machines.get_machine(s, mid).state, PHASES)
            row = att.submit(
                s, mid, nonce=nonce, quote=quote, signature=signature, event_log=event_log,
                boot=p.boot, pcrs=pcrs, actor=actor, instance=self.instance,
            )  # fmt: skip
            s.commit()
            m = machines.get_machine(s, mid)
            return {
                "machine_id": mid,
                "id": row.id,
                "status": row.status,
                "reason": row.reason,
                "summary": row.summary,
                "changes": (row.verdict or {}).get("changes", []),
                "state": m.state,
            }

        try:
            return await self.tx.run(run)
        finally:
            self.notify()

    async def show(self, p: Principal, machine_id: str) -> dict[str, Any]:
        return await self.store.read(lambda s: att.view(s, load_visible(s, p, machine_id)))

    async def accept(
        self, p: Principal, machine_id: str, *, actor: str, reason: str,
        expected_version: int | None,
    ) -> dict[str, Any]:  # fmt: skip
        """A technician accepts a held machine's measurements as its new golden values."""

        def run(s: Session) -> dict[str, Any]:
            m = load_visible(s, p, machine_id)
            check_manual(s, m.id, "accept-golden", admin=p.role is Role.ADMIN)
            out = att.accept_golden(
                s, m.id, reason=reason, actor=actor, instance=self.instance,
                expected_version=expected_version,
            )  # fmt: skip
            s.commit()
            return view_of(s, out)

        try:
            return await self.store.run(run)
        finally:
            self.notify()

    async def remove_key(
        self, p: Principal, machine_id: str, *, actor: str, reason: str
    ) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            m = load_visible(s, p, machine_id)
            att.remove_key(s, m.id, reason=reason, actor=actor, instance=self.instance)
            s.commit()
            return att.view(s, m)

        try:
            return await self.store.run(run)
        finally:
            self.notify()

    async def skus(self) -> list[dict[str, Any]]:
        return await self.store.read(att.list_skus)

    async def sku(self, product: str) -> dict[str, Any]:
        return await self.store.read(lambda s: att.sku_view(att.get_sku(s, product)))

    async def set_sku(
        self, product: str, *, reason: str, actor: str, golden: dict[str, Any] | None,
        machine_id: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        """An operator's golden values for a SKU (or a reference machine's boot); held
        machines of that SKU measuring exactly them go back to ready."""
        pcrs = tuple(self.cfg.pcrs)

        def run(s: Session) -> dict[str, Any]:
            row, released = att.set_sku_golden(
                s, product, reason=reason, actor=actor, instance=self.instance, pcrs=pcrs,
                golden=golden, from_machine=machine_id,
                releasable=lambda mid: open_of(s, mid) is None,
            )  # fmt: skip
            s.commit()
            return {**att.sku_view(row), "released": released}

        try:
            return await self.store.run(run)
        finally:
            self.notify()

    async def remove_sku(self, product: str, *, reason: str, actor: str) -> None:
        def run(s: Session) -> None:
            att.remove_sku_golden(s, product, reason=reason, actor=actor, instance=self.instance)
            s.commit()

        try:
            await self.store.run(run)
        finally:
            self.notify()
