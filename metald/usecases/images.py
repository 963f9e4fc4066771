"""The image catalog as the API shows and grows it: staff add images and see them all; an
orchestrator sees the public ones and its tenants'. URL credentials and secret-looking kernel
arguments read REDACTED for all but admins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, select

from metald.auth import Principal, Role
from metald.claims import images
from metald.errors import NotFound
from metald.provision.images import normalize_spec
from metald.provision.redact import redact_spec
from metald.store.models import Image
from metald.usecases import Transactions
from metald.usecases.reads import Page, Pager, page, page_items

#: By name.
DEFAULT_ORDER = ["name", "id"]


def image_view(img: Image, p: Principal) -> dict[str, Any]:
    out = img.model_dump()
    if p.role is not Role.ADMIN:
        out["spec"] = redact_spec(dict(out["spec"]))
    return out


def visible(img: Image, p: Principal) -> bool:
    """Staff see every image; an orchestrator public ones and its tenants'."""
    if p.role is not Role.ORCHESTRATOR:
        return True
    return not img.tenants or any(p.can_see_tenant(t) for t in img.tenants)


@dataclass
class Images:
    store: Transactions
    instance: str

    async def create(
        self,
        p: Principal,
        *,
        actor: str,
        name: str,
        kind: str,
        spec: dict[str, Any],
        tenants: list[str],
    ) -> dict[str, Any]:
        """Add an image (its spec normalised: ``metald.provision.images``)."""
        normalized = normalize_spec(kind, spec)
        scope = sorted(set(tenants))

        def run(s: Session) -> dict[str, Any]:
            img = images.create_image(
                s,
                name=name,
                kind=kind,
                spec=normalized,
                tenants=scope,
                actor=actor,
                instance=self.instance,
            )
            return image_view(img, p)

        return await self.store.run(run)

    async def list(self, p: Principal, pager: Pager) -> Page[dict[str, Any]]:
        """The images the caller may see, by name."""

        def views(_: Any, rows: list[Image]) -> list[dict[str, Any]]:
            return [image_view(i, p) for i in rows]

        def run(s: Session) -> Page[dict[str, Any]]:
            if p.role is Role.ORCHESTRATOR:
                # Tenant scope is a JSON list: filtered here (catalogs are small), then paged.
                seen = [i for i in s.exec(select(Image)) if visible(i, p)]
                return page_items(seen, pager, DEFAULT_ORDER, lambda rows: views(s, rows))
            return page(s, select(Image), Image, pager, DEFAULT_ORDER, views)

        return await self.store.read(run)

    async def show(self, p: Principal, image_id: str) -> dict[str, Any]:
        def run(s: Session) -> dict[str, Any]:
            img = s.get(Image, image_id)
            if img is None or not visible(img, p):
                raise NotFound(f"no image with id {image_id!r}")
            return image_view(img, p)

        return await self.store.run(run)
