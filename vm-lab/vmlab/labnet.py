"""Network namespaces for boot-plane tests and benchmarks: created per test, always deleted
afterwards (made and joined with netconfig.netns, the code metald itself runs).

Nothing here sends traffic outside the namespaces it made: there is no default route and the
veth/bridge ends live only inside them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from netconfig import netns

from .lab import REPO_ROOT

ROOT = os.geteuid() == 0
NEED_ROOT = "needs root for network namespaces (run the suite as root)"
_seq = itertools.count()


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM) -> int:
    """A port free on 127.0.0.1 for ``kind`` (TCP by default) at the time of the call."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


class Netns:
    def __init__(self, name: str) -> None:
        self.name = name

    def cmd(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        return sh(*self.cmd(*cmd), check=check, timeout=timeout)

    def popen(self, *cmd: str, **kw: object) -> subprocess.Popen[str]:
        return subprocess.Popen(self.cmd(*cmd), text=True, **kw)  # type: ignore[call-overload]


def unique(prefix: str) -> str:
    return f"{prefix}{os.getpid() % 100000}x{next(_seq)}"


@contextmanager
def namespaces(*roles: str) -> Iterator[dict[str, Netns]]:
    """One fresh namespace per role (loopback up), deleted on the way out."""
    made: list[Netns] = []
    try:
        for role in roles:
            ns = Netns(unique(f"mb{role[:3]}"))
            netns.create(ns.name)
            made.append(ns)
        yield {role: ns for role, ns in zip(roles, made, strict=True)}
    finally:
        for ns in made:
            with contextlib.suppress(netns.NetnsError):
                netns.delete(ns.name)


def veth(a: Netns, a_if: str, a_addr: str, b: Netns, b_if: str, b_addr: str) -> None:
    """A veth pair between two namespaces, up, with addresses (CIDR) on the ends given one.

    Both ends are created inside their namespaces, so the names never meet the host's."""
    netns.veth(a.name, a_if, b.name, b_if)
    for ns, name, addr in ((a, a_if, a_addr), (b, b_if, b_addr)):
        if addr:
            netns.address(ns.name, name, addr)
        else:
            netns.link_up(ns.name, name)


def write_config(
    path: Path, *, state_dir: Path, boot: str, listen: str = "127.0.0.1:8080", api: str = ""
) -> Path:
    """``api``: more lines for the [api] table (TLS, public_url)."""
    path.write_text(
        f'state_dir = "{state_dir}"\ninstance = "test"\n[api]\nlisten = "{listen}"\n{api}' + boot
    )
    return path


#: metald as a plain HTTP (and TFTP) boot server on loopback, no DHCP: the HTTP benches and
#: the entry point's tests (``root``, ``tftp_port`` to fill in).
HTTP_BOOT = """
[boot]
enabled = true
dhcp_mode = "off"
interfaces = ["lo"]
server_address = "127.0.0.1"
tftp_port = {tftp_port}
assets_dir = "{root}"
router_advertisements = false
"""


class BootProcess:
    """``python -m metald.boot`` inside a namespace; waits for READY."""

    def __init__(self, ns: Netns, config: Path, log: Path, *, access_log: bool = True) -> None:
        self.ns = ns
        self.config = config
        self.log = log
        self.access_log = access_log
        self.proc: subprocess.Popen[str] | None = None

    def _access_flag(self) -> list[str]:
        # A bench may run an older tree's metald.boot (--tree), which has no such flag.
        if self.access_log:
            return []
        main = (REPO_ROOT / "metald" / "boot" / "__main__.py").read_text()
        return ["--no-access-log"] if "--access-log" in main else []

    def start(self, timeout: float = 30) -> BootProcess:
        self._logf = open(self.log, "a")  # noqa: SIM115 - lives as long as the process
        self.proc = self.ns.popen(
            sys.executable,
            "-m",
            "metald.boot",
            "--config",
            str(self.config),
            "--log-level",
            "info",
            *self._access_flag(),
            stdout=subprocess.PIPE,
            stderr=self._logf,
            cwd=str(REPO_ROOT),
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                line = self.proc.stdout.readline()
                if line.strip() == "READY":
                    return self
                if not line and self.proc.poll() is not None:
                    break
        raise RuntimeError(f"metald.boot did not start; log:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_logf", None):
            self._logf.close()
