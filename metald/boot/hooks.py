"""The one coupling between the boot plane and the rest of metald, and its pure parts.

``BootHooks`` is what the boot plane calls: it reports clients it saw on DHCP and asks what a
machine should boot. What a machine boots follows from its state and boot intent alone
(``target_for_machine``). ``metald.boot.machine_hooks.StoreBootHooks`` implements the hooks on
the machine store; ``MemoryBootHooks`` here is a plain in-memory one for tests and tools. This
module imports no store, database or DHCP code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

from metald.arch import ASSET_PREFIX, CONSOLE, DEFAULT, from_firmware
from metald.lifecycle import UNINSPECTED, State


class BootAction(StrEnum):
    DISCOVERY = "discovery"  # unknown or not yet inspected: boot the discovery image
    INSPECT = "inspect"  # re-inspection: the discovery image again
    PROVISION = "provision"  # boot the claim's image
    WIPE = "wipe"  # boot the wipe image
    LOCAL = "local"  # boot from local disk (exit iPXE)


@dataclass(frozen=True)
class BootTarget:
    action: BootAction
    #: Paths under the assets folder (or absolute URLs) for kernel and initrd.
    kernel: str | None = None
    initrd: str | None = None
    #: Extra kernel command-line arguments, e.g. ``metald.token=...`` for the agent.
    kernel_args: dict[str, str] = field(default_factory=dict)
    machine_id: str | None = None
    #: The machine's CPU architecture (metald.arch): its iPXE script refuses to run on another
    #: (``${buildarch}``), and its agent boots get that architecture's serial console. None:
    #: not known (a machine DHCP has not recorded yet): amd64's files, no check.
    arch: str | None = None


class BootHooks(Protocol):
    async def client_seen(
        self, mac: str, *, arch: str, network: str | None, relay_agent: dict[str, str] | None
    ) -> None:
        """DHCP saw a network-booting client (called at most every few minutes per MAC)."""

    async def boot_target(self, mac: str, *, client: str | None = None) -> BootTarget:
        """What the iPXE script for ``mac`` should do; ``client`` is the address asking.
        Raises ``ScriptRefused`` when that address may not have this machine's script."""


class ScriptRefused(Exception):
    """The script would carry an agent token and the asking address does not hold the MAC's
    lease (``[boot] script_clients = "leased"``)."""


#: Kernel and initrd of the discovery image, under the assets folder (built by bootassets/).
DISCOVERY_KERNEL = "discovery/vmlinuz"
DISCOVERY_INITRD = "discovery/initrd.img"


class MachineRecord(Protocol):
    """What the boot target is decided from (``metald.store.models.Machine`` has it)."""

    id: str
    state: str
    boot_intent: dict[str, Any] | None
    arch: str | None
    firmware: str | None


def agent_path(path: str | None, arch: str) -> str | None:
    """Where ``arch``'s build of metald's agent image file ``path`` is under the assets folder:
    amd64's at the top, arm64's under arm64/ (URLs as they are)."""
    if not path or "://" in path or not ASSET_PREFIX[arch]:
        return path
    prefix = ASSET_PREFIX[arch]
    return path if path.startswith(prefix) else prefix + path.lstrip("/")


def target_for_machine(m: MachineRecord | None) -> BootTarget:
    """Pure: the boot target implied by a machine's state and boot intent. Discovery,
    inspection, wiping and disk-image deployment boot metald's agent image built for the
    machine's architecture; a stateless image is the tenant's, built for it already (claims
    refuse a mismatch)."""
    if m is None:
        return BootTarget(BootAction.DISCOVERY, DISCOVERY_KERNEL, DISCOVERY_INITRD)
    arch = getattr(m, "arch", None) or from_firmware(getattr(m, "firmware", None))
    intent = m.boot_intent or {}
    state = State(m.state)
    args = {str(k): str(v) for k, v in (intent.get("kernel_args") or {}).items()}
    if intent.get("action") in {a.value for a in BootAction}:
        action = BootAction(intent["action"])
    elif state in UNINSPECTED:
        action = BootAction.DISCOVERY
    elif state is State.PROVISIONING:
        action = BootAction.PROVISION
    elif state is State.WIPING:
        action = BootAction.WIPE
    else:
        action = BootAction.LOCAL
    if action in (BootAction.DISCOVERY, BootAction.INSPECT):
        kernel = intent.get("kernel", DISCOVERY_KERNEL)
        initrd = intent.get("initrd", DISCOVERY_INITRD)
    else:
        kernel, initrd = intent.get("kernel"), intent.get("initrd")
    if action in (BootAction.PROVISION, BootAction.WIPE) and not kernel:
        # Nothing to boot yet: stay on local disk rather than hang in iPXE.
        action = BootAction.LOCAL
    if action is not BootAction.PROVISION or intent.get("image_kind") != "stateless":
        kernel, initrd = agent_path(kernel, arch or DEFAULT), agent_path(initrd, arch or DEFAULT)
    return BootTarget(action, kernel, initrd, args, m.id, arch)


