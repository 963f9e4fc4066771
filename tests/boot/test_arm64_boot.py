"""arm64 machines on the boot plane: DHCP architecture types 11 and 19, the per-machine
script picking the machine's architecture, and the reason an arm64 client gets no boot file
when no arm64 iPXE is installed."""

from __future__ import annotations

from pathlib import Path

from sqlmodel import select

from metald import machines
from metald.boot.dhcp.bootfile import Arch, BootFiles, boot_file_for, classify
from metald.boot.dhcp.packet import DhcpPacket, parse
from metald.boot.hooks import BootAction, BootTarget, target_for_machine, with_agent_console
from metald.boot.ipxe import render_boot_script
from metald.boot.machine_hooks import StoreBootHooks
from metald.boot.plane import unbootable
from metald.config import load_config
from metald.lifecycle import State
from metald.provision.intents import DeployImage, provision_intent, wipe_intent
from metald.store.models import Event, Machine

BASE = "http://10.0.0.1:8080"
FILES = BootFiles(
    bios="ipxe/undionly.kpxe",
    uefi_x64="ipxe/snponly.efi",
    uefi_arm64="ipxe/snponly-arm64.efi",
    http_base=BASE,
)
DEPLOY = DeployImage("discovery/vmlinuz", "discovery/initrd.img")


def _discover(arch_code: int, vendor_class: bytes) -> DhcpPacket:
    """A firmware's DHCPDISCOVER: option 53, 60 (vendor class), 93 (client architecture)."""
    pkt = parse(
        bytes([1, 1, 6, 0])
        + b"\x12\x34\x56\x78"
        + bytes(20)
        + bytes.fromhex("525400aa0001")
        + bytes(10 + 64 + 128)
        + b"\x63\x82\x53\x63"
        + bytes([53, 1, 1])
        + bytes([60, len(vendor_class)])
        + vendor_class
        + bytes([93, 2, 0, arch_code])
        + b"\xff"
    )
    return pkt


def test_arm64_uefi_pxe_and_http_clients_get_the_arm64_ipxe() -> None:
    pxe = classify(_discover(11, b"PXEClient:Arch:00011:UNDI:003000"))
    assert pxe.arch is Arch.UEFI_ARM64 and pxe.pxe and not pxe.http
    assert boot_file_for(pxe, "x", FILES) == "ipxe/snponly-arm64.efi"
    http = classify(_discover(19, b"HTTPClient:Arch:00019:UNDI:003000"))
    assert http.arch is Arch.UEFI_ARM64 and http.http
    assert boot_file_for(http, "x", FILES) == f"{BASE}/boot/assets/ipxe/snponly-arm64.efi"
    # x86 UEFI is unchanged
    x64 = classify(_discover(7, b"PXEClient:Arch:00007:UNDI:003016"))
    assert boot_file_for(x64, "x", FILES) == "ipxe/snponly.efi"


def _machine(**kw: object) -> Machine:
    return Machine(id="m1", **kw)  # type: ignore[arg-type]


def test_an_arm64_machines_agent_boots_use_the_arm64_image_and_console() -> None:
    for m in (
        _machine(state=State.DISCOVERED.value, arch="arm64"),
        _machine(state=State.DISCOVERED.value, firmware="uefi-arm64"),  # before any inventory
    ):
        t = target_for_machine(m)
        assert (t.action, t.kernel, t.initrd, t.arch) == (
            BootAction.DISCOVERY,
            "arm64/discovery/vmlinuz",
            "arm64/discovery/initrd.img",
            "arm64",
        )
        assert with_agent_console(t).kernel_args["console"] == "ttyAMA0,115200"
    wipe = target_for_machine(
        _machine(state=State.WIPING.value, arch="arm64", boot_intent=wipe_intent(DEPLOY))
    )
    assert (wipe.kernel, wipe.initrd) == ("arm64/discovery/vmlinuz", "arm64/discovery/initrd.img")
    disk = provision_intent(
        "i1", "disk", {"url": "http://x/d.raw", "sha256": "0" * 64, "format": "raw"}, DEPLOY
    )
    deploy = target_for_machine(
        _machine(state=State.PROVISIONING.value, arch="arm64", boot_intent=disk)
    )
    assert deploy.kernel == "arm64/discovery/vmlinuz"  # the agent writes the disk image
    # a stateless image is the tenant's own arm64 build: its paths as registered
    ram = provision_intent(
        "i2",
        "stateless",
        {"kernel": "node-arm64/vmlinuz", "initrd": "node-arm64/initrd.img"},
        DEPLOY,
    )
    own = target_for_machine(
        _machine(state=State.PROVISIONING.value, arch="arm64", boot_intent=ram)
    )
    assert (own.kernel, own.initrd) == ("node-arm64/vmlinuz", "node-arm64/initrd.img")
    # amd64 and machines with nothing recorded: as before
    old = target_for_machine(_machine(state=State.DISCOVERED.value))
    assert (old.kernel, old.arch) == ("discovery/vmlinuz", None)
    assert with_agent_console(old).kernel_args["console"] == "ttyS0,115200"
    x86 = target_for_machine(_machine(state=State.DISCOVERED.value, firmware="uefi-x64"))
    assert (x86.kernel, x86.arch) == ("discovery/vmlinuz", "amd64")


