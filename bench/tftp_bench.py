"""TFTP benchmark: 200 concurrent fetches of ipxe.efi, metald vs tftpd-hpa vs dnsmasq.

    sudo .venv/bin/python bench/tftp_bench.py [--clients 200] [--rounds 2]
        [--servers metald,tftpd-hpa,dnsmasq] [--tree before=/path/to/other/tree ...]

Everything runs inside one network namespace on its loopback (nothing leaves it). Clients are
atftp processes started together; two option sets: what iPXE asks (blksize 1428 + tsize) and
what EDK2 asks (blksize 1468 + windowsize 4; tftpd-hpa ignores windowsize). Wall time from the
first start to the last exit; a failure is a non-zero exit or a file that differs. Rounds are
interleaved (each runs every server once) and the tables give medians.

Server CPU is read from a cpuacct cgroup the server is started in (so tftpd-hpa's forked
children count: it reaps them by ignoring SIGCHLD, so they never reach its cutime); without
one, from /proc of the server's process tree. ``--tree NAME=PATH`` adds a server NAME: the
metald of another source tree (``git archive`` of an older commit), run the same way, for
before/after figures in one run. ``metald-pyack`` is this tree's metald with its TFTP C
lock-step loop off (``METALD_BOOT__TFTP_FAST_ACK=false``: the pure-Python path), for the C
loop's gain.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _lab import (
    add_tree_option,
    namespaces,
    set_loop,
    table,
    tree_cpu_seconds,
    trees_of,
    write_config,
)

from vmlab import labnet

IPXE = Path("/usr/lib/ipxe/ipxe.efi")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class ServerCpu:
    """CPU seconds of a server and everything it forks: a cpuacct cgroup (v1) when one can be
    made, else /proc of the process tree (children reaped without wait are then missed)."""

    def __init__(self, name: str) -> None:
        self.group: Path | None = CPUACCT / f"tftp-bench-{os.getpid()}-{name}"
        try:
            self.group.mkdir()
        except OSError:
            self.group = None
        self.pid = 0

    def join(self, pid: int) -> None:
        """Move ``pid`` (just started) into the group; its later children follow."""
        self.pid = pid
        if self.group is not None:
            (self.group / "cgroup.procs").write_text(str(pid))

    def seconds(self) -> float:
        if self.group is not None:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        return tree_cpu_seconds(self.pid)

    def detail(self) -> tuple[float, float, int]:
        """User and system seconds (the group's; 0, 0 without one) and the server process's
        voluntary context switches: how often it slept waiting for packets."""
        user = system = 0.0
        if self.group is not None:
            for line in (self.group / "cpuacct.stat").read_text().splitlines():
                k, v = line.split()
                if k == "user":
                    user = int(v) / os.sysconf("SC_CLK_TCK")
                elif k == "system":
                    system = int(v) / os.sysconf("SC_CLK_TCK")
        sleeps = 0
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                status = (task / "status").read_text()
                sleeps += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        return user, system, sleeps

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(OSError):
                self.group.rmdir()


def loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


DRIVER = r"""
import asyncio, hashlib, sys, time
n, port, want, out, opts = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
async def one(i):
    args = ["atftp", "-g", "-r", "ipxe.efi", "-l", f"{out}/{i}"]
    for o in opts:
        args += ["--option", o]
    p = await asyncio.create_subprocess_exec(*args, "127.0.0.1", port,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await p.wait()
async def main():
    t0 = time.perf_counter()
    rcs = await asyncio.gather(*[one(i) for i in range(n)])
    wall = time.perf_counter() - t0
    bad = 0
    for i, rc in enumerate(rcs):
        try:
            ok = rc == 0 and hashlib.sha256(open(f"{out}/{i}", "rb").read()).hexdigest() == want
        except OSError:
            ok = False
        bad += not ok
    print(f"{wall:.3f} {bad}")
asyncio.run(main())
"""

BOOT = """
[boot]
enabled = true
dhcp_mode = "off"
interfaces = ["lo"]
server_address = "127.0.0.1"
tftp_port = 69
# Every bench client is 127.0.0.1: lift the per-client cap (8 by default) for them.
tftp_max_per_client = 1000
assets_dir = "{assets}"
router_advertisements = false
"""


def main() -> int:
    import hashlib

    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--servers", default="metald,tftpd-hpa,dnsmasq")
    add_tree_option(ap)
    args = ap.parse_args()
    trees = trees_of(args)
    servers = args.servers.split(",") + list(trees)
    load0 = loadavg()
    want = hashlib.sha256(IPXE.read_bytes()).hexdigest()
    scenarios = {
        "iPXE-like (blksize 1428, tsize)": ["blksize 1428", "tsize 0"],
        "EDK2-like (blksize 1468, windowsize 4)": ["blksize 1468", "windowsize 4"],
    }
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        shutil.copy(IPXE, root / "ipxe.efi")
        # in.tftpd drops to user tftp: it must be able to reach and read the file.
        for p in (Path(tmp), root):
            p.chmod(0o755)
        (root / "ipxe.efi").chmod(0o644)
        for rnd in range(args.rounds):
            for name in servers:
                with namespaces("tftp") as ns:
                    lab = ns["tftp"]
                    meter = ServerCpu(name)
                    if name.startswith("metald") or name in trees:
                        from _lab import BootProcess

                        os.environ.pop("METALD_BOOT__TFTP_FAST_ACK", None)
                        if name == "metald-pyack":
                            os.environ["METALD_BOOT__TFTP_FAST_ACK"] = "false"
                        set_loop("metald" if name in trees or name == "metald-pyack" else name)
                        cfg = write_config(
                            Path(tmp) / "m.toml",
                            state_dir=Path(tmp) / f"st{rnd}",
                            boot=BOOT.format(assets=root),
                            listen="127.0.0.1:8080",
                        )
                        # `python -m metald.boot` imports metald from its working directory:
                        # another tree runs from there (without its C loop: not built there).
                        repo = labnet.REPO_ROOT
                        if name in trees:
                            labnet.REPO_ROOT = trees[name].resolve()
                        try:
                            # a loaded box can take more than the default 30 s to start it
                            bp = BootProcess(lab, cfg, Path(tmp) / "metald.log").start(120)
                        finally:
                            labnet.REPO_ROOT = repo
                            os.environ.pop("METALD_BOOT__TFTP_FAST_ACK", None)
                        stop = bp.stop
                        meter.join(bp.proc.pid)  # type: ignore[union-attr]
                        # Which lock-step path this metald runs (its start-up log line).
                        found = re.findall(r"lock-step ACKs in (\w+)", bp.log.read_text())
                        how = f" (ACKs in {found[-1]})" if found else ""
                    else:
                        how = ""
                        if name == "tftpd-hpa":
                            # in.tftpd resolves its bind address with AI_ADDRCONFIG, which fails
                            # in a namespace whose only address is loopback ("cannot resolve
                            # local IPv4 bind address"): give the namespace one more address.
                            lab.run("ip", "addr", "add", "10.254.0.1/32", "dev", "lo")
                            cmd = ["in.tftpd", "-L", "-s", str(root), "-a", "127.0.0.1:69"]
                        else:
                            cmd = [
                                "dnsmasq",
                                "-d",
                                "-k",
                                "-C",
                                "/dev/null",
                                "--port=0",
                                "--enable-tftp",
                                f"--tftp-root={root}",
                                "--tftp-max=1000",
                                "--listen-address=127.0.0.1",
                                "--bind-interfaces",
                                f"--pid-file={tmp}/dnsmasq.pid",
                                "--log-facility=/dev/null",
                            ]
                        proc = lab.popen(*cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        meter.join(proc.pid)
                        time.sleep(0.5)

                        def stop(proc=proc) -> None:  # type: ignore[no-untyped-def]
                            proc.terminate()
                            proc.wait(10)

                    try:
                        for sc, opts in scenarios.items():
                            out = Path(tmp) / f"out-{name}-{rnd}-{len(opts[0])}"
                            out.mkdir()
                            cpu0, (u0, s0, w0) = meter.seconds(), meter.detail()
                            r = lab.run(
                                sys.executable,
                                "-c",
                                DRIVER,
                                str(args.clients),
                                "69",
                                want,
                                str(out),
                                *opts,
                                timeout=300,
                            )
                            cpu, (u1, s1, w1) = meter.seconds() - cpu0, meter.detail()
                            wall, bad = r.stdout.split()
                            results.setdefault((sc, name), []).append((float(wall), int(bad)))
                            cpus.setdefault((sc, name), []).append(cpu)
                            print(
                                f"round {rnd} {name:14} {sc}: {wall} s, server CPU {cpu:.2f} s "
                                f"(user {u1 - u0:.2f}, sys {s1 - s0:.2f}, {w1 - w0} sleeps), "
                                f"{bad} failed, load {loadavg()}{how}",
                                flush=True,
                            )
                            shutil.rmtree(out)
                    finally:
                        stop()
                        meter.close()
    print(
        f"\nTFTP: {args.clients} concurrent atftp fetches of ipxe.efi ({IPXE.stat().st_size} bytes), "
        f"loopback in a netns, {args.rounds} interleaved rounds; load average "
        f"{load0} at the start, {loadavg()} at the end"
    )
    for sc in scenarios:
        ref = statistics.median(w for w, _ in results.get((sc, "dnsmasq"), [(1.0, 0)]))
        cref = statistics.median(cpus.get((sc, "dnsmasq"), [1.0])) or 1.0
        rows = []
        for name in servers:
            runs = results[(sc, name)]
            med = statistics.median(w for w, _ in runs)
            rows.append(
                [
                    name,
                    f"{med:.2f}",
                    f"{min(w for w, _ in runs):.2f}",
                    sum(b for _, b in runs),
                    f"{med / ref:.2f}",
                    f"{statistics.median(cpus[(sc, name)]):.2f}",
                    f"{statistics.median(cpus[(sc, name)]) / cref:.2f}",
                ]
            )
        print(f"\n{sc}")
        print(
            table(
                [
                    "server",
                    "wall s (median)",
                    "wall s (best)",
                    "failed fetches (all rounds)",
                    "median time vs dnsmasq",
                    "server CPU s (median)",
                    "CPU vs dnsmasq",
                ],
                rows,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
