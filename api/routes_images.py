"""/api/v1/images: the image catalog (staff add images; orchestrators see public ones and
their tenants')."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints
from sqlalchemy import func
from sqlmodel import Session, select

from api.paging import PageQuery, page_items, page_rows
from api.roles import READERS
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In, Name, Text
from metald.auth import Principal, Role
from metald.claims import images
from metald.errors import NotFound
from metald.provision.images import normalize_spec
from metald.provision.redact import redact_spec
from metald.store.models import Image

router = Router()


class ImageCreate(In):
    name: Name
    kind: Literal["stateless", "disk"]
    kernel: Text | None = Field(default=None, description="stateless: kernel URL or asset path.")
    initrd: Text | None = Field(default=None, description="stateless: initrd URL or asset path.")
    rootfs: Text | None = Field(default=None, description="stateless: rootfs URL or asset path.")
    kernel_args: dict[str, str] | None = Field(default=None, max_length=64)
    url: Text | None = Field(default=None, description="disk: http(s) URL of the image.")
    sha256: Text | None = Field(default=None, description="disk: SHA-256, 64 hex digits.")
    format: Literal["raw", "qcow2"] | None = None
    size_bytes: int | None = Field(default=None, gt=0)
    tenants: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(
        default=[],
        max_length=256,
        description="Tenant ids whose orchestrators may see and claim it; empty: public.",
    )


class ImageOut(BaseModel):
    id: str
    name: str
    kind: str
    spec: dict[str, Any] = Field(
        description="As stored for admins; for others URL credentials (userinfo, signature "
        "and token query values) and secret-looking kernel arguments read REDACTED."
    )
    tenants: list[str]
    created_by: str | None
    created_at: datetime


class ImageQuery(PageQuery):
    SORTABLE = ("name", "kind", "created_at")


class ImageList(BaseModel):
    items: list[ImageOut]
    total: int
    limit: int
    offset: int
    next: str | None = Field(default=None, description="The next page, absent on the last.")


def _image_out(img: Image, p: Principal) -> ImageOut:
    out = ImageOut.model_validate(img.model_dump())
    if p.role is not Role.ADMIN:
        out.spec = redact_spec(out.spec)
    return out


def _image_visible(img: Image, p: Principal) -> bool:
    """Staff see every image; an orchestrator public ones and its tenants'."""
    if p.role is not Role.ORCHESTRATOR:
        return True
    return not img.tenants or any(p.can_see_tenant(t) for t in img.tenants)


@router.route(
    "POST",
    "/api/v1/images",
    summary="Add an image",
    roles=STAFF,
    body=ImageCreate,
    response=ImageOut,
    status=201,
    tag="images",
    errors=(409, 422),
    location="/api/v1/images/{id}",
)
async def create_image(req: ApiRequest) -> ImageOut:
    """``stateless``: kernel plus initrd and/or rootfs (booted into RAM). ``disk``: url, sha256
    and format raw (streamed to disk by the agent, .gz unpacked on the fly, sha256 of the raw
    bytes verified by reading back); qcow2 (downloaded into RAM, sha256 checked, written by
    qemu-img and compared)."""
    b: ImageCreate = req.body
    spec = normalize_spec(b.kind, b.model_dump(exclude={"name", "kind", "tenants"}))
    scope = sorted(set(b.tenants))

    def run(s: Session) -> ImageOut:
        img = images.create_image(
            s,
            name=b.name,
            kind=b.kind,
            spec=spec,
            tenants=scope,
            actor=req.actor,
            instance=req.ctx.instance,
        )
        return _image_out(img, req.require_principal())

    return await req.ctx.store.run(run)


@router.route(
    "GET",
    "/api/v1/images",
    summary="List images",
    roles=READERS,
    query=ImageQuery,
    response=ImageList,
    tag="images",
)
async def list_images(req: ApiRequest) -> ImageList:
    """The images in the catalog, by name, paginated; for an orchestrator, the public ones and
    its tenants'. URL credentials are REDACTED for all but admins."""
    p = req.require_principal()
    q: ImageQuery = req.query
    limit = req.page_limit(q)

    def run(s: Session) -> ImageList:
        if p.role is Role.ORCHESTRATOR:
            # Tenant scope is a JSON list: filtered here (catalogs are small), then paged.
            visible = [i for i in s.exec(select(Image)) if _image_visible(i, p)]
            total = len(visible)
            page, cursor = page_items(visible, q, ["name", "id"], limit, getattr)
        else:
            total = s.exec(select(func.count()).select_from(Image)).one()
            page, cursor = page_rows(s, select(Image), Image, q, ["name", "id"], limit)
        return ImageList(
            items=[_image_out(i, p) for i in page],
            total=total,
            limit=limit,
            offset=q.offset,
            next=req.next_link(cursor),
        )

    return await req.ctx.store.read(run)


@router.route(
    "GET",
    "/api/v1/images/{id}",
    summary="Show an image",
    roles=READERS,
    response=ImageOut,
    tag="images",
    errors=(404,),
)
async def show_image(req: ApiRequest) -> ImageOut:
    """One image and its spec (URL credentials REDACTED for all but admins)."""
    p = req.require_principal()

    def run(s: Session) -> ImageOut:
        img = s.get(Image, req.params["id"])
        if img is None or not _image_visible(img, p):
            raise NotFound(f"no image with id {req.params['id']!r}")
        return _image_out(img, p)

    return await req.ctx.store.run(run)
