"""iPXE scripts from a boot target. Pure: the same target always renders the same script."""

from __future__ import annotations

from dataclasses import dataclass

from metald.arch import ARM64, IPXE_BUILDARCH
from metald.boot.hooks import BootAction, BootTarget
from metald.boot.pki import ca_fingerprint


def _url(base: str, ref: str) -> str:
    return ref if "://" in ref else f"{base}/boot/assets/{ref.lstrip('/')}"


@dataclass(frozen=True)
class SignedAssets:
    """Kernel and initrd under the assets folder come over plain HTTP from ``plain_url`` (the
    ``[boot] assets_http_listen`` listener) and are checked by iPXE against metald's detached
    signatures, fetched from the pinned HTTPS URL the script came from
    (metald.boot.signing), before anything boots."""

    #: http://<server_address>:<port>, no trailing slash
    plain_url: str
    #: The signing certificate's common name (``imgverify --signer``).
    signer: str


#: Where the HTTPS listener serves an asset's signature: ``/boot/signatures/<asset path>``.
SIGNATURES = "/boot/signatures/"
#: Where a machine's script reports an image that failed its check (metald.boot.http).
REFUSED = "/boot/image-refused/"


def _load(
    verb: str, ref: str, base: str, signed: SignedAssets | None, checks: list[tuple[str, str]]
) -> str:
    """The ``kernel``/``initrd`` command for ``ref``; with ``signed``, an asset (not a URL of
    another server) comes over plain HTTP, named, and its check goes into ``checks``."""
    if signed is None or "://" in ref:
        return f"{verb} {_url(base, ref)}"
    rel = ref.lstrip("/")
    if verb == "kernel":
        verb, name = "kernel --name vmlinuz", "vmlinuz"
    else:
        name = "initrd.img"
    checks.append((name, rel))
    return f"{verb} {_url(signed.plain_url, rel)}"


def render_boot_script(
    target: BootTarget,
    *,
    mac: str,
    public_url: str,
    ca_pem: bytes | None = None,
    signed: SignedAssets | None = None,
) -> str:
    """``public_url`` is how machines reach metald's HTTP API (no trailing slash); ``ca_pem``
    the CA its listener's certificate chains to, whose fingerprint the kernel command line
    carries (``metald.ca=sha256:<hex>``) for the agents to pin. ``signed``: load the kernel and
    initrd over plain HTTP and ``imgverify`` each against its signature from ``public_url``
    (an https URL) before booting; a failed check boots nothing, tells metald
    (``/boot/image-refused/<mac>``: a ``boot.image_refused`` event) and loads both again a
    minute later."""
    base = public_url.rstrip("/")
    if signed is not None and not base.startswith("https://"):
        signed = None  # a signature over plain HTTP proves nothing against a replayed file
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
    checks: list[tuple[str, str]] = []
    if signed is not None:
        lines.append(":load")
    kernel = _load("kernel", target.kernel, base, signed, checks)
    lines.append(f"{kernel} initrd=initrd.img {cmdline} || goto failed")
    if target.initrd:
        initrd = _load("initrd --name initrd.img", target.initrd, base, signed, checks)
        lines.append(f"{initrd} || goto failed")
    if signed is not None and checks:
        for name, rel in checks:
            lines += [
                f"set metald-refused {rel}",
                f"imgverify --signer {signed.signer} {name} {base}{SIGNATURES}{rel} || goto refused",
            ]
        # Only a verified image runs from here on (the kernel; the initrd was checked above).
        lines += ["imgtrust", "boot || goto untrusted"]
    else:
        lines.append("boot || goto failed")
    if buildarch:
        lines += [
            ":wrongarch",
            f"echo metald: {mac} is recorded as {target.arch} but this iPXE is ${{buildarch}}; "
            "fix the machine's architecture in metald (docs/boot.md)",
            "goto retry",
        ]
    if signed is not None and checks:
        # Loads again with this script (its token was not spent on the network: the script
        # came over HTTPS); fetching the script again would get one without a token.
        lines += [
            ":refused",
            "set metald-errno ${errno}",
            "imgfree vmlinuz ||",
            "imgfree initrd.img ||",
            "echo metald: ${metald-refused} failed its signature check (${metald-errno}): not "
            "booting it; metald is told, loading again in 60 s",
            f"imgfetch --name report {base}{REFUSED}{mac}/${{metald-errno}}?file=${{metald-refused}} "
            "&& imgfree report ||",
            "sleep 60",
            "goto load",
            ":untrusted",
            "imgtrust --allow",
            "goto failed",
        ]
    lines += [
        ":failed",
        "echo metald: boot failed, retrying in 10 s",
        ":retry",
        "sleep 10",
        f"chain --autofree {base}/boot/${{mac:hexhyp}}.ipxe",
    ]
    return "\n".join(lines) + "\n"
