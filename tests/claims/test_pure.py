"""The I/O-free parts: image specs, boot intents, selectors, progress outcomes, watchdog limits."""

from __future__ import annotations

from datetime import timedelta

import pytest

from metald.boot.hooks import BootAction, target_for_machine
from metald.claims.allocation import Selector
from metald.config import ProvisionConfig
from metald.errors import Conflict, Unprocessable
from metald.lifecycle import TIMEOUTS, State, Trigger
from metald.provision.images import normalize_spec
from metald.provision.intents import (
    DeployImage,
    after_provisioned,
    local_intent,
    provision_intent,
    wipe_intent,
)
from metald.provision.progress import Progress, outcome
from metald.provision.watchdog import overdue, timeouts
from metald.store.models import Machine, utcnow
from tests.claims.helpers import DISK_SPEC, STATELESS_SPEC

DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")


def test_disk_spec_normalised() -> None:
    spec = normalize_spec("disk", {**DISK_SPEC, "sha256": "AB" * 32, "format": None})
    assert spec == {"url": DISK_SPEC["url"], "sha256": "ab" * 32, "format": "raw", "arch": "amd64"}


@pytest.mark.parametrize(
    ("kind", "data", "phrase"),
    [
        ("disk", {"url": "ftp://x/y", "sha256": "ab" * 32}, "http:// or https://"),
        ("disk", {"url": "http://x/y", "sha256": "ab" * 31}, "64 hexadecimal"),
        (
            "disk",
            {"url": "http://x/y", "sha256": "ab" * 32, "format": "vmdk"},
            "must be one of raw, qcow2",
        ),
        (
            "disk",
            {"url": "http://x/y.gz", "sha256": "ab" * 32, "format": "qcow2"},
            "do not gzip",
        ),
        ("disk", {"url": "http://x/y", "sha256": "ab" * 32, "kernel": "k"}, "does not take"),
        ("stateless", {"kernel": "k"}, "initrd or a rootfs"),
        ("stateless", {"initrd": "i"}, "needs a kernel"),
        ("stateless", {"kernel": "../etc/passwd", "initrd": "i"}, "no '..'"),
        ("stateless", {"kernel": "/boot/vmlinuz", "initrd": "i"}, "no leading"),
        ("stateless", {"kernel": "k", "initrd": "i", "kernel_args": {"a b": "1"}}, "letters"),
        ("stateless", {"kernel": "k", "initrd": "i", "kernel_args": {"metald.x": "1"}}, "reserved"),
        ("stateless", {"kernel": "k", "initrd": "i", "kernel_args": {"x": "1 2"}}, "spaces"),
        ("vm", {}, "kind must be"),
    ],
)
def test_bad_specs_refused_with_reason(kind: str, data: dict, phrase: str) -> None:
    with pytest.raises(Unprocessable, match=phrase):
        normalize_spec(kind, data)


def _machine(state: State, intent: dict | None, **kw: object) -> Machine:
    return Machine(id="m1", state=state.value, boot_intent=intent, **kw)  # type: ignore[arg-type]


def test_intents_drive_the_boot_target() -> None:
    disk = provision_intent("img1", "disk", DISK_SPEC, DEPLOY)
    t = target_for_machine(_machine(State.PROVISIONING, disk))
    assert t.action is BootAction.PROVISION and t.kernel == DEPLOY.kernel
    assert t.kernel_args["metald.image.sha256"] == DISK_SPEC["sha256"]
    assert t.kernel_args["metald.mode"] == "deploy"

    stateless = provision_intent(
        "img2", "stateless", {**STATELESS_SPEC, "rootfs": "node/root.squashfs"}, DEPLOY
    )
    t = target_for_machine(_machine(State.PROVISIONING, stateless))
    assert (t.kernel, t.initrd) == ("node/vmlinuz", "node/initrd.img")
    assert t.kernel_args == {"console": "ttyS0", "metald.rootfs": "node/root.squashfs"}

    t = target_for_machine(_machine(State.WIPING, wipe_intent(DEPLOY)))
    assert t.action is BootAction.WIPE and t.kernel_args == {"metald.mode": "wipe"}
    assert (
        target_for_machine(_machine(State.PROVISIONED, local_intent())).action is BootAction.LOCAL
    )


def test_after_provisioned_keeps_ram_images_only() -> None:
    stateless = provision_intent("i", "stateless", STATELESS_SPEC, DEPLOY)
    assert after_provisioned(stateless) == stateless
    assert after_provisioned(provision_intent("i", "disk", DISK_SPEC, DEPLOY)) == local_intent()
    assert after_provisioned(None) == local_intent()


