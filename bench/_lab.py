"""Shared bench plumbing: namespaces and process helpers (from the lab), table printing."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vmlab.lab import REPO_ROOT as ROOT
from vmlab.labnet import HTTP_BOOT, BootProcess, Netns, namespaces, sh, veth, write_config

__all__ = [
    "ROOT",
    "BootProcess",
    "Netns",
    "namespaces",
    "set_loop",
    "start_http_metald",
    "tree_cpu_seconds",
    "tree_cpu_times",
    "sh",
    "veth",
    "write_config",
    "add_tree_option",
    "trees_of",
    "table",
]


def start_http_metald(
    lab: Netns, tmp: Path, n: int, server: str, root: Path
) -> tuple[BootProcess, int]:
    """The ``n``-th metald of a bench (``server``: metald, metald-asyncio or metald-uvloop)
    serving ``root`` over HTTP in ``lab``; returns it started and its HTTP port."""
    port = 8090 + n
    cfg = write_config(
        tmp / f"m{n}.toml",
        state_dir=tmp / f"st{n}",
        boot=HTTP_BOOT.format(root=root, tftp_port=6969 + n),
        listen=f"127.0.0.1:{port}",
    )
    set_loop(server)
    # No access log, as nginx in these benches (access_log off) and the daemon's listeners.
    return BootProcess(lab, cfg, tmp / f"metald{n}.log", access_log=False).start(), port


def set_loop(server: str) -> None:
    """``metald`` runs on its configured (default) event loop; ``metald-asyncio`` and
    ``metald-uvloop`` choose one (METALD_EVENT_LOOP, inherited by the metald process the
    bench starts next)."""
    _, _, loop = server.partition("-")
    if loop:
        os.environ["METALD_EVENT_LOOP"] = loop
    else:
        os.environ.pop("METALD_EVENT_LOOP", None)


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its descendants (nginx's workers), from /proc: a
    cost figure that load on a shared box distorts far less than wall time."""
    return sum(tree_cpu_times(pid))


def tree_cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its descendants, from /proc."""
    user = system = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        # utime, stime, and cutime, cstime: children already reaped (tftpd-hpa forks per
        # transfer) are no longer in the tree, so nothing counts twice.
        tck = os.sysconf("SC_CLK_TCK")
        user += (int(f[11]) + int(f[13])) / tck
        system += (int(f[12]) + int(f[14])) / tck
    return user, system


def add_tree_option(ap: argparse.ArgumentParser) -> None:
    """``--tree NAME=PATH``: another source tree's metald as server NAME, in the same run."""
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run the metald of another source tree (e.g. git archive of an older "
        "commit) as server NAME; repeatable",
    )


def trees_of(args: argparse.Namespace) -> dict[str, Path]:
    """The ``--tree`` options: server name -> its source tree."""
    return {k: Path(v).resolve() for k, _, v in (t.partition("=") for t in args.tree)}
