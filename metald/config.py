"""metald configuration: a TOML file, validated, with environment overrides.

Every section is a pydantic model that forbids unknown keys, so a typo in the file is an error
that names the key instead of a silently ignored setting. Environment variables override file
values: ``METALD_<SECTION>__<KEY>`` (for example ``METALD_API__LISTEN=0.0.0.0:8080``); values
are parsed as TOML scalars when they can be (numbers, booleans, quoted strings, arrays). Only a
variable whose first part names a top-level key (a section such as ``API`` or a key such as
``STATE_DIR``) is an override: other ``METALD_*`` variables (``METALD_URL`` for metalctl,
``METALD_LAB_LONG`` for the tests, the node agents' own) are left alone with a warning, while
an unknown key inside a known section is still an error.
"""

from __future__ import annotations

import logging
import os
import tomllib
from ipaddress import IPv4Address, IPv4Network, IPv6Network
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from metald.health.config import HealthConfig
from metald.inventory.rules import EnrollmentRule
from metald.macaddr import normalize_mac


class ConfigError(Exception):
    """The configuration cannot be used; the message names the key and the problem."""


def split_hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class StoreConfig(_Section):
    #: SQLAlchemy URL. Empty means SQLite at ``<state_dir>/metald.db`` (WAL mode).
    url: str = ""
    #: Threads that run database work (the asyncio loop never blocks on the store). 0: one for
    #: SQLite (it takes one writer at a time; more threads only contend for its lock and
    #: Python's GIL: 36 -> 27 ms of CPU per enrolled machine in bench/storm.py), 8 for PostgreSQL.
    workers: int = Field(default=0, ge=0, le=64)


class ApiConfig(_Section):
    #: host:port the staff API (admin, technicians, orchestrators) listens on: an address on
    #: the management network. Also HTTP boot, agents and joins while boot.http_listen is empty.
    listen: str = "127.0.0.1:8080"
    #: URL machines and agents use to reach this API (rendered into iPXE scripts) while
    #: boot.http_listen is empty.
    public_url: str = ""
    #: PEM certificate chain and private key: the staff API speaks HTTPS only (TLS 1.2+).
    #: Both or neither. The provisioning listener (boot.http_listen) has its own
    #: (boot.tls_cert, boot.tls_key).
    tls_cert: str = ""
    tls_key: str = ""
    #: Largest accepted request body, in bytes.
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    #: Default and maximum page size of list endpoints.
    page_size: int = Field(default=100, ge=1, le=1000)
    #: Answer requests from the addresses of machines allocated to a tenant only on the join,
    #: agent and boot endpoints (403 elsewhere, before any token is read): the tenant has root
    #: there. metald/nodeguard.py.
    guard_tenant_nodes: bool = True
    #: Mesh long-polls (``POST /api/v1/mesh`` with ``wait_s``) held at once by one node token,
    #: and by this instance in all; beyond either, a 429 with Retry-After (the node polls
    #: again). A node holds one; a few more cover a poll whose client went away unseen.
    mesh_polls_per_token: int = Field(default=4, ge=1)
    mesh_polls_max: int = Field(default=4096, ge=1)

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        split_hostport(v)
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> ApiConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: set both (HTTPS) or neither (plain HTTP)")
        return self


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class AuthConfig(_Section):
    #: Where the first admin token is written (0600) on first start. Empty: <state_dir>/admin.token
    admin_token_file: str = ""


class DhcpNetwork(_Section):
    """One provisioning network (a subnet) the DHCP server hands addresses on."""

    name: str
    subnet: IPv4Network
    #: Inclusive address range handed out dynamically.
    pool_start: IPv4Address
    pool_end: IPv4Address
    router: IPv4Address | None = None
    dns: list[IPv4Address] = []
    lease_seconds: int = Field(default=3600, ge=60)
    #: Interface this network is served on directly (no relay). Empty: reached through relays only.
    interface: str = ""
    #: MAC -> fixed address.
    reservations: dict[str, IPv4Address] = {}

    @field_validator("reservations")
    @classmethod
    def _reservation_macs(cls, v: dict[str, IPv4Address]) -> dict[str, IPv4Address]:
        return {normalize_mac(mac): ip for mac, ip in v.items()}


