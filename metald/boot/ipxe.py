"""iPXE scripts from a boot target. Pure: the same target always renders the same script."""

from __future__ import annotations

from metald.arch import ARM64, IPXE_BUILDARCH
from metald.boot.hooks import BootAction, BootTarget
from metald.boot.pki import ca_fingerprint


def _url(base: str, ref: str) -> str:
    return ref if "://" in ref else f"{base}/boot/assets/{ref.lstrip('/')}"


def render_boot_script(
    target: BootTarget, *, mac: str, public_url: str, ca_pem: bytes | None = None
) -> str:
    """``public_url`` is how machines reach metald's HTTP API (no trailing slash); ``ca_pem``
    the CA its listener's certificate chains to, whose fingerprint the kernel command line
    carries (``metald.ca=sha256:<hex>``) for the agents to pin."""
    base = public_url.rstrip("/")
    lines = ["#!ipxe", f"# metald: {target.action.value} for {mac}"]
    if target.action is BootAction.LOCAL or not target.kernel:
        lines += ["echo metald: booting from local disk", "exit 0"]
        return "\n".join(lines) + "\n"
    args = {"metald.url": base, "metald.mac": mac, "metald.action": target.action.value}
    if ca_pem is not None:
        args["metald.ca"] = ca_fingerprint(ca_pem)
    args.update(target.kernel_args)
    cmdline = " ".join(f"{k}={v}" if v != "" else k for k, v in args.items())
    lines.append(f"echo metald: {target.action.value} image for {mac}")
    # The kernel below is built for the machine's recorded architecture: an iPXE of another
    # (a machine recorded wrongly, a board swapped) says so instead of booting what cannot run.
    # x86 iPXE says i386 (BIOS builds) or x86_64 (UEFI): amd64 is "anything but arm64".
    buildarch = IPXE_BUILDARCH.get(target.arch or "")
    if buildarch == IPXE_BUILDARCH[ARM64]:
        lines.append(f"iseq ${{buildarch}} {buildarch} || goto wrongarch")
    elif buildarch:
        arm = IPXE_BUILDARCH[ARM64]
        lines += [f"iseq ${{buildarch}} {arm} && goto wrongarch || goto archok", ":archok"]
    kernel = f"kernel {_url(base, target.kernel)} initrd=initrd.img {cmdline}"
    lines.append(f"{kernel} || goto failed")
    if target.initrd:
        lines.append(f"initrd --name initrd.img {_url(base, target.initrd)} || goto failed")
    lines.append("boot || goto failed")
    if buildarch:
        lines += [
            ":wrongarch",
            f"echo metald: {mac} is recorded as {target.arch} but this iPXE is ${{buildarch}}; "
            "fix the machine's architecture in metald (docs/boot.md)",
            "goto retry",
        ]
    lines += [
        ":failed",
        "echo metald: boot failed, retrying in 10 s",
        ":retry",
        "sleep 10",
        f"chain --autofree {base}/boot/${{mac:hexhyp}}.ipxe",
    ]
    return "\n".join(lines) + "\n"
