"""HTTP boot benchmark: 100 concurrent downloads of kernel plus initrd, metald vs nginx.

    sudo .venv/bin/python bench/http_bench.py [--clients 100] [--kernel-mb 8] [--initrd-mb 32]

Both servers run in one network namespace on its loopback and serve the same folder: metald's
``/boot/assets/`` route (aiohttp FileResponse, sendfile) and nginx (sendfile on, 2 workers =
the box's cores). Each client is one curl fetching the kernel then the initrd, as iPXE does;
the files are random bytes of Debian-like sizes (the stock initrd is ~31 MB). Wall time from
the first start to the last exit; a failure is a non-200 or a short body.

Server CPU is utime + stime of the server and its children (from /proc), split into user and
system. **Client CPU** (the curls', from the bench's own child rusage) is printed beside it:
on loopback the kernel's TCP work for a segment runs in whichever process's context pushes
it (the sender's sendfile, or the receiver's ACK when it frees room in the send queue), so a
server can move system time onto its clients without saving any; server + client CPU is the
whole cost of a round. ``metald-loopsend`` is this tree's metald with every transfer on the
event loop (``boot.http_sendfile_threads = 0``), ``metald-threadsN`` with N sendfile threads;
the load average is printed per round.
``--tree NAME=PATH`` adds a server NAME: the metald of another source tree (``git archive`` of
an older commit), run the same way, for before/after figures in one interleaved run.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _lab import add_tree_option, namespaces, start_http_metald, table, tree_cpu_times, trees_of

from vmlab import labnet

DRIVER = r"""
import asyncio, sys, time
n, k_url, i_url, k_size, i_size = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
async def one():
    p = await asyncio.create_subprocess_exec(
        "curl", "-s", "-w", "%{http_code} %{size_download}\n", "-o", "/dev/null", k_url,
        "-o", "/dev/null", i_url, stdout=asyncio.subprocess.PIPE)
    out, _ = await p.communicate()
    lines = out.decode().split()
    return p.returncode == 0 and lines == ["200", str(k_size), "200", str(i_size)]
async def main():
    t0 = time.perf_counter()
    oks = await asyncio.gather(*[one() for _ in range(n)])
    print(f"{time.perf_counter() - t0:.3f} {oks.count(False)}")