class DhcpEnrollLimit(_Section):
    """How fast DHCP hands clients it has not reported lately to enrollment (which creates a
    machine per unknown MAC): token buckets, so a flood of made-up MACs cannot grow the store
    without bound while a rack's power-on storm still enrolls at once. A burst of 0 turns
    that limit off. Refused reports are counted as metald_dhcp_ignored_total{reason=
    "enroll-limited-..."}; the client's next DHCP packet tries again."""

    #: Per relay (giaddr; the interface for clients on the wire) and per source address:
    #: 1,000 machines behind one relay power on at once; then 200 a second.
    relay_burst: int = Field(default=1000, ge=0)
    relay_per_s: float = Field(default=200.0, ge=0)
    #: Per switch port (option 82 remote id + circuit id): a port carries one machine.
    port_burst: int = Field(default=8, ge=0)
    port_per_min: float = Field(default=1.0, ge=0)
    #: For this instance in total (a sender forging giaddr and source addresses).
    total_burst: int = Field(default=2000, ge=0)
    total_per_s: float = Field(default=200.0, ge=0)


class BootConfig(_Section):
    """The boot plane: DHCP, TFTP, HTTP boot, Router Advertisements."""

    enabled: bool = False
    #: full: metald owns addresses. proxy: someone else does; metald only answers boot options.
    dhcp_mode: Literal["full", "proxy", "off"] = "full"
    #: Interfaces the DHCP, TFTP and RA servers are bound to. Never answers elsewhere.
    interfaces: list[str] = []
    #: Address this server is reached at on the provisioning network (siaddr, TFTP, HTTP).
    server_address: IPv4Address | None = None
    dhcp_port: int = Field(default=67, ge=1, le=65535)
    #: Several instances on one provisioning network (one PostgreSQL; docs/fleet.md):
    #: "load-balancing" splits clients among the instances serving the network by the
    #: RFC 3074 hash of the MAC; "off": every instance answers every client.
    dhcp_peers_mode: Literal["load-balancing", "off"] = "load-balancing"
    #: A client whose `secs` field reached this is answered by any instance (its owner is
    #: alive for the fleet but not answering it), as Kea HA's max-ack-delay.
    dhcp_takeover_secs: int = Field(default=10, ge=1, le=65535)
    proxy_port: int = Field(default=4011, ge=1, le=65535)
    tftp_port: int = Field(default=69, ge=1, le=65535)
    #: TFTP transfers held at once, in total and per client address (each holds a socket;
    #: unacknowledged ones are pushed out first when a cap is reached).
    tftp_max_transfers: int = Field(default=512, ge=1)
    tftp_max_per_client: int = Field(default=8, ge=1)
    #: Answer lock-step TFTP ACKs in the C loop (metald/boot/tftp/_fastack.c) where it is
    #: built; false: the pure-Python path (for comparison; the same answers, more CPU).
    tftp_fast_ack: bool = True
    #: Read and send DHCP datagrams in batches (recvmmsg/sendmmsg, metald/boot/dhcp/_batchio.c)
    #: where built; false: one recvfrom/sendto per datagram (for comparison; the same answers).
    dhcp_batch_io: bool = True
    #: Boot assets of 1 MiB or more are sent by the kernel from up to this many worker
    #: threads (blocking sendfile, metald/boot/sendfile.py), so downloads use every core;
    #: 0: all on the event loop.
    http_sendfile_threads: int = Field(default=64, ge=0, le=1024)
    #: Folder with iPXE binaries and boot images, served by TFTP and HTTP (read-only) without a
    #: token. Required when enabled; must not be, contain or sit inside state_dir. Hidden
    #: (dot) files in it are not served.
    assets_dir: str = ""
    #: Answer IPv6 Router Solicitations on the boot interfaces (removes iPXE's ~16 s IPv6 wait).
    router_advertisements: bool = True
    #: IPv6 prefix advertised as on-link and autonomous in RAs (e.g. "fd00:10::/64"). Empty:
    #: RAs carry no prefix (enough to end iPXE's wait; no IPv6 addresses are configured).
    ra_prefix: IPv6Network | None = None
    #: Which iPXE binaries DHCP hands out. "auto": metald's own build (``python -m bootassets
    #: ipxe --install <assets_dir>``: HTTPS pinned to metald's CA, no banner wait, an embedded
    #: script) from <assets_dir>/ipxe/ for each architecture it is there for, else the file
    #: named below (Debian's), with the reason logged at start. "built": only the built ones
    #: (metald does not start without them). "debian": always the files named below.
    ipxe: Literal["auto", "built", "debian"] = "auto"
    #: Boot file for legacy BIOS PXE clients (option 93 arch 0), under assets_dir.
    bios_file: str = "undionly.kpxe"
    #: Boot file for x86-64 UEFI PXE and UEFI HTTP boot clients (arch 7, 9, 16).
    uefi_x64_file: str = "snponly.efi"
    #: Boot file for 32-bit x86 UEFI clients (arch 6).
    uefi_ia32_file: str = "ipxe-i386.efi"
    #: Boot file for arm64 UEFI clients (arch 11, 19).
    uefi_arm64_file: str = "snponly-arm64.efi"
    #: host:port of the provisioning listener: the only endpoints machines need (/boot/,
    #: /api/v1/agent/, /api/v1/join) on an address of the provisioning network; every other
    #: path answers 404 there, and the staff API (api.listen) stops serving these. Empty: one
    #: listener (api.listen) for everything, with a warning at start.
    http_listen: str = ""
    #: PEM certificate chain and private key of the provisioning listener (http_listen): it
    #: then speaks HTTPS only (TLS 1.2+). A certificate from the CA metald's own iPXE is built
    #: with (docs/boot.md), so iPXE fetches its script pinned to that CA. Both or neither;
    #: needs http_listen (one listener: [api] tls_cert).
    tls_cert: str = ""
    tls_key: str = ""
    #: PEM of the root CA tls_cert chains to: what the agents pin (its SHA-256 fingerprint goes
    #: on their kernel command line as metald.ca=) and what GET /boot/ca.pem serves. Empty: the
    #: last certificate of tls_cert's chain.
    tls_ca: str = ""
    #: HTTPS on the provisioning listener with no operator PKI: metald makes its own CA once in
    #: state_dir (boot-ca.pem; boot-ca.key 0600) and issues the listener's certificate for
    #: server_address from it (boot-tls.pem/.key, issued again before it expires). Build
    #: metald's iPXE with that CA (docs/boot.md). Instead of tls_cert; needs http_listen.
    #: Empty: on when http_listen is set without tls_cert and metald's own iPXE, built with
    #: this state_dir's boot-ca.pem, is installed for every architecture it builds (boot.ipxe);
    #: off otherwise, with the reason logged at start.
    tls_auto: bool | None = None
    #: Refuse, over plain HTTP, every request that carries or would hand out a token: the
    #: agent API, joins, mesh and health reports, and iPXE scripts that carry an agent token
    #: (403 problem+json). Empty: on when the machines' listener has a certificate (tls_cert,
    #: tls_auto, or api.tls_cert with one listener) and metald's own iPXE is installed for
    #: every architecture it builds (boot.ipxe). true needs that certificate.
    require_https: bool | None = None
    #: host:port of a plain-HTTP listener that serves the boot assets (/boot/assets/) and
    #: nothing else, for the kernel and initrd when the provisioning listener speaks HTTPS with
    #: metald's own CA (tls_auto): scripts, still over HTTPS, load them from here and iPXE
    #: checks each against metald's signature (imgverify, a key the boot CA certifies) before
    #: booting. iPXE's software TLS makes the 28 MB of kernel and initrd slow over HTTPS under
    #: emulation or old firmware (docs/boot.md). Empty: kernel and initrd over the provisioning
    #: listener itself.
    assets_http_listen: str = ""
    #: Base URL iPXE uses for scripts and assets. Empty: http(s)://<server_address>:<http_listen
    #: port> when http_listen is set (https with tls_cert), else api.public_url, else
    #: http://<server_address>:<api port>.
    http_url: str = ""
    #: Who gets a machine's iPXE script while it carries an agent token (discovery, provision,
    #: wipe). "leased": only the address metald's DHCP bound to that MAC, so another machine
    #: on the provisioning network (a tenant's, say) cannot ask for the script of a machine
    #: being provisioned and act as its agent. "any": whoever asks for the MAC (for proxy DHCP,
    #: where metald does not know the addresses, or scripts fetched through a proxy or NAT).
    #: Empty: "leased" with dhcp_mode "full", "any" otherwise (with a warning at start).
    script_clients: Literal["", "leased", "any"] = ""
    networks: list[DhcpNetwork] = []
    dhcp_enroll_limit: DhcpEnrollLimit = DhcpEnrollLimit()

    @field_validator("http_listen", "assets_http_listen")
    @classmethod
    def _http_listen(cls, v: str) -> str:
        if v:
            split_hostport(v)
        return v

    @model_validator(mode="after")
    def _tls(self) -> BootConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError(
                "boot.tls_cert and boot.tls_key: set both (HTTPS) or neither (plain HTTP)"
            )
        if self.tls_cert and not self.http_listen:
            raise ValueError(
                "boot.tls_cert needs boot.http_listen (the provisioning listener it is for); "
                "with one listener for everything, set [api] tls_cert instead"
            )
        if self.tls_auto and self.tls_cert:
            raise ValueError(
                "boot.tls_auto and boot.tls_cert: set one (metald's own CA, or the operator's "
                "certificate), not both"
            )
        if self.tls_auto and not self.http_listen:
            raise ValueError(
                "boot.tls_auto needs boot.http_listen (the provisioning listener its certificate "
                "is for)"
            )
        if self.assets_http_listen and self.tls_cert:
            raise ValueError(
                "boot.assets_http_listen needs metald's own CA (boot.tls_auto), not "
                "boot.tls_cert: metald signs the kernel and initrd with a key that CA certifies"
            )
        if self.assets_http_listen and self.assets_http_listen == self.http_listen:
            raise ValueError("boot.assets_http_listen and boot.http_listen must differ")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("boot.tls_ca names the CA of boot.tls_cert: set tls_cert too")
        return self

    @property
    def tls(self) -> bool:
        """The provisioning listener (http_listen) speaks HTTPS."""
        return bool(self.tls_cert or self.tls_auto)

    @model_validator(mode="after")
    def _leases_known(self) -> BootConfig:
        if self.script_clients == "leased" and self.dhcp_mode != "full":
            raise ValueError(
                'script_clients = "leased" needs dhcp_mode = "full": only then does metald '
                "know which address holds which MAC"
            )
        return self

    @property
    def scripts_leased_only(self) -> bool:
        if self.script_clients:
            return self.script_clients == "leased"
        return self.dhcp_mode == "full"


