"""Fleet builders for the claims tests: ready machines, tenants and images in a few inserts."""

from __future__ import annotations

from typing import Any

from sqlmodel import select

from metald.claims.allocation import Selector, create_claim
from metald.lifecycle import State
from metald.provision import netboot
from metald.provision.intents import DeployImage
from metald.store import Store
from metald.store.models import Image, Machine
from metald.tenants.clusters import new_tenant

DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")

#: The disks every test machine recorded at inspection (name -> bytes).
DISKS = {"nvme0n1": 3_840_755_982_336, "nvme1n1": 3_840_755_982_336}
MIB = 1 << 20


def inventory(disks: dict[str, int] | None = None) -> dict[str, Any]:
    """An inspected machine's stored inventory, as far as the wipe check reads it."""
    d = DISKS if disks is None else disks
    return {
        "schema_version": 1,
        "payload": {
            "disks": [{"name": n, "size_bytes": b, "removable": False} for n, b in d.items()]
        },
    }


def wipe_evidence(disks: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """What the agent reports after wiping these disks (bootassets/agent/metald-agent)."""
    d = DISKS if disks is None else disks
    return [
        {
            "device": f"/dev/{n}",
            "size_bytes": b,
            "method": "discard+zero-ends",
            "reads": [
                {"offset": 0, "length": min(MIB, b), "zero": True},
                {"offset": b - min(MIB, b), "length": min(MIB, b), "zero": True},
            ],
        }
        for n, b in d.items()
    ]


def boot_token(store: Store, machine_id: str) -> str | None:
    """The agent token the machine's next script fetch carries (None: no boot armed), as the
    boot hooks mint it."""
    from metald.enrollment import mint_agent_token
    from metald.machines import get_machine

    with store.session() as s:
        return mint_agent_token(s, get_machine(s, machine_id), actor="test", ttl_s=600)


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
                inventory=inventory(),
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
            assert netboot.start_provisioning(s, ids, actor="test") == ids
        return ids
