"""/api/v1/images: the image catalog (staff add images; orchestrators see public ones and
their tenants')."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from api import listing, workflows
from api.paging import PageQuery
from api.resolve import Ref
from api.roles import READERS
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In, ListPage, Name, Text
from metald.usecases.images import Images

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
    arch: Literal["amd64", "arm64"] | None = Field(
        default=None,
        description="The CPU architecture the image is built for (default amd64): only "
        "machines of it are claimed for the image.",
    )
    tenants: list[
        Annotated[str, StringConstraints(min_length=1, max_length=64), Ref("tenants")]
    ] = Field(
        default=[],
        max_length=256,
        description="Tenants (ids, names or 8+ character id prefixes) whose orchestrators may "
        "see and claim it; empty: public.",
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


class ImageList(ListPage[ImageOut]):
    """One page of images."""


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
    use_case=workflows.images,
)
async def create_image(req: ApiRequest, images: Images) -> ImageOut:
    """``stateless``: kernel plus initrd and/or rootfs (booted into RAM). ``disk``: url, sha256
    and format raw (streamed to disk by the agent, .gz unpacked on the fly, sha256 of the raw
    bytes verified by reading back); qcow2 (downloaded into RAM, sha256 checked, written by
    qemu-img and compared)."""
    b: ImageCreate = req.body
    img = await images.create(
        req.require_principal(),
        actor=req.actor,
        name=b.name,
        kind=b.kind,
        spec=b.model_dump(exclude={"name", "kind", "tenants"}),
        tenants=b.tenants,
    )
    return ImageOut.model_validate(img)


@router.route(
    "GET",
    "/api/v1/images",
    summary="List images",
    roles=READERS,
    query=ImageQuery,
    response=ImageList,
    tag="images",
    use_case=workflows.images,
)
async def list_images(req: ApiRequest, images: Images) -> ImageList:
    """The images in the catalog, by name, paginated; for an orchestrator, the public ones and
    its tenants'. URL credentials are REDACTED for all but admins."""
    p = req.require_principal()
    return await listing.listed(req, ImageList, lambda paging: images.list(p, paging))


@router.route(
    "GET",
    "/api/v1/images/{id}",
    summary="Show an image",
    roles=READERS,
    response=ImageOut,
    tag="images",
    errors=(404,),
    use_case=workflows.images,
)
async def show_image(req: ApiRequest, images: Images) -> ImageOut:
    """One image and its spec (URL credentials REDACTED for all but admins)."""
    return ImageOut.model_validate(await images.show(req.require_principal(), req.params["id"]))