class BmcConfig(_Section):
    """BMC command scheduling."""

    #: Most BMC commands in flight at once across the whole fleet.
    max_concurrency: int = Field(default=256, ge=1)
    #: Least time between the end of one command to a BMC and the start of the next to it.
    min_interval_ms: int = Field(default=200, ge=0)
    #: Deadline of one attempt of one command, login included.
    timeout_s: float = Field(default=10.0, gt=0)
    #: Deadline of sensor and event-log reads, which walk many records (IPMI SDR, SEL).
    sensors_timeout_s: float = Field(default=30.0, gt=0)
    #: Further attempts after a retryable failure (timeouts, unreachable, bad replies; never auth).
    retries: int = Field(default=3, ge=0)
    #: First backoff ceiling before a retry; doubles each attempt, delays drawn uniformly below it.
    backoff_base_ms: int = Field(default=250, ge=0)
    #: Largest backoff ceiling, in seconds.
    backoff_max_s: float = Field(default=8.0, ge=0)
    #: IPMI over UDP: re-send an unanswered request after this long (same sequence number).
    ipmi_resend_ms: int = Field(default=500, ge=10)
    #: IPMI cipher suites proposed at login, in order (17: HMAC-SHA256 + AES; 3: HMAC-SHA1 +
    #: AES). [17] refuses BMCs that only speak suite 3 (no downgrade).
    ipmi_cipher_suites: list[Literal[3, 17]] = Field(default=[17, 3], min_length=1)
    #: Seconds between power-state reads of every BMC; 0 turns the sync off.
    power_sync_interval_s: float = Field(default=60.0, ge=0)
    #: After a metald power command, how long a different reading is expected, not drift.
    drift_grace_s: float = Field(default=120.0, ge=0)
    #: How long a power action waits for the BMC to report the state it asked for (Ironic
    #: waits 60 s); past it the API answers 202 with the command's id and keeps polling.
    power_state_timeout_s: float = Field(default=60.0, gt=0)
    #: How long that polling goes on in the background before the command is an error event.
    power_state_give_up_s: float = Field(default=300.0, gt=0)
    #: CIDRs of the BMCs this instance can reach; it owns only BMCs whose address lies in one
    #: (a host name matches any). Empty: every BMC. See docs/fleet.md. Registration
    #: (POST /api/v1/bmcs) connects only inside them when set, and to loopback or link-local
    #: addresses only when an entry inside that range names them (e.g. "127.0.0.0/8" for a lab
    #: of simulated BMCs); never to metald's own listeners. docs/security.md.
    networks: list[IPv4Network | IPv6Network] = []
    #: Deadline of verifying a BMC at registration (every protocol tried). A failed one is
    #: answered only once it has passed: the answer's timing does not tell a closed port from a
    #: silent one.
    verify_s: float = Field(default=20.0, gt=0, le=300)
    #: Serial-console viewers (``GET /api/v1/machines/{id}/console``) held at once by one
    #: token, on one machine, and by this instance in all; beyond any, a 429 with Retry-After
    #: and no ``console.attached`` event.
    console_viewers_per_token: int = Field(default=8, ge=1)
    console_viewers_per_machine: int = Field(default=16, ge=1)
    console_viewers_max: int = Field(default=256, ge=1)
    #: PEM certificate metald enrolls in a machine's Secure Boot ``db`` through Redfish
    #: (``POST /api/v1/machines/{id}/secure-boot`` with enroll): the one whose key signs its
    #: iPXE and kernels (``python -m bootassets sign --new-key DIR`` makes ``DIR/db.crt``).
    #: Empty: enrolling is refused; enabling alone still works.
    secure_boot_cert: str = ""


