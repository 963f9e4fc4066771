"""What the deploy agent on a claimed machine does next: install the claim's image, wipe, join
its tenant's cluster again (a stateless node that rebooted), or nothing."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from sqlmodel import Session, col, select

from metald.claims import tenant_os
from metald.lifecycle import AGENT_OPERATIONS, INSTALLED, State
from metald.provision.metadata import nocloud
from metald.store.models import Claim, Image, Machine, Nic, WgHub
from metald.tenants.clusters import issue_join_token


@dataclass(frozen=True)
class AgentStep:
    #: provision (write ``image``, then ``nocloud``), wipe, join (a stateless node of a tenant
    #: booting again: join with ``join``, nothing to install), or none.
    action: Literal["provision", "wipe", "join", "none"]
    machine_id: str
    image: dict[str, Any] | None = None
    #: cloud-init NoCloud files: meta-data, user-data, network-config.
    nocloud: dict[str, str] | None = None
    #: Where and with what one-time token the node joins (``url``, ``token``, ``expires_at``).
    join: dict[str, str] | None = None
    #: The claim's storage layout on this machine (``metald.provision.storage.Plan``): the
    #: agent writes the image to ``root[0]``; None: the agent's own choice.
    storage: dict[str, Any] | None = None


def next_step(
    s: Session,
    m: Machine | None,
    machine_id: str,
    *,
    actor: str,
    join_url: str,
    join_token_ttl_s: int,
    join_ca: str = "",
    instance: str | None = None,
    settings: tenant_os.TenantOs | None = None,
) -> AgentStep:
    """While provisioning, the image to write and the first-boot metadata (with, for a tenant
    with a hub, a fresh one-time join token); while wiping, ``wipe``; a stateless node of a
    tenant that boots again gets ``join`` with a fresh token; otherwise ``none``. Commits the
    join token it issues."""
    mid = machine_id
    rejoin = m is not None and State(m.state) in INSTALLED
    if m is None or (m.state not in AGENT_OPERATIONS and not rejoin):
        return AgentStep("none", mid)
    if m.state == State.WIPING:
        return AgentStep("wipe", mid)
    c = s.get(Claim, m.claim_id) if m.claim_id else None
    img = s.get(Image, c.image) if c and c.image else None
    if img is None or (rejoin and img.kind != "stateless"):
        # A disk image booted from disk has its seed; only a RAM-booted node asks again.
        return AgentStep("none", mid)
    pxe = s.exec(select(Nic).where(Nic.machine_id == mid, col(Nic.pxe))).first()
    join = None
    if m.tenant_id and s.exec(select(WgHub).where(WgHub.tenant_id == m.tenant_id)).first():
        # A fresh one-time token each time the agent asks (older unused ones are revoked):
        # the node joins with whichever it was given last.
        secret, expires = issue_join_token(
            s,
            mid,
            actor=actor,
            ttl=timedelta(seconds=join_token_ttl_s),
            instance=instance,
            supersede_peer=rejoin,  # the node rebooted: its old key is gone with its RAM
        )
        join = {"url": join_url, "token": secret, "expires_at": expires.isoformat()}
        if join_ca:  # the CA the node pins for an https url (metald.boot.pki)
            join["ca"] = join_ca
    ud = tenant_os.user_data_for(s, c.id, mid) if c else None
    files = nocloud(
        machine_id=mid,
        name=m.name,
        pxe_mac=pxe.mac if pxe else None,
        ssh_authorized_keys=list(c.ssh_authorized_keys or []) if c else [],
        join=join,
        user_data=ud.user_data if ud else None,
        meta_extra=ud.meta_data if ud else None,
        # A machine that joined the claim later (a remediation's replacement) takes its
        # addresses now; the claim's own took theirs with the claim.
        network=(
            tenant_os.network_config(s, settings or tenant_os.TenantOs(), c, m, allocate=True)
            if c and c.network
            else None
        ),
    )
    s.commit()
    if rejoin and join is None:
        return AgentStep("none", mid)
    return AgentStep(
        "join" if rejoin else "provision",
        mid,
        image={"id": img.id, "kind": img.kind, **img.spec},
        nocloud=files,
        join=join,
        storage=tenant_os.storage_plan(c, m) if c else None,
    )