def with_agent_console(t: BootTarget) -> BootTarget:
    """Pure: the kernel arguments every agent boot of metald's images carries. The agent reports
    on the serial console too (people and tests read it there); quiet: the kernel would
    otherwise print its command line, agent token included."""
    if not t.kernel or "console" in t.kernel_args:
        return t
    console = CONSOLE[t.arch or DEFAULT]
    args = {"console": f"{console},115200", "quiet": "", **t.kernel_args}
    if t.machine_id:
        args["metald.machine"] = t.machine_id
    return replace(t, kernel_args=args)


def with_agent_token(t: BootTarget, token: str) -> BootTarget:
    """Pure: ``t`` with ``metald.token=<token>`` among its kernel arguments."""
    return replace(t, kernel_args={**t.kernel_args, "metald.token": token})


#: At most this many other instances' URLs ride on a script (the kernel command line is short).
MAX_PEER_URLS = 8
_URL_OK = re.compile(r"^https?://[A-Za-z0-9._:\[\]-]+(/[A-Za-z0-9._~/-]*)?$")


def peer_urls(own: str, members: list[Any], provisioning_networks: list[str]) -> list[str]:
    """Pure: the boot URLs of the other live instances (``Member`` rows, the instances table)
    that serve one of ``provisioning_networks``, for the agent to fall back on when ``own``
    stops answering (``metald.urls=``). Each at most once, never ``own``, only plain
    ``http(s)://host[:port][/path]`` URLs (nothing that could split a kernel argument)."""
    ours = set(provisioning_networks)
    out: list[str] = []
    seen = {own.rstrip("/")}
    for m in members:
        serves = getattr(m, "serves", None) or {}
        url = str(serves.get("boot_url") or "").rstrip("/")
        if not url or url in seen or not _URL_OK.match(url):
            continue
        if ours and not ours & set(serves.get("provisioning_networks") or []):
            continue
        seen.add(url)
        out.append(url)
        if len(out) >= MAX_PEER_URLS:
            break
    return out


def with_peer_urls(t: BootTarget, urls: list[str]) -> BootTarget:
    """Pure: ``t`` with ``metald.urls=<url>,<url>``: where its agent goes on when the instance
    that served the script (``metald.url``) stops answering. Not secret."""
    if not urls:
        return t
    return replace(t, kernel_args={**t.kernel_args, "metald.urls": ",".join(urls)})


def rack_position(relay_agent: dict[str, str] | None) -> str | None:
    """Option 82 as one string: ``remote-id/circuit-id`` (switch / port)."""
    if not relay_agent:
        return None
    parts = [relay_agent.get("remote_id"), relay_agent.get("circuit_id")]
    joined = "/".join(p for p in parts if p)
    return joined or None


class MemoryBootHooks:
    """In-memory hooks: records what was seen, returns a per-MAC or default target."""

    def __init__(self, default: BootTarget | None = None) -> None:
        self.seen: list[dict[str, Any]] = []
        self.targets: dict[str, BootTarget] = {}
        self.default = default or target_for_machine(None)

    async def client_seen(
        self, mac: str, *, arch: str, network: str | None, relay_agent: dict[str, str] | None
    ) -> None:
        self.seen.append({"mac": mac, "arch": arch, "network": network, "relay_agent": relay_agent})

    async def boot_target(self, mac: str, *, client: str | None = None) -> BootTarget:
        return self.targets.get(mac, self.default)