class EnrollConfig(_Section):
    """Zero-touch enrollment: what the discovery agent may do and the rules applied to it."""

    #: Lifetime of the machine-scoped agent token put on the discovery kernel's command line.
    agent_token_ttl_s: int = Field(default=7200, ge=60)
    #: What a machine does once inspected: "poweroff" (wait for a claim powered off) or "wait".
    after_inspection: Literal["poweroff", "wait"] = "poweroff"
    #: A machine is claimable only once linked to a BMC or approved by a technician
    #: (``POST /api/v1/machines/{id}/approve``), so a host that invents a MAC and an inventory
    #: cannot be handed to a tenant. Empty: on as soon as any BMC is registered.
    require_bmc: bool | None = None
    #: Rules that set labels and rack from inventory and switch port, applied in order:
    #: [[enroll.rules]] match = { gpu_model = "NVIDIA H100*" } labels = { pool = "train" }
    rules: list[EnrollmentRule] = []


class NetworkPoolConfig(_Section):
    """A network metald hands static addresses out of to claimed machines (docs/tenant-os.md)."""

    #: The subnet, e.g. 10.20.0.0/24 (a /16 or smaller).
    cidr: str
    #: The router; a claim's interface on this network may take it as its default route.
    gateway: str | None = None
    #: First and last address handed out (default: every host address but the gateway).
    start: str | None = None
    end: str | None = None
    #: Name servers and search domains the deployed OS uses on this network.
    dns: list[str] = []
    search: list[str] = []
    #: MTU of interfaces on this network (9000, 4200 for RoCE rails ...).
    mtu: int | None = Field(default=None, ge=576, le=65535)
    #: VLAN id a claim's VLAN on this network takes when it names none.
    vlan: int | None = Field(default=None, ge=1, le=4094)

    @model_validator(mode="after")
    def _check(self) -> NetworkPoolConfig:
        import ipaddress

        try:
            net = ipaddress.ip_network(self.cidr, strict=False)
            for a in (self.gateway, self.start, self.end):
                if a is not None and ipaddress.ip_address(a) not in net:
                    raise ValueError(f"{a} is not in {self.cidr}")
        except ValueError as e:
            raise ValueError(f"network pool: {e}") from None
        if net.num_addresses > 1 << 16 and net.version == 4:
            raise ValueError(f"network pool {self.cidr}: larger than a /16; split it")
        return self


