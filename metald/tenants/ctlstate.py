"""The Slurm controller's state of a tenant, kept in the store so it survives a hub's move.

slurmctld keeps everything it knows (dynamic nodes and their addresses, jobs and the job id
counter, reservations, partitions' state) in its ``StateSaveLocation``, a folder on the host
running the hub. When that host's instance dies, another instance brings the hub up: without
this module its slurmctld starts empty, the nodes are unknown to it, and ``srun`` fails until
each node joins again. So the instance running a hub keeps a **snapshot** of that folder in the
``tenant_ctl_state`` table (a gzip'd tar, encrypted with the secrets key: job scripts and their
environments are the tenant's and may hold its secrets), and the next owner restores it before
its slurmctld starts.

- **Fencing.** Bringing a hub up takes the row: ``generation = generation + 1`` and ``owner``
  = this instance, in one statement. Every save is ``UPDATE ... WHERE generation = <taken>``:
  an instance that lost the hub (judged dead, fenced, or handed it over) can no longer write,
  whatever its own view of the fleet says, so an old owner never overwrites the new one's state.
- **Restart in place.** The local folder is kept when the store says nobody took the hub since
  this state directory last held it (same owner, same generation as the marker beside the
  folder): it is at least as new as the snapshot. Otherwise the snapshot replaces it.
- **When.** At every runtime sync (``observe_interval_s``) when a file in the folder changed
  (name, size or mtime), and once more after slurmctld stopped cleanly (it saves on SIGTERM).
  Packing is held to about 5 % of one core (``SAVE_DUTY``): a large state is saved less often.
  What a move loses: what slurmctld wrote after the last snapshot (at most one interval, or
  20 times the last save's duration when that is longer).
- **Bounded.** A snapshot larger than ``MAX_SNAPSHOT_BYTES`` (after compression) is not
  written (the previous one stays) and is logged; slurmctld's state for a tenant is kilobytes
  to a few megabytes (job scripts of pending batch jobs are the bulk).
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlmodel import Session

from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import TenantCtlState, utcnow

log = logging.getLogger("metald.tenants")

MAX_SNAPSHOT_BYTES = 32 << 20
#: Not even packed above this (files' sizes summed): packing runs every interval it changed.
MAX_STATE_BYTES = 8 * MAX_SNAPSHOT_BYTES
#: After a save that took t seconds, the next waits SAVE_DUTY * t (packing is at most ~5 % of
#: one core, whatever the tenant's jobs do to the folder).
SAVE_DUTY = 20
MARKER = ".metald-ctlstate"


class Superseded(Exception):
    """Another instance took the tenant's controller state (it runs the hub now)."""


@dataclass
class Taken:
    generation: int
    restored: bool
    size: int


