"""Which iPXE metald's DHCP server hands out: its own build (``python -m bootassets ipxe
--install``, in <assets_dir>/ipxe/) where it is there, Debian's with a logged reason where it is
not, and a refusal to start when ``boot.ipxe = "built"`` and the build is missing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from metald.boot.dhcp.bootfile import Arch, ClientKind, boot_file_for, classify
from metald.boot.plane import boot_files, choose_boot_files
from metald.config import Config, ConfigError, load_config


def _cfg(tmp_path: Path, extra: str = "") -> Config:
    assets = tmp_path / "assets"
    assets.mkdir(exist_ok=True)
    (assets / "undionly.kpxe").write_bytes(b"debian")
    (assets / "snponly.efi").write_bytes(b"debian")
    conf = tmp_path / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[api]\nlisten = "127.0.0.1:8080"\n'
        f'[boot]\nenabled = true\ndhcp_mode = "off"\nserver_address = "10.0.0.1"\n'
        f'assets_dir = "{assets}"\n{extra}'
    )
    return load_config(conf)


def _install(tmp_path: Path, *names: str, script: str | None = None) -> None:
    """As ``python -m bootassets ipxe --install`` leaves it: the binaries and the embedded
    script (``script``: another one, e.g. a build's from before its user class)."""
    from bootassets.ipxe import embedded_script

    built = tmp_path / "assets" / "ipxe"
    built.mkdir(exist_ok=True)
    for n in names:
        (built / n).write_bytes(b"metald's")
    (built / "metald.ipxe").write_text(embedded_script() if script is None else script)


def _pxe(arch: Arch) -> ClientKind:
    return ClientKind(arch=arch, pxe=True, http=False, ipxe=False)


def _ipxe(arch: Arch, user_class: bytes) -> ClientKind:
    """What ``classify`` makes of an iPXE's DHCP request (it sends option 93 and PXEClient)."""
    from metald.boot.dhcp.packet import DhcpPacket, Opt

    pkt = DhcpPacket()
    pkt.options[Opt.USER_CLASS] = user_class
    pkt.options[Opt.VENDOR_CLASS] = b"PXEClient:Arch:00000:UNDI:002001"
    pkt.options[93] = {Arch.BIOS: 0, Arch.UEFI_X64: 7, Arch.UEFI_ARM64: 11}[arch].to_bytes(2, "big")
    return classify(pkt)


def test_without_a_build_machines_get_debians_ipxe_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path)
    with caplog.at_level(logging.WARNING, logger="metald.boot.plane"):
        files = boot_files(cfg)
    assert (files.bios, files.uefi_x64) == ("undionly.kpxe", "snponly.efi")
    msg, arm64 = [r.getMessage() for r in caplog.records]
    assert "no metald-built iPXE for BIOS (ipxe/undionly.kpxe)" in msg
    assert "arm64 UEFI machines get no boot file" in arm64
    assert "python -m bootassets ipxe --install" in msg and "plain HTTP" in msg


