"""TFTP benchmark: 200 concurrent fetches of ipxe.efi, metald vs tftpd-hpa vs dnsmasq.

    sudo .venv/bin/python bench/tftp_bench.py [--clients 200]

Everything runs inside one network namespace on its loopback (nothing leaves it). Clients are
atftp processes started together; two option sets: what iPXE asks (blksize 1428 + tsize) and
what EDK2 asks (blksize 1468 + windowsize 4; tftpd-hpa ignores windowsize). Wall time from the
first start to the last exit; a failure is a non-zero exit or a file that differs.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _lab import namespaces, set_loop, table, tree_cpu_seconds, write_config

IPXE = Path("/usr/lib/ipxe/ipxe.efi")

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
    args = ap.parse_args()
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
            for name in args.servers.split(","):
                with namespaces("tftp") as ns:
                    lab = ns["tftp"]
                    if name.startswith("metald"):
                        from _lab import BootProcess

                        set_loop(name)

                        cfg = write_config(
                            Path(tmp) / "m.toml",
                            state_dir=Path(tmp) / f"st{rnd}",
                            boot=BOOT.format(assets=root),
                            listen="127.0.0.1:8080",
                        )
                        bp = BootProcess(lab, cfg, Path(tmp) / "metald.log").start()
                        stop = bp.stop
                        pid = bp.proc.pid  # type: ignore[union-attr]
                    else:
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
                        pid = proc.pid
                        time.sleep(0.5)

                        def stop(proc=proc) -> None:  # type: ignore[no-untyped-def]
                            proc.terminate()
                            proc.wait(10)

                    try:
                        for sc, opts in scenarios.items():
                            out = Path(tmp) / f"out-{name}-{rnd}-{len(opts[0])}"
                            out.mkdir()
                            cpu0 = tree_cpu_seconds(pid)
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
                            cpu = tree_cpu_seconds(pid) - cpu0
                            wall, bad = r.stdout.split()
                            results.setdefault((sc, name), []).append((float(wall), int(bad)))
                            cpus.setdefault((sc, name), []).append(cpu)
                            print(
                                f"round {rnd} {name:14} {sc}: {wall} s, server CPU {cpu:.2f} s, "
                                f"{bad} failed",
                                flush=True,
                            )
                            shutil.rmtree(out)
                    finally:
                        stop()
    print(
        f"\nTFTP: {args.clients} concurrent atftp fetches of ipxe.efi ({IPXE.stat().st_size} bytes), "
        f"loopback in a netns, {args.rounds} interleaved rounds"
    )
    for sc in scenarios:
        ref = statistics.median(w for w, _ in results.get((sc, "dnsmasq"), [(1.0, 0)]))
        cref = statistics.median(cpus.get((sc, "dnsmasq"), [1.0])) or 1.0
        rows = []
        for name in args.servers.split(","):
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
