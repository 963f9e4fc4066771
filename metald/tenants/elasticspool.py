"""How slurmctld's ResumeProgram / SuspendProgram reach metald: a spool folder.

The programs run inside the tenant's control plane (the hub's network namespace, private
mounts); they write one request file each, atomically (write a dot-file, rename), into
``<control plane workdir>/elastic/spool``, and exit. metald reads and removes the requests.

Why a spool, not an HTTP call with a per-pool token: the control plane's network namespace is
the tenant's overlay, where the tenant's nodes (root for the tenant) live; it has no route to
metald's API, and giving it one would put the API on the tenant's network. A folder on this
host's disk needs no network path and no secret: the workdir is 0700 root on metald's host,
which tenant nodes (other machines) cannot reach at all, and only slurmctld's own programs run
in the control plane's mounts. A tenant's users can still make slurmctld resume nodes by
queueing jobs, which is the point; what they can ask for is bounded by the pool (names outside
it are refused) and its max.

The file: ``<op>\\n<hostlist>\\n`` with op one of resume, suspend, resume-fail.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from metald.tenants.elastic import HostlistError, Programs, expand_hostlist

OPS = ("resume", "suspend", "resume-fail")
#: A request larger than this is not one slurmctld wrote.
MAX_REQUEST_BYTES = 64 * 1024

PROGRAM = """#!/bin/sh
# Written by metald: hands slurmctld's {op} request for "$1" to metald through its spool.
set -eu
d='{spool}'
t="$d/.$$.$(date +%s%N).tmp"
printf '%s\\n%s\\n' '{op}' "$1" > "$t"
mv "$t" "$d/$(date +%s%N)-$$.req"
"""


class RequestError(ValueError):
    pass


@dataclass(frozen=True)
class Request:
    op: str
    names: list[str]
    file: str = ""


def render_program(op: str, spool: Path) -> str:
    if op not in OPS or "'" in str(spool):
        raise ValueError(f"cannot write a program for {op!r} into {spool}")
    return PROGRAM.format(op=op, spool=spool)


def parse_request(text: str, *, file: str = "") -> Request:
    lines = text.splitlines()
    if len(lines) != 2 or lines[0] not in OPS:
        raise RequestError(f"request {file or text[:40]!r} is not '<op>\\n<hostlist>'")
    try:
        names = expand_hostlist(lines[1])
    except HostlistError as e:
        raise RequestError(f"request {file!r}: {e}") from e
    return Request(op=lines[0], names=names, file=file)


def install(workdir: Path) -> Programs:
    """Create the spool and write the three programs; their paths for ``slurm.conf``."""
    base = workdir / "elastic"
    spool = base / "spool"
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {}
    for op in OPS:
        p = base / f"{op}.sh"
        tmp = base / f".{op}.sh.tmp"
        tmp.write_text(render_program(op, spool))
        tmp.chmod(0o700)
        tmp.replace(p)
        paths[op] = str(p)
    return Programs(
        resume=paths["resume"], suspend=paths["suspend"], resume_fail=paths["resume-fail"]
    )


def spool_dir(workdir: Path) -> Path:
    return workdir / "elastic" / "spool"


def pending(workdir: Path) -> list[Path]:
    """Finished requests, oldest first (dot-files are being written)."""
    try:
        return sorted(p for p in spool_dir(workdir).glob("*.req") if not p.name.startswith("."))
    except OSError:
        return []


def read(path: Path) -> Request:
    with path.open("rb") as f:
        data = f.read(MAX_REQUEST_BYTES + 1)
    if len(data) > MAX_REQUEST_BYTES:
        raise RequestError(f"request {path.name} is larger than {MAX_REQUEST_BYTES} bytes")
    return parse_request(data.decode("utf-8", "replace"), file=path.name)


def done(path: Path) -> None:
    """Remove a request once acted on (acting is idempotent: a crash before this repeats it)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