def fingerprint(folder: Path) -> tuple[str, int]:
    """What changed in a folder, cheaply: every file's path, size and mtime; and the files'
    total size."""
    h = hashlib.sha256()
    total = 0
    if folder.is_dir():
        for p in sorted(folder.rglob("*")):
            if p.is_file() and not p.is_symlink() and p.name != MARKER:
                st = p.stat()
                total += st.st_size
                h.update(f"{p.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest(), total


def pack(folder: Path) -> bytes:
    """The folder as a gzip'd tar (regular files and folders only; the marker left out)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for p in sorted(folder.rglob("*")):
            if p.name == MARKER or not (p.is_file() or p.is_dir()) or p.is_symlink():
                continue
            tar.add(p, arcname=str(p.relative_to(folder)), recursive=False)
    return buf.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    """Replace ``folder``'s contents with the snapshot (written beside it, then swapped)."""
    tmp = folder.with_name(folder.name + ".restore")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700, parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        # Only files and folders, inside ``tmp`` (the "data" filter refuses links, devices,
        # absolute names and ``..``): the snapshot came from the store, not from a tenant, but
        # nothing in it may write outside the folder.
        tar.extractall(tmp, filter="data")
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def files(data: bytes) -> dict[str, bytes]:
    """A snapshot's files by relative path (tests and diagnostics)."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                f = tar.extractfile(m)
                assert f is not None
                out[m.name] = f.read()
    return out


def read(session: Session, box: SecretBox, tenant_id: str) -> bytes | None:
    """The tenant's stored snapshot (gzip'd tar), or None."""
    row = session.get(TenantCtlState, tenant_id)
    if row is None or row.data_enc is None:
        return None
    return base64.b64decode(box.decrypt(row.data_enc))


def _marker(folder: Path) -> tuple[str, int] | None:
    try:
        owner, gen = (folder.parent / MARKER).read_text().split()
        return owner, int(gen)
    except (OSError, ValueError):
        return None


def take(store: Store, box: SecretBox, tenant_id: str, instance: str, folder: Path) -> Taken:
    """Become the writer of the tenant's controller state and put the state slurmctld should
    start from in ``folder`` (before it starts). Returns the generation saves are fenced by."""
    with store.session() as s:
        row = s.get(TenantCtlState, tenant_id)
        if row is None:
            s.add(TenantCtlState(tenant_id=tenant_id, owner=instance, generation=0))
            s.commit()
            row = s.get(TenantCtlState, tenant_id)
        assert row is not None
        before = (row.owner, row.generation)
        has_data = row.data_enc is not None
        # One statement: of two instances bringing the hub up at once, each gets its own
        # generation and only the later one can save.
        gen = s.execute(
            text(
                "UPDATE tenant_ctl_state SET generation = generation + 1, owner = :me "
                "WHERE tenant_id = :t RETURNING generation"
            ),
            {"me": instance, "t": tenant_id},
        ).scalar_one()
        s.commit()
    restored, size = False, 0
    if has_data and _marker(folder) != before:
        with store.session() as s:
            data = read(s, box, tenant_id)
        if data is not None:
            unpack(data, folder)
            restored, size = True, len(data)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    (folder.parent / MARKER).write_text(f"{instance} {gen}\n")
    return Taken(gen, restored, size)


def _too_large(tenant_id: str, what: str, size: int, limit: int) -> int:
    log.error(
        "tenant %s: controller state is %d bytes %s, over the %d-byte limit: not saved "
        "(the previous snapshot stays; a move would lose what changed since)",
        tenant_id,
        size,
        what,
        limit,
    )
    return 0


def save(
    store: Store, box: SecretBox, tenant_id: str, instance: str, generation: int, folder: Path
) -> int:
    """Write the folder's snapshot if this instance still holds ``generation``; returns its
    size, or 0 when it was too large (not written). Raises ``Superseded`` otherwise."""
    _fp, total = fingerprint(folder)
    if total > MAX_STATE_BYTES:
        return _too_large(tenant_id, "unpacked", total, MAX_STATE_BYTES)
    data = pack(folder)
    if len(data) > MAX_SNAPSHOT_BYTES:
        return _too_large(tenant_id, "packed", len(data), MAX_SNAPSHOT_BYTES)
    enc = box.encrypt(base64.b64encode(data))
    with store.session() as s:
        n = s.execute(
            text(
                "UPDATE tenant_ctl_state SET data_enc = :d, size = :n, saved_at = :at "
                "WHERE tenant_id = :t AND owner = :me AND generation = :g"
            ),
            {"d": enc, "n": len(data), "at": utcnow(), "t": tenant_id, "me": instance,
             "g": generation},
        ).rowcount  # fmt: skip
        s.commit()
    if n != 1:
        raise Superseded(f"tenant {tenant_id}: controller state taken by another instance")
    return len(data)


class Keeper:
    """One running control plane's snapshots: taken at start, saved when the folder changes."""

    def __init__(
        self, store: Store, box: SecretBox, tenant_id: str, instance: str, folder: Path
    ) -> None:
        self.store, self.box = store, box
        self.tenant_id, self.instance, self.folder = tenant_id, instance, folder
        self.generation: int | None = None
        self._saved: tuple[str, int] | None = None
        self._next_at = 0.0

    def take(self) -> Taken:
        got = take(self.store, self.box, self.tenant_id, self.instance, self.folder)
        self.generation = got.generation
        # What was restored is what the store holds: no need to save it again.
        self._saved = fingerprint(self.folder) if got.restored else None
        return got

    def save_if_changed(self, *, final: bool = False) -> bool:
        """Save when the folder changed. A tenant's jobs change it as often as they like: the
        time spent packing is held to ``1 / SAVE_DUTY`` of the time (a large state is saved
        less often), except for the ``final`` save after slurmctld stopped."""
        if self.generation is None or (not final and time.monotonic() < self._next_at):
            return False
        now = fingerprint(self.folder)
        if now == self._saved:
            return False
        started = time.monotonic()
        # Written, or too large (logged): either way not packed again until it changes.
        save(self.store, self.box, self.tenant_id, self.instance, self.generation, self.folder)
        self._saved = now
        self._next_at = time.monotonic() + SAVE_DUTY * (time.monotonic() - started)
        return True