def test_a_built_ipxe_is_preferred_per_architecture(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    _install(tmp_path, "undionly.kpxe", "snponly.efi", "snponly-arm64.efi")
    files, reasons = choose_boot_files(cfg)
    assert reasons == []
    assert boot_file_for(_pxe(Arch.BIOS), "52:54:00:00:00:01", files) == "ipxe/undionly.kpxe"
    assert boot_file_for(_pxe(Arch.UEFI_X64), "52:54:00:00:00:01", files) == "ipxe/snponly.efi"
    assert boot_file_for(_pxe(Arch.UEFI_ARM64), "x", files) == "ipxe/snponly-arm64.efi"
    assert files.uefi_ia32 == "ipxe-i386.efi"  # not built: as configured
    http = ClientKind(arch=Arch.UEFI_X64, pxe=False, http=True, ipxe=False)
    assert boot_file_for(http, "x", files) == "http://10.0.0.1:8080/boot/assets/ipxe/snponly.efi"


def test_a_partial_build_falls_back_only_where_it_is_missing(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, 'uefi_x64_file = "ipxe.efi"\n')
    _install(tmp_path, "undionly.kpxe", "ipxe.efi")  # the configured name, built
    files, reasons = choose_boot_files(cfg)
    assert (files.bios, files.uefi_x64, files.uefi_arm64) == (
        "ipxe/undionly.kpxe",
        "ipxe/ipxe.efi",
        "",
    )
    reason, arm64 = reasons
    assert "arm64 UEFI (ipxe/snponly-arm64.efi)" in reason and "BIOS" not in reason
    assert "Debian ships no arm64 iPXE" in arm64


def test_without_an_arm64_ipxe_an_arm64_client_gets_no_boot_file(tmp_path: Path) -> None:
    """Debian's ipxe package has no arm64 binary: neither PXE (arch 11) nor UEFI HTTP boot
    (arch 19) may be handed a file that is not there or the x86 binary."""
    files, reasons = choose_boot_files(_cfg(tmp_path))
    assert boot_file_for(_pxe(Arch.UEFI_ARM64), "x", files) is None
    http = ClientKind(arch=Arch.UEFI_ARM64, pxe=False, http=True, ipxe=False)
    assert boot_file_for(http, "x", files) is None
    assert boot_file_for(_pxe(Arch.UEFI_X64), "x", files) == "snponly.efi"  # x86 unchanged
    assert any("python -m bootassets ipxe" in r and "arm64" in r for r in reasons)
    # an operator's own arm64 binary under the configured name is handed out
    (tmp_path / "assets" / "snponly-arm64.efi").write_bytes(b"operator's")
    files, _ = choose_boot_files(_cfg(tmp_path))
    assert boot_file_for(_pxe(Arch.UEFI_ARM64), "x", files) == "snponly-arm64.efi"
    assert boot_file_for(http, "x", files) == "http://10.0.0.1:8080/boot/assets/snponly-arm64.efi"


def test_debian_mode_ignores_a_build(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, 'ipxe = "debian"\n')
    _install(tmp_path, "undionly.kpxe", "snponly.efi", "snponly-arm64.efi")
    files, reasons = choose_boot_files(cfg)
    assert (files.bios, files.uefi_x64) == ("undionly.kpxe", "snponly.efi")
    assert files.uefi_arm64 == "" and len(reasons) == 1  # Debian has no arm64 iPXE


def test_built_mode_refuses_to_start_without_the_build(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, 'ipxe = "built"\n')
    _install(tmp_path, "undionly.kpxe", "snponly.efi")
    with pytest.raises(ConfigError, match=r"boot.ipxe = \"built\" but .* arm64 UEFI") as e:
        choose_boot_files(cfg)
    assert "python -m bootassets ipxe" in str(e.value)
    _install(tmp_path, "snponly-arm64.efi")
    assert choose_boot_files(cfg)[0].uefi_arm64 == "ipxe/snponly-arm64.efi"


def test_an_unknown_ipxe_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ipxe"):
        _cfg(tmp_path, 'ipxe = "mine"\n')


def test_another_ipxe_is_chainloaded_into_metalds_and_only_metalds_gets_the_script(
    tmp_path: Path,
) -> None:
    """A NIC's iPXE ROM (or Debian's) says user class ``iPXE``: where metald's own iPXE is
    installed for its architecture it gets that binary (by TFTP, as firmware PXE does) rather
    than the script URL, which over HTTPS it could not check; metald's own says ``metald``
    (its embedded script) and gets the script. Fails on the old code: every iPXE got the
    script URL."""
    from bootassets.ipxe import USER_CLASS, embedded_script

    assert f"set user-class {USER_CLASS}\n" in embedded_script()
    cfg = _cfg(tmp_path, 'uefi_x64_file = "ipxe.efi"\n')
    _install(tmp_path, "undionly.kpxe", "ipxe.efi")  # arm64 not built
    files, _ = choose_boot_files(cfg)
    mac = "52:54:00:00:00:01"
    script = f"http://10.0.0.1:8080/boot/{mac}.ipxe"
    assert boot_file_for(_ipxe(Arch.BIOS, b"iPXE"), mac, files) == "ipxe/undionly.kpxe"
    assert boot_file_for(_ipxe(Arch.UEFI_X64, b"iPXE"), mac, files) == "ipxe/ipxe.efi"
    ours = USER_CLASS.encode()
    assert _ipxe(Arch.BIOS, ours).metald_ipxe and _ipxe(Arch.BIOS, ours).ipxe
    assert boot_file_for(_ipxe(Arch.BIOS, ours), mac, files) == script
    assert boot_file_for(_ipxe(Arch.UEFI_X64, ours), mac, files) == script
    # no build for arm64: its iPXE, whatever it is, gets the script as before
    assert boot_file_for(_ipxe(Arch.UEFI_ARM64, b"iPXE"), mac, files) == script


def test_a_build_that_does_not_say_it_is_metalds_is_never_chainloaded_into(
    tmp_path: Path,
) -> None:
    """A build installed before metald's iPXE had a user class would be handed itself again
    and again: metald gives every iPXE the script instead and logs why."""
    cfg = _cfg(tmp_path)
    _install(tmp_path, "undionly.kpxe", "snponly.efi", "snponly-arm64.efi", script="#!ipxe\ndhcp\n")
    files, reasons = choose_boot_files(cfg)
    assert files.bios == "ipxe/undionly.kpxe" and not files.chain
    (reason,) = reasons
    assert "predates metald's user class" in reason
    mac = "52:54:00:00:00:01"
    assert boot_file_for(_ipxe(Arch.BIOS, b"iPXE"), mac, files).endswith(f"/boot/{mac}.ipxe")


def test_debian_mode_never_chainloads(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, 'ipxe = "debian"\n')
    _install(tmp_path, "undionly.kpxe", "snponly.efi", "snponly-arm64.efi")
    files, _ = choose_boot_files(cfg)
    mac = "52:54:00:00:00:01"
    assert boot_file_for(_ipxe(Arch.BIOS, b"iPXE"), mac, files).endswith(".ipxe")
