"""``metalctl images``: the images machines are provisioned with."""

from __future__ import annotations

import argparse

from .client import Client
from .options import Subparsers
from .output import emit, emit_table

COLUMNS = [("ID", "id"), ("NAME", "name"), ("KIND", "kind")]
BODY_FIELDS = ("name", "kind", "sha256", "size_bytes", "kernel", "initrd", "rootfs", "arch")


def register(sub: Subparsers) -> None:
    im = sub.add_parser("images", help="images machines are provisioned with")
    isub = im.add_subparsers(dest="sub", required=True)
    isub.add_parser("list", help="the image catalog").set_defaults(func=list_images)
    shw = isub.add_parser("show", help="one image")
    shw.add_argument("id", help="id, name or id prefix")
    shw.set_defaults(func=show)
    ic = isub.add_parser("create", help="add an image to the catalog")
    ic.add_argument("name")
    ic.add_argument("--kind", choices=["disk", "stateless"], default="disk")
    # dest differs from metalctl's own --url (the API's address), which it would overwrite.
    ic.add_argument("--url", dest="image_url", help="disk: http(s) URL of the raw image")
    ic.add_argument("--sha256")
    ic.add_argument("--size", type=int, dest="size_bytes")
    ic.add_argument("--kernel")
    ic.add_argument("--initrd")
    ic.add_argument("--rootfs")
    ic.add_argument(
        "--arch", choices=("amd64", "arm64"), help="CPU architecture it is built for (amd64)"
    )
    ic.set_defaults(func=create)


def list_images(args: argparse.Namespace, c: Client) -> None:
    emit_table(args, c.call("GET", "/api/v1/images"), COLUMNS)


def create(args: argparse.Namespace, c: Client) -> None:
    body = {k: getattr(args, k) for k in BODY_FIELDS if getattr(args, k) is not None}
    if args.image_url:
        body["url"] = args.image_url
    r = c.call("POST", "/api/v1/images", body)
    emit(args, r, lambda r: f"image {r['id']} ({r['name']}) created")


def show(args: argparse.Namespace, c: Client) -> None:
    r = c.call("GET", f"/api/v1/images/{args.id}")
    emit(
        args, r, lambda r: "\n".join(f"{k + ':':15} {'' if v is None else v}" for k, v in r.items())
    )
