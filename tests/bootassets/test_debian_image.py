"""The Debian 12 tenant image's build, without building it (no root, no apt): the mmdebstrap
command pins what the inputs hash covers, the customize hook is valid sh, the image registers
as a metald disk image, and the image's cache folder is out of the other builds' pruning. The
build itself and a boot of it: tests/provision_agent/test_qemu_debian.py (METALD_LAB_LONG=1)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bootassets import build, debian
from metald.provision.images import normalize_spec

INPUTS = {
    "suite": "bookworm",
    "packages": {p: f"1.{i}-1" for i, p in enumerate(debian.PACKAGES)} | {"libc6": "2.36"},
    "include": list(debian.PACKAGES),
    "dpkg_options": list(debian.DPKG_OPTIONS),
}


def test_mmdebstrap_installs_the_hashed_versions_from_apt_sources_only(tmp_path):
    args = debian.mmdebstrap_args(INPUTS, tmp_path / "tree")
    assert args[:4] == ["mmdebstrap", "--mode=root", "--variant=minbase", "--format=directory"]
    (include,) = [a.removeprefix("--include=") for a in args if a.startswith("--include=")]
    assert include.split(",") == [f"{p}={INPUTS['packages'][p]}" for p in debian.PACKAGES]
    for needed in ("cloud-init", "systemd-sysv", "mdadm", "lvm2", "openssh-server", "netplan.io"):
        assert needed in debian.PACKAGES
    assert f'--customize-hook=sh {debian.CUSTOMIZE} "$1"' in args
    assert "--dpkgopt=path-exclude=/usr/share/doc/*" in args
    # the suite, the tree, then the apt sources file: the only mirror mmdebstrap uses
    assert args[-3:-1] == ["bookworm", str(tmp_path / "tree")]
    assert Path(args[-1]).is_file() and args[-1].startswith("/etc/apt/")


def test_customize_hook_is_valid_sh_and_removes_the_builds_host_keys():
    subprocess.run(["sh", "-n", str(debian.CUSTOMIZE)], check=True)
    text = debian.CUSTOMIZE.read_text()
    assert 'rm -f "$root"/etc/ssh/ssh_host_*' in text
    assert "datasource_list: [NoCloud, None]" in text
    assert "update-initramfs -u" in text


def test_the_images_own_cloud_config_passes_cloud_inits_schema():
    """Every cloud.cfg.d file the hook writes is merged into each boot's config, which
    cloud-init checks against its schema: ``locale: false`` (a YAML boolean) failed it and
    every boot logged "Invalid cloud-config provided" (seen on the lab's console)."""
    import re

    from metald.provision.userdata import check

    text = debian.CUSTOMIZE.read_text()
    found = re.findall(
        r'cat >"\$root/etc/cloud/cloud\.cfg\.d/[^"]+" <<\'EOF\'\n(.*?)\nEOF\n', text, re.S
    )
    assert found, "the hook writes cloud.cfg.d"
    for body in found:
        assert check("#cloud-config\n" + body).form == "cloud-config"
    assert 'locale: "false"' in text  # cc_locale reads the string as off: no locales package


def test_a_build_registers_as_a_disk_image(tmp_path):
    manifest = {
        "arch": "amd64",
        "inputs_hash": "0123456789abcdef",
        "files": {"disk.raw": {"sha256": "ab" * 32, "size": 900 * 1024 * 1024}},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    spec = debian.image_spec(tmp_path, "https://metald.example:8443/assets/os/debian-12.raw")
    assert spec["name"] == "debian-12-01234567" and spec["kind"] == "disk"
    stored = normalize_spec(
        spec["kind"], {k: v for k, v in spec.items() if k not in ("name", "kind")}
    )
    assert stored == {
        "url": "https://metald.example:8443/assets/os/debian-12.raw",
        "sha256": "ab" * 32,
        "format": "raw",
        "size_bytes": 900 * 1024 * 1024,
        "arch": "amd64",
    }


def test_the_discovery_builds_pruning_leaves_the_os_folder_alone(tmp_path):
    for name in ("aaaa", "bbbb", "cccc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    osdir = tmp_path / "os" / "debian-12-1111"
    osdir.mkdir(parents=True)
    (osdir / "manifest.json").write_text("{}")
    build.point_current(tmp_path, "current", "cccc")
    build.prune(tmp_path, "current", 1, build._is_discovery_build)
    assert osdir.is_dir() and not (tmp_path / "aaaa").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_a_killed_builds_mounts_are_detached_before_its_folder_is_deleted(tmp_path):
    """mmdebstrap killed mid-build leaves proc, sys and dev mounted in its chroot; the build's
    cleanup detaches them first instead of deleting through them."""
    inner = tmp_path / "tree" / "proc"
    inner.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(inner)], check=True)
    try:
        (inner / "kept").write_text("x")
        assert debian.mounts_under(tmp_path) == [str(inner)]
        debian._unmount_all(tmp_path)
        assert debian.mounts_under(tmp_path) == [] and not (inner / "kept").exists()
    finally:
        subprocess.run(["umount", str(inner)], capture_output=True, check=False)


def _join_tree(tree: Path) -> Path:
    """A tree as customize.sh leaves it: the agent, the unit enabled, the tools."""
    for d in ("usr/sbin", "usr/bin", debian.JOIN_WANTS, "etc/munge"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    (tree / "usr/sbin/metald-node").write_bytes(debian.NODE_AGENT.read_bytes())
    unit = tree / "etc/systemd/system/metald-join.service"
    unit.write_bytes(debian.JOIN_UNIT.read_bytes())
    (tree / debian.JOIN_WANTS / "metald-join.service").symlink_to(
        "/etc/systemd/system/metald-join.service"
    )
    for t in ("usr/bin/wg", "usr/sbin/nft", "usr/sbin/munged", "usr/sbin/slurmd", "usr/bin/jq",
              "usr/bin/curl", "usr/bin/ip"):  # fmt: skip
        (tree / t).touch()
    return tree


def test_the_image_carries_the_join_and_only_the_agent_starts_munge_and_slurmd(tmp_path):
    for needed in ("wireguard-tools", "nftables", "munge", "slurmd", "jq", "curl", "dbus"):
        assert needed in debian.PACKAGES
    text = debian.CUSTOMIZE.read_text()
    assert 'install -m 0755 "$here/../node/metald-node" "$root/usr/sbin/metald-node"' in text
    assert 'rm -f "$root/etc/munge/munge.key"' in text
    tree = _join_tree(tmp_path / "tree")
    found = debian.join_setup(tree)
    assert found["enabled"] == ["metald-join"] and not found["munge_key_baked"]
    assert found["agent_sha256"] == debian.sha256_file(debian.NODE_AGENT)
    # what Debian's packages do on their own (enable munge and slurmd, make a munge key) and
    # a stale agent are each refused
    (tree / debian.JOIN_WANTS / "munge.service").symlink_to("/lib/systemd/system/munge.service")
    (tree / "etc/munge/munge.key").write_bytes(b"k" * 1024)
    (tree / "usr/sbin/metald-node").write_text("#!/bin/sh\n")
    (tree / "usr/sbin/slurmd").unlink()
    with pytest.raises(build.BuildError) as e:
        debian.join_setup(tree)
    for why in (
        "/usr/sbin/metald-node is not bootassets/node/metald-node",
        "units enabled at boot: ['metald-join', 'munge'], not only metald-join",
        "the build's munge key is in the image",
        "missing tools: slurmd",
    ):
        assert why in str(e.value)


def test_the_inputs_hash_covers_the_agent_and_the_unit():
    # a changed agent or unit is a new image (customize.sh copies them in)
    assert {debian.NODE_AGENT, debian.JOIN_UNIT, debian.CUSTOMIZE} <= set(debian.INPUT_FILES)
    assert all(p.is_file() for p in debian.INPUT_FILES)
