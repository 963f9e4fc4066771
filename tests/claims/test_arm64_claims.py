"""Claims and images by CPU architecture: an image declares what it is built for, a claim
takes machines of that architecture only (its selector may name it, never another), and
machines with none recorded count as amd64 (all of them were, before arm64)."""

from __future__ import annotations

import pytest
from sqlmodel import select

from metald.claims.allocation import Selector, create_claim
from metald.errors import Unprocessable
from metald.inventory.normalize import normalize
from metald.inventory.schema import InventoryPayload
from metald.provision.images import normalize_spec
from metald.store.models import Machine
from tests.claims.helpers import DEPLOY, DISK_SPEC, add_image, add_ready, add_tenant
from vmlab.inventory import payload


def _set_arch(store, ids: list[str], arch: str | None) -> None:  # type: ignore[no-untyped-def]
    with store.session() as s:
        for mid in ids:
            m = s.get(Machine, mid)
            m.arch = arch
            s.add(m)
        s.commit()


def _claim(store, tenant: str, n: int, selector: Selector, image: str) -> list[str]:  # type: ignore[no-untyped-def]
    with store.session() as s:
        claim, _ = create_claim(s, tenant, n, selector, image, None, "test", deploy=DEPLOY)
        return sorted(
            m.arch or "none"
            for m in s.exec(select(Machine).where(Machine.claim_id == claim.id)).all()
        )


def test_an_image_declares_its_arch() -> None:
    assert normalize_spec("disk", DISK_SPEC)["arch"] == "amd64"
    assert normalize_spec("disk", {**DISK_SPEC, "arch": "arm64"})["arch"] == "arm64"
    with pytest.raises(Unprocessable, match="arch must be one of amd64, arm64"):
        normalize_spec("disk", {**DISK_SPEC, "arch": "riscv64"})


def test_claims_take_machines_of_the_images_arch(store) -> None:  # type: ignore[no-untyped-def]
    arm = add_ready(store, 2, prefix="grace")
    _set_arch(store, arm, "arm64")
    x86 = add_ready(store, 2, prefix="x")
    _set_arch(store, x86[:1], "amd64")  # the other has none recorded: amd64
    tenant = add_tenant(store, "acme")
    arm_image = add_image(store, "node-arm64", spec={**DISK_SPEC, "arch": "arm64"})
    x86_image = add_image(store, "node")  # registered before arm64: no arch in its spec

    assert _claim(store, tenant, 2, Selector(), arm_image) == ["arm64", "arm64"]
    with pytest.raises(Unprocessable, match="0 of them are ready"):
        _claim(store, tenant, 1, Selector(arch="arm64"), arm_image)  # all taken
    assert _claim(store, tenant, 2, Selector(arch="amd64"), x86_image) == ["amd64", "none"]


def test_a_selector_asking_for_another_arch_than_the_images_is_refused(store) -> None:  # type: ignore[no-untyped-def]
    _set_arch(store, add_ready(store, 1), "arm64")
    tenant = add_tenant(store, "acme")
    x86_image = add_image(store, "node")
    with pytest.raises(Unprocessable, match="built for amd64 .* asks for arm64") as e:
        _claim(store, tenant, 1, Selector(arch="arm64"), x86_image)
    assert "pick an image built for arm64" in str(e.value)
    # nor does an amd64 image land on the arm64 machine without the selector saying so
    with pytest.raises(Unprocessable, match="0 match the selector"):
        _claim(store, tenant, 1, Selector(), x86_image)
    with pytest.raises(Unprocessable, match="selector arch must be one of"):
        _claim(store, tenant, 1, Selector(arch="sparc"), x86_image)


def test_the_inventory_says_the_arch() -> None:
    for uname, want in (("aarch64", "arm64"), ("x86_64", "amd64"), ("mips", None), (None, None)):
        p = payload()
        if uname is not None:
            p["cpu"]["arch"] = uname
        n = normalize(InventoryPayload.model_validate(p))
        assert n.arch == want
        assert n.machine_fields().get("arch") == want  # None: DHCP's word is kept
        assert ("arch" in n.machine_fields()) is (want is not None)
