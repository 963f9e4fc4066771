"""``BootPlane``: the DHCP, TFTP and RA services as one metald service.

HTTP boot is not hosted here: ``metald.boot.http.boot_routes`` are mounted on the API app.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metald.boot import sendfile
from metald.boot.dhcp.bootfile import Arch, BootFiles
from metald.boot.dhcp.common import NetworkPlan
from metald.boot.dhcp.enroll_limit import EnrollLimits
from metald.boot.dhcp.lease_feed import LeaseFeed
from metald.boot.dhcp.lease_store import LeaseStore
from metald.boot.dhcp.peers import DhcpPeers
from metald.boot.dhcp.server import DhcpServer
from metald.boot.hooks import BootHooks
from metald.boot.ra import RaResponder
from metald.boot.tftp.server import TftpServer
from metald.config import Config, ConfigError, split_hostport
from metald.store.db import Store

if TYPE_CHECKING:
    from metald.fleet.membership import Membership

log = logging.getLogger(__name__)


def http_base_url(cfg: Config) -> str:
    """How machines reach HTTP boot: boot.http_url, the provisioning listener's port (https
    with boot.tls_cert or boot.tls_auto), api.public_url, or server_address:<api port>."""
    if cfg.boot.http_url:
        return cfg.boot.http_url.rstrip("/")
    if cfg.boot.http_listen:
        _, port = split_hostport(cfg.boot.http_listen)
        scheme = "https" if cfg.boot.tls else "http"
        return f"{scheme}://{cfg.boot.server_address}:{port}"
    if cfg.api.public_url:
        return cfg.api.public_url.rstrip("/")
    _, port = split_hostport(cfg.api.listen)
    return f"http://{cfg.boot.server_address}:{port}"


#: Where ``python -m bootassets ipxe --install`` puts metald's own iPXE under boot.assets_dir.
BUILT_IPXE_DIR = "ipxe"
#: The architectures metald builds iPXE for (bootassets/ipxe.py); 32-bit UEFI is not built.
_BUILT_ARCHS = (("bios", "BIOS"), ("uefi_x64", "x86-64 UEFI"), ("uefi_arm64", "arm64 UEFI"))
_ARCH = {"bios": Arch.BIOS, "uefi_x64": Arch.UEFI_X64, "uefi_arm64": Arch.UEFI_ARM64}
#: The line of the installed build's script (``ipxe/metald.ipxe``) by which it tells metald it
#: is metald's (bootassets/ipxe.py USER_CLASS); a build without it (older) is not chainloaded
#: into: it would be chainloaded into itself again and again.
_SAYS_METALD = "set user-class metald"


def _identifies_itself(root: Path) -> bool:
    try:
        script = (root / BUILT_IPXE_DIR / "metald.ipxe").read_text()
    except (OSError, UnicodeDecodeError):
        return False
    return _SAYS_METALD in script.splitlines()


#: Why an arm64 machine gets no boot file (logged at start, and as an event per machine).
ARM64_NO_IPXE = (
    "arm64 UEFI machines get no boot file: Debian ships no arm64 iPXE and metald's own build "
    "is not installed in {where}/ipxe/; build it with python -m bootassets ipxe --ca <metald's "
    "CA> --install {where} (docs/boot.md)"
)


def choose_boot_files(cfg: Config) -> tuple[BootFiles, list[str]]:
    """The boot files DHCP hands out, and why any architecture gets Debian's iPXE instead of
    metald's build (``boot.ipxe``): ``ipxe/<name>`` under boot.assets_dir where that file is
    there, else ``<name>`` itself. ConfigError when ``boot.ipxe = "built"`` and one is missing."""
    b = cfg.boot
    names = {
        "bios": b.bios_file,
        "uefi_x64": b.uefi_x64_file,
        "uefi_ia32": b.uefi_ia32_file,
        "uefi_arm64": b.uefi_arm64_file,
    }
    reasons: list[str] = []
    chain: set[Arch] = set()
    if b.ipxe != "debian":
        root = Path(b.assets_dir) if b.assets_dir else None
        missing = []
        for key, what in _BUILT_ARCHS:
            built = f"{BUILT_IPXE_DIR}/{names[key]}"
            if root is not None and (root / built).is_file():
                names[key] = built
                chain.add(_ARCH[key])
            else:
                missing.append(f"{what} ({built})")
        if chain and root is not None and not _identifies_itself(root):
            reasons.append(
                f"the iPXE build in {root / BUILT_IPXE_DIR} predates metald's user class: a "
                "NIC's own iPXE ROM gets the script URL (over HTTPS it cannot check metald's "
                "certificate); rebuild and install it with python -m bootassets ipxe "
                "--install (docs/boot.md)"
            )
            chain.clear()
        if missing:
            where = f"{b.assets_dir}/{BUILT_IPXE_DIR}" if b.assets_dir else "boot.assets_dir"
            if b.ipxe == "built":
                raise ConfigError(
                    f'invalid config: boot.ipxe = "built" but {where} has no {", ".join(missing)}; '
                    f"build and install it with python -m bootassets ipxe --ca <metald's CA> "
                    f"--install {b.assets_dir or '<assets_dir>'} (docs/boot.md), or set "
                    f'boot.ipxe = "auto"'
                )
            reasons.append(
                f"no metald-built iPXE for {', '.join(missing)} in {where}: those machines get "
                "the file named in [boot] (Debian's iPXE: script over plain HTTP, a 2 s banner "
                "wait); build it with python -m bootassets ipxe --install (docs/boot.md)"
            )
    if not _present(b.assets_dir, names["uefi_arm64"]):
        # Debian's ipxe package has no arm64 binary: an arm64 client gets nothing rather than
        # a name that is not there (or, over UEFI HTTP boot, the x86 binary).
        names["uefi_arm64"] = ""
        reasons.append(ARM64_NO_IPXE.format(where=b.assets_dir or "<assets_dir>"))
    files = BootFiles(
        bios=names["bios"],
        uefi_x64=names["uefi_x64"],
        uefi_ia32=names["uefi_ia32"],
        uefi_arm64=names["uefi_arm64"],
        http_base=http_base_url(cfg),
        chain=frozenset(chain),
    )
    return files, reasons


def unbootable(cfg: Config) -> dict[str, str]:
    """DHCP firmware names (``Arch`` values) whose clients get no boot file, and why: arm64
    without an arm64 iPXE."""
    try:
        files, _ = choose_boot_files(cfg)
    except ConfigError:
        return {}  # boot.ipxe = "built" without the build: metald refuses to start anyway
    if files.uefi_arm64:
        return {}
    where = cfg.boot.assets_dir or "<assets_dir>"
    return {Arch.UEFI_ARM64.value: ARM64_NO_IPXE.format(where=where)}


def _present(assets_dir: str | None, name: str) -> bool:
    """Whether the boot file ``name`` is there to serve (unknowable without an assets folder:
    then it is taken to be, as before)."""
    if not assets_dir:
        return True
    return bool(name) and (Path(assets_dir) / name).is_file()


def https_required(cfg: Config, machines_tls: bool) -> bool:
    """``boot.require_https`` resolved: as set, else on when the machines' listener speaks
    HTTPS and metald's own iPXE (which trusts only its CA) is installed for every
    architecture it builds, so no machine is left on an iPXE that cannot fetch over it."""
    if cfg.boot.require_https is not None:
        return cfg.boot.require_https
    if not (machines_tls and cfg.boot.enabled and cfg.boot.ipxe != "debian"):
        return False
    try:
        _, reasons = choose_boot_files(cfg)
    except ConfigError:
        return False
    return not reasons


def boot_files(cfg: Config) -> BootFiles:
    files, reasons = choose_boot_files(cfg)
    for reason in reasons:
        log.warning("boot: %s", reason)
    return files


def join_fleet(
    dhcp: DhcpServer, fleet: Membership, *, takeover_secs: int
) -> tuple[LeaseFeed, DhcpPeers]:
    """Make ``dhcp`` one of several instances on its networks: its lease commits are announced
    to the others, theirs are learnt (the feed), it answers only its share of the clients
    (the peers), and nothing while fenced. Both are services to start before ``dhcp``."""
    assert dhcp.leases is not None
    dhcp.leases.notify_as = fleet.instance
    feed = LeaseFeed(dhcp.leases, fleet.instance)
    peers = dhcp.peers = DhcpPeers(fleet, dhcp.networks, takeover_secs=takeover_secs)
    table = dhcp.leases.table
    starts: dict[str, int] = {}

    def seek() -> None:
        for net, offset in peers.pool_starts.items():
            if starts.get(net) != offset:
                table.seek(net, offset)
                starts[net] = offset

    seek()
    was_fenced = fleet.fenced

    def changed() -> None:
        nonlocal was_fenced
        peers.rebuild()
        seek()
        fenced = fleet.fenced
        if was_fenced and not fenced:
            # Back from a cut: what the others wrote meanwhile may not have been notified.
            feed.request_resync()
        was_fenced = fenced

    fleet.on_change(changed)
    return feed, peers


class BootPlane:
    name = "boot"

    def __init__(
        self, cfg: Config, store: Store, hooks: BootHooks, *, fleet: Membership | None = None
    ) -> None:
        b = cfg.boot
        if b.enabled and b.server_address is None:
            raise ConfigError("invalid config: boot.server_address is required when boot.enabled")
        self.cfg = cfg
        self.store = store
        self.hooks = hooks
        sendfile.configure(b.http_sendfile_threads)  # the asset routes' worker threads
        self.leases = LeaseStore(store)
        self.services: list[Any] = []
        #: The fleet membership: with it, on PostgreSQL, several instances share the leases and
        #: split the clients of a network (docs/fleet.md).
        self.fleet = fleet
        self.feed: LeaseFeed | None = None
        self.dhcp: DhcpServer | None = None
        if not b.enabled:
            return
        assert b.server_address is not None
        if b.dhcp_mode != "off":
            self.dhcp = DhcpServer(
                mode=b.dhcp_mode,
                interfaces=list(b.interfaces),
                networks=[NetworkPlan.from_config(n) for n in b.networks],
                server_id=b.server_address,
                files=boot_files(cfg),
                leases=self.leases if b.dhcp_mode == "full" else None,
                hooks=hooks,
                port=b.dhcp_port,
                proxy_port=b.proxy_port,
                enroll_limits=EnrollLimits.from_config(b.dhcp_enroll_limit),
                batch_io=b.dhcp_batch_io,
            )
            self.services.append(self.dhcp)
        if b.assets_dir and b.interfaces:
            self.services.append(
                TftpServer(
                    Path(b.assets_dir),
                    interfaces=list(b.interfaces),
                    port=b.tftp_port,
                    max_transfers=b.tftp_max_transfers,
                    max_per_client=b.tftp_max_per_client,
                    fast_ack=b.tftp_fast_ack,
                )
            )
        if b.router_advertisements and b.interfaces:
            self.services.append(RaResponder(list(b.interfaces), b.ra_prefix))

    async def start(self) -> None:
        if not self.cfg.boot.enabled:
            return
        if self.cfg.boot.dhcp_mode == "full":
            n = await self.leases.load()
            log.info("loaded %d DHCP leases", n)
            self._join_peers()
        started: list[Any] = []
        try:
            for svc in self.services:
                await svc.start()
                started.append(svc)
        except BaseException:
            for svc in reversed(started):
                await svc.stop()
            raise
        # Everything alive now (imported modules, config, ORM metadata) lives as long as the
        # process: out of the cyclic GC, whose collections otherwise walk that whole heap
        # again and again (the DHCP server did this for itself; HTTP boot without DHCP paid
        # ~10 % of its CPU in gc_collect_main under the HTTP bench, bench/BOOT.md).
        gc.freeze()

    def _join_peers(self) -> None:
        """Share leases and split clients with the other instances on these networks."""
        b = self.cfg.boot
        if self.dhcp is None or self.fleet is None or self.store.is_sqlite:
            return  # SQLite holds one instance (metald.fleet.startup)
        if b.dhcp_peers_mode == "off":
            return
        self.feed, peers = join_fleet(self.dhcp, self.fleet, takeover_secs=b.dhcp_takeover_secs)
        self.services[:0] = [self.feed, peers]

    async def stop(self) -> None:
        for svc in reversed(self.services):
            try:
                await svc.stop()
            except Exception:
                log.exception("stopping %s", svc.name)
        await self.leases.drain()
        self.leases.close()
