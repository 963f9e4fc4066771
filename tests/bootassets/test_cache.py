"""The boot-asset cache's publish, current link and pruning, shared by the discovery assets
(bootassets/build.py) and the node images (bootassets/node.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bootassets import build


def _build(cache: Path, name: str, mtime: int) -> Path:
    out = cache / f".work-{name}"
    out.mkdir()
    (out / "vmlinuz").write_bytes(b"k")
    build.publish(out, cache / name, "test build", 1 << 20, inputs_hash=name)
    os.utime(cache / name, (mtime, mtime))
    return cache / name


def test_publish_replaces_a_build_and_writes_its_manifest(tmp_path: Path) -> None:
    first = _build(tmp_path, "abc", 1)
    (first / "stale").write_text("x")
    again = _build(tmp_path, "abc", 2)
    assert sorted(p.name for p in again.iterdir()) == ["manifest.json", "vmlinuz"]
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["inputs_hash"] == "abc" and manifest["total_bytes"] == 1
    assert list(manifest["files"]) == ["vmlinuz"]
    assert not list(tmp_path.glob(".work-*"))


def test_prune_keeps_the_newest_of_its_kind_and_the_current_one(tmp_path: Path) -> None:
    a, b, c = (_build(tmp_path, n, t) for n, t in (("a", 1), ("b", 2), ("c", 3)))
    node_old = _build(tmp_path, "node-x", 0)
    build.point_current(tmp_path, "current", "c")
    assert (tmp_path / "current").resolve() == c
    build.prune(tmp_path, "current", 2, lambda p: not p.name.startswith("node-"))
    # The current link is not a build of its own: the two newest builds stay.
    assert (c.exists(), b.exists(), a.exists()) == (True, True, False)
    assert node_old.exists()  # another kind's build is its own pruner's business


def test_prune_never_removes_the_current_build(tmp_path: Path) -> None:
    old = _build(tmp_path, "node-old", 1)
    for n, t in (("node-b", 2), ("node-c", 3)):
        _build(tmp_path, n, t)
    build.point_current(tmp_path, "node-current", "node-old")
    build.prune(tmp_path, "node-current", 1, lambda p: p.name.startswith("node-"))
    assert old.exists() and (tmp_path / "node-c").exists()
    assert not (tmp_path / "node-b").exists()
    assert (tmp_path / "node-current").resolve() == old


def test_the_discovery_init_puts_every_tool_it_carries_on_the_path() -> None:
    """curl (the agent's HTTPS to metald), ipmitool and qemu-img sit in /usr/bin of the
    discovery image; /init's PATH must reach them, or the agent finds no curl and an https
    metald.url stops it (seen in the lab capture run). Fails on the old init (PATH=/bin)."""
    import re

    from bootassets import build

    init = (build.HERE / "initramfs" / "init").read_text()
    (path,) = re.findall(r"^export PATH=(\S+)$", init, flags=re.M)
    dirs = set(path.split(":"))
    for tool in build.TOOLS:
        if ".so" in tool.rsplit("/", 1)[1]:
            continue  # a library the image carries (tpm2's TCTI), not a program
        assert "/" + tool.rsplit("/", 1)[0] in dirs, (tool, path)