class ProvisionConfig(_Section):
    """Claims, provisioning, wipe and the watchdog over transitional states."""

    #: cloud-init's cloud-config JSON schema that tenants' user-data is checked against (the
    #: file Debian's cloud-init package installs).
    cloud_config_schema: str = (
        "/usr/lib/python3/dist-packages/cloudinit/config/schemas/schema-cloud-config-v1.json"
    )
    #: Largest user-data a claim (or one machine of it) may carry, in bytes.
    user_data_max_bytes: int = Field(default=65536, ge=1024, le=16 << 20)
    #: Address pools for the deployed OS's static addresses, by name ([provision.networks.X]).
    networks: dict[str, NetworkPoolConfig] = {}

    @model_validator(mode="after")
    def _pools_apart(self) -> ProvisionConfig:
        import ipaddress

        nets = [(ipaddress.ip_network(p.cidr, strict=False), n) for n, p in self.networks.items()]
        for i, (a, an) in enumerate(nets):
            for b, bn in nets[i + 1 :]:
                if a.version == b.version and a.overlaps(b):  # type: ignore[arg-type]
                    raise ValueError(
                        f"provision.networks.{an} ({a}) and .{bn} ({b}) overlap: one address "
                        "could be handed out twice; give each pool its own subnet"
                    )
        return self

    #: Seconds between watchdog sweeps; 0 turns the watchdog off.
    watchdog_interval_s: float = Field(default=30.0, ge=0)
    #: Longest time a machine may stay in each transitional state before the watchdog moves it
    #: to the matching failed state (0: never). Inspecting -> inspect-failed.
    inspecting_timeout_s: int = Field(default=1800, ge=0)
    #: commissioning -> commission-failed when the agent never reports its last check (a hung
    #: diagnostic); a profile longer than this (a burn-in of hours) needs it raised.
    commissioning_timeout_s: int = Field(default=7200, ge=0)
    #: provisioning -> provision-failed (a disk image is downloaded and written in this time).
    provisioning_timeout_s: int = Field(default=3600, ge=0)
    #: joining -> join-failed.
    joining_timeout_s: int = Field(default=1800, ge=0)
    #: wiping -> wipe-failed (large NVMe drives take a while to wipe).
    wiping_timeout_s: int = Field(default=14400, ge=0)
    #: A claimed machine not yet provisioning after this many seconds (metald restarted between
    #: claim and provision) is provisioned by the watchdog; 0: never.
    claimed_resume_s: int = Field(default=120, ge=0)
    #: A boot whose agent token was handed out this many seconds ago and never used by an agent
    #: (the script's answer was lost: its instance died as it answered) is started again through
    #: the BMC, at most 3 times per operation; 0: never.
    stranded_boot_s: int = Field(default=180, ge=0)
    #: Kernel and initrd (under boot.assets_dir, or URLs) of the image that writes disk images
    #: and wipes disks: the discovery image's agent in deploy/wipe mode.
    deploy_kernel: str = "discovery/vmlinuz"
    deploy_initrd: str = "discovery/initrd.img"
    #: Use the BMC (when the machine has one) to set a one-time PXE boot and power-cycle.
    use_bmc: bool = True
    #: Agent progress reports closer together than this (same phase) are accepted but not
    #: stored as events, so a chatty agent cannot flood the event log. 0 stores every one.
    progress_event_interval_s: float = Field(default=2.0, ge=0)