def test_selector_matching() -> None:
    m = Machine(
        state="ready",
        gpu_model="NVIDIA H100 80GB HBM3",
        gpu_count=8,
        memory_mb=1024,
        labels={"pool": "train", "zone": "a"},
        rack="r1",
    )
    assert Selector().matches(m)
    assert Selector(gpu_model="NVIDIA H100*", min_gpu_count=8, labels={"pool": "train"}).matches(m)
    assert Selector(gpu_model="NVIDIA H100 80GB HBM3", rack="r1", min_memory_mb=1024).matches(m)
    for sel in [
        Selector(gpu_model="NVIDIA H100"),  # exact means exact
        Selector(gpu_model="*A100*"),
        Selector(min_gpu_count=9),
        Selector(min_memory_mb=2048),
        Selector(labels={"pool": "infer"}),
        Selector(labels={"missing": "x"}),
        Selector(rack="r2"),
    ]:
        assert not sel.matches(m), sel
    assert Selector.from_dict(Selector(labels={"a": "b"}).to_dict()) == Selector(labels={"a": "b"})


def test_progress_outcomes() -> None:
    assert outcome(State.PROVISIONING, Progress("write", percent=40)) == (None, {})
    trig, upd = outcome(State.PROVISIONING, Progress("verify", done=True))
    assert trig is Trigger.PROVISIONED
    trig, upd = outcome(State.PROVISIONING, Progress("verify", error="sha256 mismatch"))
    assert trig is Trigger.PROVISION_FAIL and upd["last_error"] == "sha256 mismatch"
    trig, upd = outcome(State.WIPING, Progress("wipe", done=True))
    assert trig is Trigger.WIPED and upd["tenant_id"] is None and upd["boot_intent"] is None
    trig, _ = outcome(State.WIPING, Progress("wipe", error="nvme0 format failed"))
    assert trig is Trigger.WIPE_FAIL
    with pytest.raises(Conflict, match="only while it is provisioning or wiping"):
        outcome(State.READY, Progress("write"))
    with pytest.raises(Unprocessable, match="both done and an error"):
        outcome(State.WIPING, Progress("wipe", done=True, error="x"))


def test_watchdog_limits_and_overdue() -> None:
    cfg = ProvisionConfig(provisioning_timeout_s=60, joining_timeout_s=0)
    limits = timeouts(cfg)
    assert set(limits) == set(TIMEOUTS) - {State.JOINING}
    now = utcnow()
    old = now - timedelta(seconds=61)
    rows = [
        Machine(id="a", state="provisioning", state_changed_at=old),
        Machine(id="b", state="provisioning", state_changed_at=now - timedelta(seconds=59)),
        Machine(id="c", state="joining", state_changed_at=now - timedelta(days=9)),
        Machine(id="d", state="ready", state_changed_at=old),
        # SQLite hands back naive UTC timestamps.
        Machine(
            id="e", state="wiping", state_changed_at=(now - timedelta(days=1)).replace(tzinfo=None)
        ),
    ]
    assert [m.id for m in overdue(rows, limits, now)] == ["a", "e"]


def test_nocloud_metadata() -> None:
    import json

    from metald.provision.metadata import nocloud

    files = nocloud(
        machine_id="0123456789ab",
        name=None,
        pxe_mac="52:54:00:00:00:01",
        ssh_authorized_keys=["ssh-ed25519 AAAA x@y"],
        join={"url": "http://10.1.0.1:8080", "token": "jt-1", "expires_at": "2026-12-02T16:00:00Z"},
    )
    assert json.loads(files["meta-data"]) == {
        "instance-id": "0123456789ab",
        "local-hostname": "node-01234567",
    }
    header, body = files["user-data"].split("\n", 1)
    user = json.loads(body)
    assert header == "#cloud-config" and user["ssh_authorized_keys"] == ["ssh-ed25519 AAAA x@y"]
    (entry,) = user["write_files"]
    assert entry["path"] == "/etc/metald/join.json" and entry["permissions"] == "0600"
    assert json.loads(entry["content"]) == {
        "url": "http://10.1.0.1:8080",
        "token": "jt-1",
        "expires_at": "2026-12-02T16:00:00Z",
    }
    net = json.loads(files["network-config"])
    assert net["ethernets"]["pxe0"]["match"] == {"macaddress": "52:54:00:00:00:01"}
    bare = nocloud(machine_id="m", name="gpu1", pxe_mac=None, ssh_authorized_keys=[])
    assert "write_files" not in json.loads(bare["user-data"].split("\n", 1)[1])
