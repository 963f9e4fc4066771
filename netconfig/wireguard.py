"""WireGuard devices in network namespaces: kernel (pyroute2) or wireguard-go (userspace).

Userspace: one supervised ``wireguard-go -f`` process per device, started inside the
namespace; it serves its UAPI socket at /var/run/wireguard/<ifname>.sock, a path shared by all
namespaces, so interface names must be unique host-wide. SIGTERM removes the device.
Configuration goes through that socket (netconfig.uapi); addresses and link state through
pyroute2.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from netconfig import netns
from netconfig.uapi import PeerConfig, PeerStatus, UapiError, check_errno, parse_get, render_set

SOCKET_DIR = Path("/var/run/wireguard")
MAX_IFNAME = 15


class WireGuardError(Exception):
    pass


def uapi_call(ifname: str, request: str, *, timeout: float = 5.0) -> str:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(SOCKET_DIR / f"{ifname}.sock"))
        sock.sendall(request.encode())
        reply = b""
        while not reply.endswith(b"\n\n"):  # every reply ends with "errno=N" and a blank line
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        return reply.decode()
    except OSError as e:
        raise WireGuardError(f"cannot reach the control socket of {ifname}: {e}") from None
    finally:
        sock.close()


@dataclass
class UserspaceDevice:
    """A wireguard-go device in a namespace, owned by this process."""

    ns: str
    ifname: str
    binary: str = "wireguard-go"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, *, wait: float = 5.0) -> None:
        if len(self.ifname) > MAX_IFNAME:
            raise WireGuardError(f"interface name {self.ifname!r} is longer than 15 characters")
        sock = SOCKET_DIR / f"{self.ifname}.sock"
        if sock.exists():
            raise WireGuardError(f"{sock} exists: {self.ifname} is already in use on this host")
        exe = shutil.which(self.binary)
        if exe is None:
            raise WireGuardError(f"{self.binary} is not installed")
        env = dict(os.environ, WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
        self.proc = subprocess.Popen(
            ["nsenter", f"--net={netns.path(self.ns)}", exe, "-f", self.ifname],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + wait
        while not sock.exists():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise WireGuardError(f"wireguard-go exited ({self.proc.returncode}): {err.strip()}")
            if time.monotonic() > deadline:
                self.stop()
                raise WireGuardError(f"wireguard-go did not create {sock}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, *, wait: float = 5.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def configure(self, request: str) -> None:
        check_errno(uapi_call(self.ifname, request))

    def peers(self) -> list[PeerStatus]:
        return parse_get(uapi_call(self.ifname, "get=1\n\n"))


@dataclass
class Hub:
    """A tenant's hub: a WireGuard device with the hub's key, port and overlay address."""

    ns: str
    ifname: str
    address_cidr: str
    listen_port: int
    device: UserspaceDevice | None = None

    def up(self, private_key: str, peers: list[PeerConfig] = ()) -> None:  # type: ignore[assignment]
        self.device = UserspaceDevice(self.ns, self.ifname)
        self.device.start()
        try:
            self.device.configure(
                render_set(
                    private_key=private_key,
                    listen_port=self.listen_port,
                    peers=list(peers),
                    replace_peers=True,
                )
            )
            netns.address(self.ns, self.ifname, self.address_cidr)
        except (UapiError, WireGuardError, OSError):
            self.down()
            raise

    def down(self) -> None:
        if self.device is not None:
            self.device.stop()
            self.device = None

    def _dev(self) -> UserspaceDevice:
        if self.device is None or not self.device.alive():
            raise WireGuardError(f"hub {self.ifname} is not running")
        return self.device

    def add_peer(self, public_key: str, address: str) -> None:
        """The node's overlay address (a /32) is its only allowed IP on the hub."""
        self._dev().configure(render_set(peers=[PeerConfig(public_key, [f"{address}/32"])]))

    def remove_peer(self, public_key: str) -> None:
        self._dev().configure(render_set(peers=[PeerConfig(public_key, remove=True)]))

    def peers(self) -> list[PeerStatus]:
        return self._dev().peers()


def kernel_wireguard_available() -> bool:
    """Whether this kernel has WireGuard (probed in a throwaway namespace)."""
    name = f"wgprobe{os.getpid()}"
    netns.create(name)
    try:
        from pyroute2 import NetlinkError, NetNS

        with NetNS(name) as ns:
            try:
                ns.link("add", ifname="wgprobe", kind="wireguard")
            except NetlinkError:
                return False
            return True
    finally:
        netns.delete(name)