class TenantsConfig(_Section):
    """Tenant clusters: WireGuard hubs, their control planes, join tokens and VLANs."""

    #: Run each tenant's hub on this host (wireguard-go in its own network namespace, with an
    #: nftables guard that lets only WireGuard in on the underlay). Needs root.
    hubs: bool = False
    #: Bridge in metald's namespace the hubs' underlay veths are attached to: the provisioning
    #: network the nodes are on. Required with ``hubs``.
    underlay_bridge: str = ""
    #: Hub underlay addresses are handed out from this range on the bridge's network (a hub
    #: created without ``endpoint_host`` gets the next free one), e.g. "10.1.0.192/27".
    hub_addresses: IPv4Network | None = None
    #: Also run each slurm tenant's control plane (slurmctld + munged, configless, dynamic
    #: nodes) in its hub's namespace, listening on the hub's overlay address.
    control_planes: bool = False
    #: Seconds between looks at hubs (handshakes) and schedulers (node states).
    observe_interval_s: float = Field(default=2.0, gt=0)
    #: Lifetime of the one-time join token put in a node's first-boot metadata.
    join_token_ttl_s: int = Field(default=3600, ge=60, le=86400)
    #: Each tenant gets a VLAN id from this range, recorded and emitted in its claims' events
    #: for switch automation (metald does not configure switches).
    vlan_range: tuple[int, int] = (100, 3999)

    @field_validator("vlan_range")
    @classmethod
    def _vlans(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= v[0] <= v[1] <= 4094:
            raise ValueError("vlan_range must be [low, high] with 1 <= low <= high <= 4094")
        return v

    @model_validator(mode="after")
    def _hubs_need_a_bridge(self) -> TenantsConfig:
        if self.hubs and not self.underlay_bridge:
            raise ValueError(
                "hubs = true needs underlay_bridge (the provisioning network's bridge)"
            )
        if self.control_planes and not self.hubs:
            raise ValueError(
                "control_planes = true needs hubs = true (they run in the hubs' namespaces)"
            )
        return self


class FleetConfig(_Section):
    """Several instances on one PostgreSQL: heartbeats and when a silent one counts as dead."""

    #: Seconds between this instance's heartbeats in the store.
    heartbeat_s: float = Field(default=2.0, gt=0, le=60)
    #: An instance without a heartbeat for this long is dead: the others take its share. An
    #: instance that could not write its heartbeat for dead_after_s - heartbeat_s stops acting
    #: on what it owns first (self-fencing).
    dead_after_s: float = Field(default=10.0, gt=0, le=600)
    #: The heartbeat runs on a thread of its own, so a slow event loop (CPU starvation) does
    #: not fence the instance; a loop that has not run at all for this long (hung) stops the
    #: heartbeats, and the instance is fenced and taken over as if it had died. 20 s: about
    #: four times the worst lag measured under a 10,000-machine storm on two starved cores
    #: (5.3 s), and a hung instance's share moves within 30 s (docs/fleet.md, Self-fencing).
    loop_stall_s: float = Field(default=20.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _dead_after_longer(self) -> FleetConfig:
        if self.dead_after_s < 2 * self.heartbeat_s:
            raise ValueError("dead_after_s must be at least twice heartbeat_s")
        if self.loop_stall_s < self.heartbeat_s:
            raise ValueError("loop_stall_s must be at least heartbeat_s")
        return self


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)


def assets_root_problem(cfg: Config) -> str | None:
    """Why ``boot.assets_dir`` cannot be served without a token, or None.

    Everything under the assets root answers anyone on the provisioning network (tenant nodes
    included) over HTTP and TFTP, so it must be set when the boot plane runs and must share no
    folder with the state: not be ``state_dir``, nor contain it, nor sit inside it, and hold
    none of the secret files (admin token, secrets key, SQLite database) wherever they are.
    """
    if not cfg.boot.assets_dir:
        if cfg.boot.enabled:
            return (
                "boot.assets_dir: required when boot.enabled (the folder of iPXE binaries and "
                "boot images served to the provisioning network); it must be a folder apart "
                "from state_dir, e.g. /var/lib/metald-assets"
            )
        return None
    assets = Path(cfg.boot.assets_dir).resolve()
    state = Path(cfg.state_dir).resolve()
    if _inside(assets, state) or _inside(state, assets):
        how = "is" if assets == state else ("sits inside" if _inside(assets, state) else "contains")
        return (
            f"boot.assets_dir ({assets}) {how} state_dir ({state}): the assets folder is served "
            "without a token to the provisioning network and must not share a folder with the "
            "admin token, secrets key and database; give boot.assets_dir a folder of its own"
        )
    secrets = {"auth.admin_token_file": cfg.admin_token_path, "state_dir": cfg.secrets_key_path}
    if cfg.boot.tls_key:
        secrets["boot.tls_key"] = Path(cfg.boot.tls_key)
    if cfg.api.tls_key:
        secrets["api.tls_key"] = Path(cfg.api.tls_key)
    if cfg.store_url.startswith("sqlite:///"):
        secrets["store.url"] = Path(cfg.store_url.removeprefix("sqlite:///"))
    for key, path in secrets.items():
        if _inside(path.resolve(), assets):
            return (
                f"{key}: {path} is inside boot.assets_dir ({assets}), which is served without a "
                "token to the provisioning network; keep it out of the assets folder"
            )
    return None


class FirmwareConfig(_Section):
    """Firmware updates through the BMCs (docs/firmware.md)."""

    #: Where verified images are kept (by SHA-256) and served to BMCs from the boot HTTP
    #: listener. Empty: <state_dir>/firmware.
    images_dir: str = ""
    #: The largest image metald downloads.
    max_image_mb: int = Field(default=512, ge=1, le=16384)
    #: Deadline of one image download (the URL of a baseline component).
    download_timeout_s: float = Field(default=600.0, gt=0)
    #: How long a BMC may take to accept an offer and to finish its flash task.
    flash_timeout_s: float = Field(default=3600.0, gt=0)
    #: How long the new version may take to show once the flash is applied (a host reboot).
    verify_timeout_s: float = Field(default=900.0, gt=0)
    #: Seconds between reads of a BMC's update task (and of the version, while verifying).
    poll_s: float = Field(default=5.0, gt=0)
    #: At release, BMC accounts kept besides metald's own (the operator's); every other account
    #: is removed before the machine is wiped (docs/firmware.md).
    keep_accounts: list[str] = Field(default_factory=list, max_length=64)
    #: Restore BIOS, remove BMC accounts and check firmware at release (Redfish BMCs).
    clean_on_release: bool = True
    #: Seconds between two steps of a rollout's driver (it is also woken by every update's end).
    rollout_tick_s: float = Field(default=2.0, gt=0)
    #: How long the instance driving a rollout holds it without renewing; a survivor takes it
    #: over once this ran out (docs/firmware.md).
    rollout_lease_s: float = Field(default=30.0, gt=0)


class AttestationConfig(_Section):
    """Measured-boot attestation of discovery and wipe boots (docs/attestation.md)."""

    #: PCRs compared with a machine's golden values (SHA-256 bank). The default leaves out
    #: PCR 4 (the iPXE and kernel metald serves, which change with every boot-asset update).
    pcrs: list[int] = Field(default=[0, 1, 2, 3, 5, 6, 7], min_length=1, max_length=24)
    #: How long a nonce metald issued for a quote stays usable (it is used once).
    nonce_ttl_s: float = Field(default=300.0, gt=0, le=3600)
    #: PEM bundle of the TPM makers' EK CA certificates (roots and intermediates). Set: an
    #: attestation key is enrolled only with an EK certificate that chains to one of them.
    #: Empty: the EK certificate is checked against the EK only.
    ek_ca_file: str = ""

    @field_validator("pcrs")
    @classmethod
    def _pcrs(cls, v: list[int]) -> list[int]:
        if any(not 0 <= p <= 23 for p in v) or len(set(v)) != len(v):
            raise ValueError("attestation.pcrs: distinct PCR numbers 0-23")
        return sorted(v)


class Config(_Section):
    #: Folder for the SQLite database, the secrets key and the first admin token. Never
    #: served: boot.assets_dir must be a folder apart from it.
    state_dir: str = "/var/lib/metald"
    #: Name of this metald instance (one per rack or provisioning network); shows in events.
    instance: str = "metald"
    #: The event loop: "asyncio" (the standard one) or "uvloop" (the ``uvloop`` extra; not
    #: the default: it measured no clear gain for the boot servers, bench/BOOT.md).
    event_loop: Literal["asyncio", "uvloop"] = "asyncio"
    store: StoreConfig = StoreConfig()
    api: ApiConfig = ApiConfig()
    log: LogConfig = LogConfig()
    auth: AuthConfig = AuthConfig()
    boot: BootConfig = BootConfig()
    bmc: BmcConfig = BmcConfig()
    enroll: EnrollConfig = EnrollConfig()
    provision: ProvisionConfig = ProvisionConfig()
    tenants: TenantsConfig = TenantsConfig()
    fleet: FleetConfig = FleetConfig()
    #: Day 2: classification rules, remediation policies and limits (docs/health.md).
    health: HealthConfig = HealthConfig()
    firmware: FirmwareConfig = FirmwareConfig()
    attestation: AttestationConfig = AttestationConfig()

    @model_validator(mode="after")
    def _require_https(self) -> Config:
        if self.boot.require_https and self.boot.http_url.startswith("http://"):
            raise ValueError(
                "boot.require_https = true but boot.http_url is http://: machines would be sent "
                "to a plain-HTTP address; make it https:// or empty"
            )
        if self.boot.require_https and not self.machines_tls:
            where = (
                "boot.tls_cert or boot.tls_auto"
                if self.boot.http_listen
                else "api.tls_cert (one listener), or boot.http_listen with boot.tls_auto"
            )
            raise ValueError(
                f"boot.require_https = true but machines reach metald over plain HTTP: set {where}"
            )
        return self

    @property
    def machines_tls(self) -> bool:
        """The listener machines use (http_listen, else api.listen) speaks HTTPS."""
        return self.boot.tls if self.boot.http_listen else bool(self.api.tls_cert)

    @property
    def firmware_images_dir(self) -> Path:
        return Path(self.firmware.images_dir or Path(self.state_dir) / "firmware")

    @property
    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{Path(self.state_dir) / 'metald.db'}"

    @property
    def admin_token_path(self) -> Path:
        return Path(self.auth.admin_token_file or Path(self.state_dir) / "admin.token")

    @property
    def secrets_key_path(self) -> Path:
        return Path(self.state_dir) / "secrets.key"


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


#: ``METALD_*`` variables that belong to metalctl, never to the daemon: ignored without a word.
CLIENT_VARIABLES = frozenset({"METALD_URL", "METALD_TOKEN"})


def _apply_env(data: dict[str, Any], environ: dict[str, str], warnings: list[str]) -> None:
    for name, raw in sorted(environ.items()):
        if not name.startswith("METALD_") or name in CLIENT_VARIABLES:
            continue
        path = name[len("METALD_") :].lower().split("__")
        if path[0] not in Config.model_fields:
            warnings.append(
                f"environment variable {name} is not a configuration override (there is no "
                f"top-level key {path[0]!r}); ignored"
            )
            continue
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(path[:-1])} is not a section")
        node[path[-1]] = _parse_env_value(raw)


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{key}: {msg}")
    return "; ".join(lines)