def test_the_script_refuses_to_boot_on_another_architectures_ipxe() -> None:
    t = BootTarget(
        BootAction.DISCOVERY, "arm64/discovery/vmlinuz", "arm64/discovery/initrd.img", arch="arm64"
    )
    script = render_boot_script(t, mac="52:54:00:aa:00:01", public_url=BASE)
    lines = script.splitlines()
    guard = lines.index("iseq ${buildarch} arm64 || goto wrongarch")
    kernel = next(i for i, ln in enumerate(lines) if ln.startswith("kernel "))
    assert guard < kernel and f"{BASE}/boot/assets/arm64/discovery/vmlinuz" in lines[kernel]
    assert ":wrongarch" in lines and "recorded as arm64" in script
    x86 = render_boot_script(
        BootTarget(BootAction.DISCOVERY, "discovery/vmlinuz", "discovery/initrd.img", arch="amd64"),
        mac="m",
        public_url=BASE,
    )
    # x86 iPXE's buildarch is i386 in BIOS builds (undionly.kpxe), x86_64 in UEFI ones: amd64
    # is checked as "not arm64"
    assert "iseq ${buildarch} arm64 && goto wrongarch || goto archok" in x86
    assert x86.index(":archok") < x86.index("kernel ")
    unknown = render_boot_script(
        BootTarget(BootAction.DISCOVERY, "discovery/vmlinuz", "discovery/initrd.img"),
        mac="m",
        public_url=BASE,
    )
    assert "buildarch" not in unknown


def _cfg(tmp_path: Path):  # type: ignore[no-untyped-def]
    assets = tmp_path / "assets"
    assets.mkdir(exist_ok=True)
    conf = tmp_path / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[api]\nlisten = "127.0.0.1:8080"\n'
        f'[boot]\nenabled = true\ndhcp_mode = "off"\nserver_address = "10.0.0.1"\n'
        f'assets_dir = "{assets}"\n'
    )
    return load_config(conf)


async def test_an_arm64_client_with_no_arm64_ipxe_gets_an_event_saying_why(
    store, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    hooks = StoreBootHooks(store, "t1")
    hooks.unbootable = unbootable(_cfg(tmp_path))
    assert set(hooks.unbootable) == {"uefi-arm64"}
    await hooks.client_seen(
        "52:54:00:aa:00:01", arch="uefi-arm64", network="prov", relay_agent=None
    )
    await hooks.client_seen("52:54:00:aa:00:02", arch="uefi-x64", network="prov", relay_agent=None)

    def check(s):  # type: ignore[no-untyped-def]
        arm = machines.find_by_mac(s, "52:54:00:aa:00:01")
        x86 = machines.find_by_mac(s, "52:54:00:aa:00:02")
        evs = s.exec(select(Event).where(Event.kind == "machine.boot_unavailable")).all()
        return arm.arch, x86.arch, [(e.machine_id, e.reason) for e in evs], arm.id

    arm_arch, x86_arch, events, arm_id = await store.run(check)
    assert (arm_arch, x86_arch) == ("arm64", "amd64")  # from DHCP option 93
    ((machine_id, reason),) = events
    assert machine_id == arm_id
    assert "Debian ships no arm64 iPXE" in reason and "python -m bootassets ipxe" in reason
    # with metald's arm64 iPXE installed there is nothing to say
    (tmp_path / "assets" / "ipxe").mkdir()
    (tmp_path / "assets" / "ipxe" / "snponly-arm64.efi").write_bytes(b"metald's")
    assert unbootable(_cfg(tmp_path)) == {}


async def test_firmware_seen_later_sets_the_arch_of_a_machine_enrolled_without_it(store) -> None:  # type: ignore[no-untyped-def]
    def add(s):  # type: ignore[no-untyped-def]
        m = machines.create_machine(s, macs=["52:54:00:aa:00:03"], actor="test")
        return m.id, m.arch

    mid, arch = await store.run(add)
    assert arch is None
    hooks = StoreBootHooks(store, "t1")
    await hooks.client_seen("52:54:00:aa:00:03", arch="uefi-arm64", network=None, relay_agent=None)
    m = await store.run(lambda s: s.get(Machine, mid))
    assert (m.firmware, m.arch) == ("uefi-arm64", "arm64")
