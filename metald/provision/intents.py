"""Boot intents: the ``Machine.boot_intent`` JSON that drives a machine's iPXE script. Pure.

Keys match ``metald.boot.hooks.target_for_machine``: ``action`` (provision, wipe, local,
inspect), ``kernel``, ``initrd``, ``kernel_args``. Further keys (``image_id``, ``image_kind``)
are for metald itself and ignored by the boot plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeployImage:
    """The agent image that writes disk images and wipes disks (the discovery image)."""

    kernel: str
    initrd: str


def provision_intent(
    image_id: str, kind: str, spec: dict[str, Any], deploy: DeployImage
) -> dict[str, Any]:
    """What a machine boots to install an image."""
    if kind == "stateless":
        args = dict(spec.get("kernel_args") or {})
        if spec.get("rootfs"):
            args["metald.rootfs"] = spec["rootfs"]
        intent: dict[str, Any] = {
            "action": "provision",
            "kernel": spec["kernel"],
            "kernel_args": args,
        }
        if spec.get("initrd"):
            intent["initrd"] = spec["initrd"]
    else:
        args = {
            "metald.mode": "deploy",
            "metald.image.url": spec["url"],
            "metald.image.sha256": spec["sha256"],
            "metald.image.format": spec["format"],
        }
        intent = {
            "action": "provision",
            "kernel": deploy.kernel,
            "initrd": deploy.initrd,
            "kernel_args": args,
        }
    return {**intent, "image_id": image_id, "image_kind": kind}


def wipe_intent(deploy: DeployImage) -> dict[str, Any]:
    """Boot the agent in wipe mode (it erases every disk and reports progress)."""
    return {
        "action": "wipe",
        "kernel": deploy.kernel,
        "initrd": deploy.initrd,
        "kernel_args": {"metald.mode": "wipe"},
    }


def local_intent() -> dict[str, Any]:
    """Boot from the local disk (iPXE exits to the firmware's next boot entry)."""
    return {"action": "local"}


def inspect_intent() -> dict[str, Any]:
    """Boot the discovery image to inspect again."""
    return {"action": "inspect"}


def after_provisioned(intent: dict[str, Any] | None) -> dict[str, Any]:
    """The intent once provisioning is done: a disk image boots from disk from now on; a
    stateless image lives in RAM, so every boot must load it again."""
    if intent and intent.get("image_kind") == "stateless":
        return intent
    return local_intent()
