"""Fleet builders for the claims tests: ready machines, tenants and images in a few inserts."""

from __future__ import annotations

from typing import Any

from metald.lifecycle import State
from metald.store import Store
from metald.store.models import Image, Machine, Tenant

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
    with store.session() as s:
        t = Tenant(name=name)
        s.add(t)
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
