"""metald's iPXE recipe (bootassets/ipxe.py) without compiling iPXE: the config header, the
embedded script, what the cache key covers, reuse of a cached build, refusals, install."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from bootassets import build, ipxe
from bootassets.__main__ import main as bootassets_main
from bootassets.build import BuildError

CA = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def _tarball(path: Path, makefile: bytes = b"all:\n") -> Path:
    with tarfile.open(path, "w:xz") as tar:
        for name, data in (("ipxe-x/src/Makefile", makefile), ("ipxe-x/COPYING", b"GPL")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _ca(tmp: Path, pem: bytes = CA) -> Path:
    p = tmp / "ca.pem"
    p.write_bytes(pem)
    return p


def _fake_build(calls: list[str]):
    """Stands in for the compile: writes every target so publish/verify/install run for real."""

    def fake(target: Path, source: Path, ca_pem: bytes, inputs: dict, digest: str) -> None:
        calls.append(digest)
        out = target.parent / f".out-{digest}"
        out.mkdir(parents=True)
        for name in ipxe.NAMES:
            (out / name).write_bytes(f"{name} {digest}".encode())
        (out / "metald.ipxe").write_text(ipxe.embedded_script())
        (out / "ca.pem").write_bytes(ca_pem)
        build.publish(out, target, "iPXE", 1 << 20, inputs_hash=digest, inputs=inputs)

    return fake


def test_config_header_turns_off_the_banner_and_turns_on_https_everywhere() -> None:
    h = ipxe.config_header()
    # Redefined after an #undef: iPXE's general.h defines them (and undefines HTTPS for BIOS).
    assert "#undef BANNER_TIMEOUT\n#define BANNER_TIMEOUT 0\n" in h
    assert "#undef DOWNLOAD_PROTO_HTTPS\n#define DOWNLOAD_PROTO_HTTPS\n" in h
    for cmd in ("CERT_CMD", "DIGEST_CMD", "IMAGE_TRUST_CMD", "CONSOLE_CMD"):
        assert f"#define {cmd}\n" in h
    for gone in ("SANBOOT_CMD", "IWMGMT_CMD", "HTTP_AUTH_NTLM"):
        assert f"#undef {gone}\n" in h and f"#define {gone}\n" not in h


def test_embedded_script_chains_to_what_metald_dhcp_hands_ipxe_and_retries() -> None:
    s = ipxe.embedded_script()
    assert s.startswith("#!ipxe\n")
    lines = s.splitlines()
    assert lines.index("dhcp || goto wait") < lines.index(
        "chain --autofree --replace ${filename} || goto wait"
    )
    # never a shell prompt or the next boot device on a failure: it goes round again
    assert "goto retry" in lines and "shell" not in s and "exit" not in s


def test_embedded_script_runs_a_boot_loaders_initrd_without_ever_fetching_it() -> None:
    """Started as a Linux kernel (ipxe.lkrn from the per-boot ISO), iPXE holds the ISO's
    script as the image ``<INITRD>``; the embedded script runs it before DHCP. ``imgexec`` of
    a name it does not hold would download it (relative to where a PXE-started iPXE came
    from: the network), so the name is looked up first with ``imgstat``, which never does."""
    lines = ipxe.embedded_script().splitlines()
    stat = lines.index(f"imgstat {ipxe.MEDIA_INITRD} && goto media_bios ||")
    run = lines.index(f"imgexec --autofree --replace {ipxe.MEDIA_INITRD} || goto retry")
    assert lines[run - 1] == ":media_bios" and stat < lines.index(":media_bios")
    assert lines.index("goto retry") == stat + 1 < lines.index("dhcp || goto wait")
    assert ipxe.Target("bin/ipxe.lkrn", "ipxe.lkrn") in ipxe.TARGETS


def test_inputs_hash_changes_with_the_source_config_ca_and_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _tarball(tmp_path / "a.tar.xz")
    base = build.inputs_hash(ipxe.resolve_inputs(src, CA))
    assert build.inputs_hash(ipxe.resolve_inputs(src, CA)) == base  # stable
    other_src = _tarball(tmp_path / "b.tar.xz", b"all: other\n")
    assert build.inputs_hash(ipxe.resolve_inputs(other_src, CA)) != base
    assert build.inputs_hash(ipxe.resolve_inputs(src, CA.replace(b"MIIB", b"MIIC"))) != base
    monkeypatch.setattr(ipxe, "embedded_script", lambda: "#!ipxe\nshell\n")
    assert build.inputs_hash(ipxe.resolve_inputs(src, CA)) != base
    monkeypatch.undo()
    monkeypatch.setattr(ipxe, "config_header", lambda: "#define BANNER_TIMEOUT 20\n")
    assert build.inputs_hash(ipxe.resolve_inputs(src, CA)) != base


def test_a_tree_source_is_hashed_by_its_src_files_not_its_build_outputs(tmp_path: Path) -> None:
    tree = tmp_path / "ipxe"
    (tree / "src" / "config" / "local").mkdir(parents=True)
    (tree / "src" / "Makefile").write_text("all:\n")
    (tree / "src" / "core.c").write_text("int x;\n")
    first = ipxe.source_digest(tree)
    (tree / "src" / "bin-x86_64-efi").mkdir()
    (tree / "src" / "bin-x86_64-efi" / "snponly.efi").write_bytes(b"old build")
    (tree / "src" / "config" / "local" / "general.h").write_text("/* operator's */\n")
    (tree / ".git").mkdir()
    (tree / ".git" / "HEAD").write_text("ref: x\n")
    assert ipxe.source_digest(tree) == first
    (tree / "src" / "core.c").write_text("int y;\n")
    assert ipxe.source_digest(tree) != first
    with pytest.raises(BuildError, match="not an iPXE tree"):
        ipxe.source_digest(tmp_path)


def test_a_build_is_reused_until_an_input_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(ipxe, "_build", _fake_build(calls))
    src = _tarball(tmp_path / "ipxe.tar.xz")
    ca = _ca(tmp_path)
    cache = tmp_path / "cache"
    first = ipxe.ensure_ipxe_built(cache, source=src, ca=ca)
    assert first.parent == cache / "ipxe" and (cache / "ipxe" / "current").resolve() == first
    again = ipxe.ensure_ipxe_built(cache, source=src, ca=ca)
    assert again == first and len(calls) == 1  # cached: no second compile
    ca.write_bytes(CA.replace(b"MIIB", b"MIIC"))  # metald's CA changed: a new build
    second = ipxe.ensure_ipxe_built(cache, source=src, ca=ca)
    assert second != first and len(calls) == 2
    assert (second / "ca.pem").read_bytes() == ca.read_bytes()
    ipxe.ensure_ipxe_built(cache, source=src, ca=ca, force=True)
    assert len(calls) == 3
    # A damaged build is refused, not served.
    (second / "snponly.efi").write_bytes(b"tampered")
    with pytest.raises(BuildError, match="does not match its manifest"):
        ipxe.ensure_ipxe_built(cache, source=src, ca=ca)


def test_the_ipxe_cache_lives_apart_from_the_discovery_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The discovery image's pruning keeps only its 3 newest builds: the iPXE ones sit in a
    folder of their own, which that pruning never takes for a build."""
    monkeypatch.setattr(ipxe, "_build", _fake_build([]))
    cache = tmp_path / "cache"
    built = ipxe.ensure_ipxe_built(cache, source=_tarball(tmp_path / "s.tar.xz"), ca=_ca(tmp_path))
    for n in range(4):
        out = cache / f".w{n}"
        out.mkdir()
        (out / "f").write_text(str(n))
        build.publish(out, cache / f"d{n}", "discovery", 1 << 20)
    build.point_current(cache, "current", "d3")
    build.prune(cache, "current", 3, build._is_discovery_build)
    assert built.exists() and not (cache / "d0").exists()


