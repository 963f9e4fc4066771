"""The image catalog's writes: a new image, unique by name, scoped to tenants or public."""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from metald import machines
from metald.errors import Conflict, Unprocessable
from metald.store.models import Image, Tenant


def create_image(
    s: Session,
    *,
    name: str,
    kind: str,
    spec: dict[str, Any],
    tenants: list[str],
    actor: str,
    instance: str | None = None,
) -> Image:
    """Add an image (``spec`` already normalised by ``metald.provision.images``), with an
    ``image.created`` event; a taken name (also by a concurrent request) is 409, an unknown
    tenant 422. ``tenants`` empty: public."""
    taken = f"an image named {name!r} already exists; pick another name"
    if s.exec(select(Image).where(Image.name == name)).first():
        raise Conflict(taken)
    unknown = [t for t in tenants if s.get(Tenant, t) is None]
    if unknown:
        raise Unprocessable(f"tenants: no tenant with id {', '.join(map(repr, unknown))}")
    img = Image(name=name, kind=kind, spec=spec, tenants=tenants, created_by=actor)
    s.add(img)
    s.flush()
    machines.add_event(
        s,
        "image.created",
        actor,
        data={"image_id": img.id, "name": img.name, "kind": img.kind},
        instance=instance,
    )
    try:
        s.commit()
    except IntegrityError:
        s.rollback()
        raise Conflict(taken) from None
    return img
