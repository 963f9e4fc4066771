"""Fleet builders for the claims tests: ready machines, tenants and images in a few inserts."""

from __future__ import annotations

from typing import Any

from sqlmodel import select

from metald.claims import Selector, create_claim
from metald.lifecycle import State
from metald.provision import driver
from metald.provision.intents import DeployImage
from metald.store import Store
from metald.store.models import Image, Machine
from metald.tenants.service import new_tenant

DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")

DISK_SPEC = {"url": "http://images.test/node.raw", "sha256": "ab" * 32, "format": "raw"}
STATELESS_SPEC = {
    "kernel": "node/vmlinuz",
    "initrd": "node/initrd.img",
    "kernel_args": {"console": "ttyS0"},
}


def add_ready(
    store: Store,
    n: int,
    *,
    gpu_model: str = "NVIDIA H100 80GB HBM3",
    gpu_count: int = 8,
    memory_mb: int = 2_000_000,
    labels: dict[str, str] | None = None,
    rack: str | None = None,
    prefix: str = "m",
) -> list[str]:
    """``n`` inspected, ready, unallocated machines (inserted directly: the lifecycle up to
    ready is tested elsewhere)."""
    with store.session() as s:
        rows = [
            Machine(
                name=f"{prefix}{i}",
                state=State.READY.value,
                gpu_model=gpu_model,
                gpu_count=gpu_count,
                memory_mb=memory_mb,
                labels=dict(labels or {}),
                rack=rack,
                inventory={"schema_version": 1},
            )
            for i in range(n)
        ]
        s.add_all(rows)
        s.commit()
        return [m.id for m in rows]


def add_tenant(store: Store, name: str) -> str:
    """A tenant with the next free VLAN, as the API creates them."""
    with store.session() as s:
        t = new_tenant(s, name=name, cluster_kind="slurm")
        s.commit()
        return t.id


def add_image(store: Store, name: str = "node", kind: str = "disk", spec: Any = None) -> str:
    with store.session() as s:
        img = Image(
            name=name, kind=kind, spec=spec or (DISK_SPEC if kind == "disk" else STATELESS_SPEC)
        )
        s.add(img)
        s.commit()
        return img.id


def claimed(store: Store, n: int = 1, *, provision: bool = True) -> list[str]:
    """``n`` machines claimed for a new tenant, and (by default) provisioning."""
    add_ready(store, n)
    tenant = add_tenant(store, "acme")
    with store.session() as s:
        claim, _ = create_claim(
            s, tenant, n, Selector(), add_image(store), None, "test", deploy=DEPLOY
        )
        ids = [m.id for m in s.exec(select(Machine).where(Machine.claim_id == claim.id))]
        if provision:
            assert driver.start_provisioning(s, ids, actor="test") == ids
        return ids