def test_missing_source_or_ca_say_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BOOTASSETS_IPXE_SOURCE", raising=False)
    monkeypatch.delenv("BOOTASSETS_IPXE_CA", raising=False)
    monkeypatch.setattr(ipxe, "DEFAULT_SOURCE_DIR", tmp_path / "vendor")
    with pytest.raises(BuildError, match="--source"):
        ipxe.find_source()
    with pytest.raises(BuildError, match="does not exist"):
        ipxe.find_source(tmp_path / "nope.tar.xz")
    with pytest.raises(BuildError, match="--ca"):
        ipxe.read_ca(None)
    two = _ca(tmp_path, CA + CA)
    with pytest.raises(BuildError, match="exactly one"):
        ipxe.read_ca(two)
    (tmp_path / "vendor").mkdir()
    newest = _tarball(tmp_path / "vendor" / "ipxe-abc.tar.xz")
    assert ipxe.find_source() == newest
    monkeypatch.setenv("BOOTASSETS_IPXE_SOURCE", str(tmp_path / "vendor"))
    assert ipxe.find_source() == tmp_path / "vendor"


def test_cli_without_a_ca_fails_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("BOOTASSETS_IPXE_CA", raising=False)
    src = _tarball(tmp_path / "ipxe.tar.xz")
    rc = bootassets_main(["ipxe", "--cache", str(tmp_path / "c"), "--source", str(src)])
    assert rc == 1
    assert "metald's CA certificate" in capsys.readouterr().err


def test_cli_builds_and_installs_into_an_assets_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ipxe, "_build", _fake_build([]))
    assets = tmp_path / "assets"
    (assets / "ipxe").mkdir(parents=True)
    (assets / "ipxe" / "stale.efi").write_text("old")
    (assets / "snponly.efi").write_text("debian's")
    args = ["ipxe", "--cache", str(tmp_path / "c"), "--ca", str(_ca(tmp_path))]
    args += ["--source", str(_tarball(tmp_path / "s.tar.xz")), "--install", str(assets)]
    assert bootassets_main(args) == 0
    assert "installed into" in capsys.readouterr().out
    names = sorted(p.name for p in (assets / "ipxe").iterdir())
    assert names == sorted([*ipxe.NAMES, "ca.pem", "manifest.json", "metald.ipxe"])
    assert (assets / "snponly.efi").read_text() == "debian's"  # Debian's stay as the fallback
    manifest = json.loads((assets / "ipxe" / "manifest.json").read_text())
    assert set(manifest["files"]) >= set(ipxe.NAMES)
    assert not list(assets.glob(".ipxe-*"))


def test_unpack_refuses_a_tarball_that_is_not_ipxe(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        info = tarfile.TarInfo("x/README")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(BuildError, match="not an iPXE source tarball"):
        ipxe._unpack(bad, tmp_path / "work")