def load_config(
    path: str | os.PathLike[str] | None,
    environ: dict[str, str] | None = None,
    warnings: list[str] | None = None,
) -> Config:
    """Read, merge with environment overrides, and validate. Raises ConfigError.

    What is ignored with a warning (a ``METALD_*`` variable that names no key) is appended to
    ``warnings`` when given, else logged."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    found: list[str] = []
    _apply_env(data, dict(os.environ if environ is None else environ), found)
    if warnings is not None:
        warnings.extend(found)
    else:
        for line in found:
            logging.getLogger(__name__).warning("%s", line)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {_describe(e)}") from None
    for net in cfg.boot.networks:
        for key in ("pool_start", "pool_end"):
            if getattr(net, key) not in net.subnet:
                raise ConfigError(
                    f"invalid config: boot.networks[{net.name}].{key}: {getattr(net, key)} is outside {net.subnet}"
                )
        if int(net.pool_start) > int(net.pool_end):
            raise ConfigError(
                f"invalid config: boot.networks[{net.name}].pool_start is after pool_end"
            )
    check_assets_root(cfg)
    return cfg


def check_assets_root(cfg: Config) -> None:
    """Raise ConfigError when the assets root would serve the state (``assets_root_problem``)."""
    problem = assets_root_problem(cfg)
    if problem is not None:
        raise ConfigError(f"invalid config: {problem}")