asyncio.run(main())
"""

NGINX = """
daemon off;
worker_processes 2;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:8081;
        location /boot/assets/ {{ alias {root}/; }}
    }}
}}
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--kernel-mb", type=int, default=8)
    ap.add_argument("--initrd-mb", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--servers",
        default="metald,nginx",
        help="metald (its default loop), metald-asyncio, metald-uvloop, metald-loopsend "
        "(no sendfile threads), metald-threadsN (N sendfile threads), nginx",
    )
    add_tree_option(ap)
    args = ap.parse_args()
    trees = trees_of(args)
    names = args.servers.split(",") + list(trees)
    if shutil.which("nginx") is None:
        print("nginx is not installed (Debian package nginx-light)", file=sys.stderr)
        return 2
    res: dict[str, list[tuple[float, int]]] = {n: [] for n in names}
    cpus: dict[str, list[float]] = {}
    splits: dict[str, list[tuple[float, float]]] = {}
    clients: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        root = tmp / "assets"
        root.mkdir()
        k, i = root / "vmlinuz", root / "initrd.img"
        k.write_bytes(os.urandom(args.kernel_mb << 20))
        i.write_bytes(os.urandom(args.initrd_mb << 20))
        (tmp / "nginx.conf").write_text(NGINX.format(tmp=tmp, root=root))
        # nginx workers run as www-data: they must reach and read the files.
        for p in (tmp, root):
            p.chmod(0o755)
        for f in (k, i):
            f.chmod(0o644)
        with namespaces("http") as ns:
            lab = ns["http"]
            ports = {"nginx": 8081}
            procs = []
            pids: dict[str, int] = {}
            for n, name in enumerate(x for x in names if x.startswith("metald") or x in trees):
                os.environ.pop("METALD_BOOT__HTTP_SENDFILE_THREADS", None)
                if name == "metald-loopsend":
                    os.environ["METALD_BOOT__HTTP_SENDFILE_THREADS"] = "0"
                elif name.startswith("metald-threads"):
                    os.environ["METALD_BOOT__HTTP_SENDFILE_THREADS"] = name.removeprefix(
                        "metald-threads"
                    )
                # `python -m metald.boot` imports metald from its working directory: another
                # tree runs from there.
                repo = labnet.REPO_ROOT
                if name in trees:
                    labnet.REPO_ROOT = trees[name]
                try:
                    bp, ports[name] = start_http_metald(
                        lab,
                        tmp,
                        n,
                        "metald"
                        if name == "metald-loopsend"
                        or name.startswith("metald-threads")
                        or name in trees
                        else name,
                        root,
                    )
                finally:
                    labnet.REPO_ROOT = repo
                    os.environ.pop("METALD_BOOT__HTTP_SENDFILE_THREADS", None)
                procs.append(bp)
                pids[name] = bp.proc.pid  # type: ignore[union-attr]
            ng = lab.popen(
                "nginx",
                "-c",
                str(tmp / "nginx.conf"),
                "-e",
                str(tmp / "nginx-error.log"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            pids["nginx"] = ng.pid
            time.sleep(1.0)
            try:
                for rnd in range(args.rounds):
                    for name in names:
                        port = ports[name]
                        cpu0 = tree_cpu_times(pids[name])
                        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                        base = f"http://127.0.0.1:{port}/boot/assets"
                        r = lab.run(
                            sys.executable,
                            "-c",
                            DRIVER,
                            str(args.clients),
                            f"{base}/vmlinuz",
                            f"{base}/initrd.img",
                            str(k.stat().st_size),
                            str(i.stat().st_size),
                            timeout=600,
                        )
                        cpu1 = tree_cpu_times(pids[name])
                        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                        user, sys_ = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
                        cpu = user + sys_
                        # The driver and its curls, reaped by the time lab.run returns.
                        cli = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
                        wall, bad = r.stdout.split()
                        res[name].append((float(wall), int(bad)))
                        cpus.setdefault(name, []).append(cpu)
                        splits.setdefault(name, []).append((user, sys_))
                        clients.setdefault(name, []).append(cli)
                        load = " ".join(f"{x:.1f}" for x in os.getloadavg())
                        print(
                            f"round {rnd} {name}: {wall} s, server CPU {cpu:.2f} s (user "
                            f"{user:.2f}, sys {sys_:.2f}), client CPU {cli:.2f} s, {bad} failed, "
                            f"load {load}",
                            flush=True,
                        )
            finally:
                ng.terminate()
                ng.wait(10)
                for bp in procs:
                    bp.stop()
    total_mb = args.clients * (args.kernel_mb + args.initrd_mb)
    ref = statistics.median(w for w, _ in res["nginx"]) if res.get("nginx") else 1.0
    cref = statistics.median(cpus["nginx"]) if cpus.get("nginx") else 1.0
    rows = []
    for name in names:
        med = statistics.median(w for w, _ in res[name])
        rows.append(
            [
                name,
                f"{med:.2f}",
                f"{min(w for w, _ in res[name]):.2f}",
                f"{total_mb / med:.0f}",
                sum(b for _, b in res[name]),
                f"{med / ref:.2f}",
                f"{statistics.median(cpus[name]):.2f}",
                f"{statistics.median(cpus[name]) / cref:.2f}" if cref else "-",
                f"{statistics.median(u for u, _ in splits[name]):.2f}/"
                f"{statistics.median(s for _, s in splits[name]):.2f}",
                f"{statistics.median(clients[name]):.2f}",
                f"{statistics.median(c + k for c, k in zip(cpus[name], clients[name], strict=True)):.2f}",
            ]
        )
    print(
        f"\nHTTP: {args.clients} concurrent clients x (kernel {args.kernel_mb} MiB + initrd "
        f"{args.initrd_mb} MiB), loopback in a netns, {args.rounds} interleaved rounds"
    )
    headers = ["server", "wall s (median)", "wall s (best)", "MiB/s (median)"]
    headers += ["failed (all rounds)", "median time vs nginx", "server CPU s (median)"]
    headers += ["CPU vs nginx", "server user/sys s", "client CPU s", "server + client CPU s"]
    print(table(headers, rows))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
