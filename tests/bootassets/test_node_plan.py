"""The node image's build plan: modules, programs, plugins, where files come from, inputs."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from bootassets import build, cpio, node
from bootassets.build import BuildError


def unpack_newc(data: bytes) -> dict[str, tuple[int, bytes]]:
    """path -> (mode, data) of a newc cpio archive (what cpio.pack writes)."""
    out, pos = {}, 0
    while True:
        head = data[pos : pos + 110]
        assert head[:6] == b"070701"
        fields = [int(head[6 + i * 8 : 14 + i * 8], 16) for i in range(13)]
        mode, filesize, namesize = fields[1], fields[6], fields[11]
        name_start = pos + 110
        name = data[name_start : name_start + namesize - 1].decode()
        pos = name_start + namesize
        pos += -pos % 4
        body = data[pos : pos + filesize]
        pos += filesize
        pos += -pos % 4
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, body)


def test_module_list_has_wireguard_nftables_and_crc32c_first() -> None:
    mods = node.NODE_MODULES
    for m in ("wireguard", "nf_tables", "nft_ct", "crc32c_generic", "virtio_net", "e1000"):
        assert m in mods
    # libcrc32c (nf_tables, nf_conntrack) needs a crc32c implementation registered first
    assert mods.index("crc32c_generic") < mods.index("nf_tables")
    assert "ipmi_si" not in mods  # discovery-only


def test_mbr_sector_has_one_bootable_linux_partition() -> None:
    sector = node.mbr_sector(b"\xfa" * 440, 2048, 129024)
    assert len(sector) == 512 and sector[510:] == b"\x55\xaa"
    entry = sector[446:462]
    assert entry[0] == 0x80 and entry[4] == 0x83
    assert int.from_bytes(entry[8:12], "little") == 2048
    assert int.from_bytes(entry[12:16], "little") == 129024
    assert sector[462:510] == bytes(48)  # no other partition
    with pytest.raises(BuildError):
        node.mbr_sector(b"x" * 441, 2048, 1)


def test_programs_come_only_from_the_unpacked_tree(tmp_path: Path) -> None:
    """An empty package tree fails naming the missing file: nothing falls back to the host."""
    (tmp_path / node.PLUGIN_DIR).mkdir(parents=True)
    with pytest.raises(BuildError, match="bin/ip is in none of the unpacked packages"):
        node.program_entries(tmp_path)


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("needs apt-get and dpkg-deb (Debian)")
    try:
        pk = node.resolve_node_inputs(disk=False)["packages"]
    except BuildError as e:
        pytest.skip(f"apt cannot resolve the node packages: {e}")
    return build._download(
        f"{pk['tools']} {pk['libraries']}",  # type: ignore[index]
        tmp_path_factory.mktemp("node-debs"),
    )


def test_every_file_read_is_inside_the_package_tree(
    unpacked: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[Path] = []
    real = Path.read_bytes

    def tracing(self: Path) -> bytes:
        read.append(self.resolve())
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", tracing)
    entries, report = node.program_entries(unpacked)
    root = unpacked.resolve()
    outside = [p for p in read if not p.is_relative_to(root)]
    assert read and not outside, outside[:5]
    paths = {e.path for e in entries}
    for prog in ("usr/sbin/slurmd", "usr/sbin/slurmstepd", "usr/sbin/munged", "usr/bin/wg"):
        assert prog in paths
    for prog in ("usr/sbin/nft", "usr/sbin/ip", "usr/bin/jq"):
        assert prog in paths
    assert f"{node.PLUGIN_DIR}/libslurmfull.so" in paths  # slurmd's RUNPATH
    for plugin in ("proctrack_linuxproc.so", "task_none.so", "auth_munge.so", "cred_munge.so"):
        assert plugin in report["plugins"]
        assert f"{node.PLUGIN_DIR}/{plugin}" in paths
    assert "libgcc_s.so.1" in report["libraries"]  # dlopen'd by glibc, named by no DT_NEEDED


def test_built_image_contents(node_image: Path) -> None:
    manifest = build.verify(node_image)
    assert node_image.name == "node-" + manifest["inputs_hash"]
    files = unpack_newc(gzip.decompress((node_image / "initrd.img").read_bytes()))
    kver = manifest["kernel_version"]
    closures = dict(
        (line.split(" ", 1)[0], line.split()[1:])
        for line in files["lib/modules/closures"][1].decode().splitlines()
    )
    # wireguard's whole dependency closure is carried, in load order
    assert closures["wireguard"][-1] == "wireguard" and len(closures["wireguard"]) > 3
    for mod in closures["wireguard"] + closures["nft_ct"] + ["crc32c_generic"]:
        assert f"lib/modules/{kver}/{mod}.ko" in files, mod
    aliases = files["lib/modules/aliases"][1].decode().splitlines()
    for always in node.NODE_ALWAYS:
        assert f"{always} *" in aliases
    for path in (
        "init",
        "usr/bin/metald-node",
        "bin/busybox",
        "usr/sbin/slurmd",
        "usr/sbin/slurmstepd",
        "usr/sbin/munged",
        "usr/bin/wg",
        "usr/sbin/nft",
        "usr/sbin/ip",
        "usr/bin/jq",
        "etc/passwd",
        "etc/nsswitch.conf",
        f"{node.PLUGIN_DIR}/proctrack_linuxproc.so",
    ):
        assert path in files, path
    assert files["init"][1] == node.NODE_INIT.read_bytes()
    assert json.loads((node_image / "manifest.json").read_text())["files"]["initrd.img"]["size"]


def test_inputs_hash_changes_with_a_node_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        before = node.resolve_node_inputs(disk=True)
    except BuildError as e:
        pytest.skip(f"apt cannot resolve the node packages: {e}")
    again = node.resolve_node_inputs(disk=True)
    assert build.inputs_hash(again) == build.inputs_hash(before)
    # apt's answers are settled now (asked twice above): the rest asks them once, ~10 s each.
    libs, shown_seen = node._library_packages(), {}
    real_show = build._apt_show

    def apt_show_once(*names: str) -> dict:  # type: ignore[type-arg]
        if names not in shown_seen:
            shown_seen[names] = real_show(*names)
        return shown_seen[names]

    monkeypatch.setattr(node, "_library_packages", lambda arch=None: libs)
    monkeypatch.setattr(build, "_apt_show", apt_show_once)
    real_files = node.node_files()
    script = tmp_path / "metald-node"

    def inputs_with(content: bytes) -> str:
        script.write_bytes(content)
        monkeypatch.setattr(
            node,
            "node_files",
            lambda: [script if p == node.NODE_SCRIPT else p for p in real_files],
        )
        return build.inputs_hash(node.resolve_node_inputs(disk=True))

    same = inputs_with(node.NODE_SCRIPT.read_bytes())
    assert inputs_with(node.NODE_SCRIPT.read_bytes()) == same
    assert inputs_with(node.NODE_SCRIPT.read_bytes() + b"# changed\n") != same
    monkeypatch.setattr(node, "node_files", lambda: real_files)
    # and so does a build without the disk form (disk.raw needs root)
    assert build.inputs_hash(node.resolve_node_inputs(disk=False)) != build.inputs_hash(before)


def test_cpio_roundtrip_helper() -> None:
    data = cpio.pack([cpio.directory("a"), cpio.file("a/b", b"xyz", 0o600)])
    got = unpack_newc(data)
    assert got["a/b"][1] == b"xyz"
