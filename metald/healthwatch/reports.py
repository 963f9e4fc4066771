"""The node agent's health report, accepted: authenticated by the node token (the mesh's),
rate-limited through the machine's heartbeat row (so every instance sees the same limit),
parsed by ``metald.health.node`` with the machine's inventory, classified, and folded into
its faults with the witness ``node`` whatever the body says.

Most reports of a healthy node say what the last one said. The nvidia-smi part, the costly one
to read, changes every time in fields no signal reads (the timestamp, temperatures, clocks,
power, utilization): with those left out, its digest is kept on the heartbeat row when a report
was read in full and found nothing (``NodeHeartbeat.digests``). A report whose digest is the
same, whose other parts (cheap to read) find nothing either, and that comes in time is
recorded by one compare-and-swap of the heartbeat row, not parsed again (``quick``); any other
report is read in full. The trust rule holds either way: a report never clears anything, and
what the quick path skips is only what a report read in full found clean.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam
from sqlalchemy import select as sa_select
from sqlmodel import Session, col

from metald.errors import Forbidden
from metald.health.classify import Severity, Table
from metald.health.config import HealthConfig
from metald.health.node import MAX_SIGNALS, NodeReport, carry_ecc, report_signals
from metald.health.signals import Kind
from metald.healthwatch import faults
from metald.healthwatch.workflow import open_for
from metald.lifecycle import IN_USE, State
from metald.limits import TooMany
from metald.store.models import Machine, NodeHeartbeat, WgPeer, as_utc
from metald.tenants import mesh

#: ``nvidia-smi -q -x`` elements that change between two reports of a healthy GPU and that no
#: signal reads (``metald.health.node``): left out of the digest.
VOLATILE = (
    "timestamp", "fan_speed", "performance_state", "fb_memory_usage", "bar1_memory_usage",
    "cc_protected_memory_usage", "utilization", "encoder_stats", "fbc_stats", "temperature",
    "gpu_power_readings", "power_readings", "module_power_readings", "clocks", "voltage",
    "processes", "accounted_processes", "mig_devices", "tx_util", "rx_util", "pcie_gen",
    "replay_counter", "replay_rollover_counter", "supported_clocks",
)  # fmt: skip
_NAMES = "|".join(VOLATILE)
# An element from its start tag to its own end tag, stopping at any other VOLATILE start tag:
# a scan never passes one, so a document of unclosed tags costs linear time, not quadratic.
_VOLATILE = re.compile("<(" + _NAMES + r")>[^<]*(?:<(?!/\1>|(?:" + _NAMES + r")>)[^<]*)*</\1>")
_GPU_KINDS = frozenset({Kind.GPU_ECC, Kind.GPU_PAGES, Kind.GPU_THROTTLE, Kind.GPU_COUNT})


def gpu_digest(xml: str | None, gpu_count: int | None, table: Table) -> str | None:
    """The digest of what a report's nvidia-smi part says to the health signals: the text less
    the ``VOLATILE`` elements, with the inventory's GPU count and the table's version (a changed
    table reads every report again). None for a text that is not plain nvidia-smi output
    (comments, CDATA, processing instructions past the declaration): such a text is always read
    in full."""
    h = hashlib.blake2b(f"{table.version}\0{gpu_count}\0".encode(), digest_size=20)
    if xml is None:
        h.update(b"none")
    elif "<!--" in xml or "<![CDATA[" in xml or xml.find("<?", 1) != -1:
        return None
    else:
        h.update(_VOLATILE.sub("", xml).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Accepted:
    machine_id: str
    interval_s: int
    signals: int
    new_faults: int
    unreadable: list[str]
    #: A remediation was opened (the watch should look now).
    remediation: bool = False
    #: What the next report is compared with, when this one was clean (else None).
    seen: Seen | None = None


@dataclass
class Seen:
    """A node whose last report was clean, as ``ReportMemo`` keeps it."""

    machine_id: str
    claim_id: str | None
    gpu: str
    signals: int
    last_at: datetime
    #: The inventory's GPU count (part of the digest).
    gpus: int | None = None
    #: Reports taken in memory since the heartbeat row was last written.
    pending: int = 0


def accept(
    s: Session,
    secret: str,
    body: dict[str, Any],
    *,
    cfg: HealthConfig,
    table: Table,
    now: datetime,
    actor: str,
    instance: str | None,
) -> Accepted:
    """Record one node report (committed). 401 for an unknown token, 403 for a machine not in
    use, 429 (Retry-After) for a report sooner than ``report_min_interval_s``."""
    fast = quick(s, secret, body, cfg=cfg, table=table, now=now)
    if fast is not None:
        return fast
    s.rollback()
    peer = mesh.node_by_token(s, secret)
    m = s.get(Machine, peer.machine_id)
    if m is None or m.tenant_id != peer.tenant_id or State(m.state) not in IN_USE:
        raise Forbidden(
            "this machine is not in use by a tenant any more, so metald takes no health report "
            "from it; stop the report loop"
        )
    hb = s.get(NodeHeartbeat, m.id, with_for_update=True)
    if hb is not None:
        wait = cfg.report_min_interval_s - (now - as_utc(hb.last_at)).total_seconds()
        if wait > 0:
            raise TooMany(
                f"this node reported {cfg.report_min_interval_s - wait:.1f} s ago; report at "
                f"most every {cfg.report_min_interval_s:g} s (send the next after Retry-After)",
                retry_after_s=max(1, math.ceil(wait)),
            )
    report = NodeReport(
        at=now,
        kernel_log=body.get("kernel_log") or "",
        nvidia_smi_xml=body.get("nvidia_smi_xml"),
        nvlink=body.get("nvlink"),
        smart=body.get("smart"),
        ib_ports=body.get("ib_ports"),
        dcgm_health=body.get("dcgm_health"),
    )
    got = report_signals(report, gpu_count=m.gpu_count or None)
    # A storm of correctable ECC is a rate over this report's counts and the earlier ones'.
    storms, ecc_kept = carry_ecc(hb.ecc_readings if hb is not None else None, got.signals,
                                 now=now, window_s=cfg.ecc_window_s)  # fmt: skip
    classified = [table.classify(sig) for sig in [*got.signals, *storms]]
    new_faults, opened = 0, None
    # Nothing the node says can clear a fault (the trust rule): a report without a finding
    # changes no fault, so the faults are not even read.
    if any(c.severity != Severity.OK for c in classified):
        rec = faults.record(s, m, classified, now=now, transient_ttl_s=cfg.transient_ttl_s,
                            actor=actor, instance=instance)  # fmt: skip
        new_faults = len(rec.new)
        opened = open_for(s, m, rec.health, cfg, actor=actor, instance=instance)
    if hb is None:
        hb = NodeHeartbeat(machine_id=m.id, last_at=now, reports=0)
    hb.last_at, hb.reports, hb.unreadable = now, hb.reports + 1, got.unreadable[:10]
    hb.claim_id = m.claim_id
    hb.ecc_readings = ecc_kept
    clean = not got.unreadable and all(c.severity == Severity.OK for c in classified)
    digest = gpu_digest(report.nvidia_smi_xml, m.gpu_count or None, table) if clean else None
    hb.digests = None
    if digest is not None:
        n_gpu = sum(1 for x in got.signals if x.kind in _GPU_KINDS)
        hb.digests = {"gpu": digest, "signals": n_gpu}
    s.add(hb)
    s.commit()
    seen = None
    if hb.digests is not None:
        seen = Seen(m.id, m.claim_id, hb.digests["gpu"], hb.digests["signals"], now,
                    m.gpu_count or None)  # fmt: skip
    return Accepted(
        m.id,
        cfg.report_interval_s,
        len(got.signals),
        new_faults,
        got.unreadable,
        opened is not None,
        seen,
    )


_HB = NodeHeartbeat.__table__  # type: ignore[attr-defined]
# Built once: a report's quick path is two statements, no ORM unit of work.
_LAST = (
    sa_select(
        col(Machine.id),
        col(Machine.tenant_id),
        col(WgPeer.tenant_id),
        col(Machine.state),
        col(Machine.claim_id),
        col(Machine.gpu_count),
        col(NodeHeartbeat.claim_id),
        col(NodeHeartbeat.last_at),
        col(NodeHeartbeat.reports),
        col(NodeHeartbeat.digests),
    )
    .join(Machine, col(Machine.id) == col(WgPeer.machine_id))
    .join(NodeHeartbeat, col(NodeHeartbeat.machine_id) == col(Machine.id))
    .where(col(WgPeer.node_token_hash) == bindparam("token_hash"))
)
_SEEN = (
    _HB.update()
    .where(_HB.c.machine_id == bindparam("mid"), _HB.c.reports == bindparam("was"))
    .values(last_at=bindparam("at"), reports=bindparam("now_n"), unreadable=bindparam("none"))
)


def quick(
    s: Session,
    secret: str,
    body: dict[str, Any],
    *,
    cfg: HealthConfig,
    table: Table,
    now: datetime,
) -> Accepted | None:
    """A report that says what the machine's last clean one said, recorded (committed) by one
    compare-and-swap of its heartbeat row; None for any other report (unknown token, machine
    not in use, too soon, anything changed or found, or another report of the node recorded
    meanwhile): the caller reads it in full, which also answers its errors."""
    if not secret.startswith(mesh.TOKEN_PREFIX):
        return None
    conn = s.connection()
    row = conn.execute(_LAST, {"token_hash": mesh.hash_token(secret)}).first()
    if row is None:
        return None
    mid, tenant, peer_tenant, state, claim, gpus, hb_claim, last_at, n, dig = row
    if tenant is None or tenant != peer_tenant or State(state) not in IN_USE:
        return None
    if not dig or hb_claim != claim:
        return None
    if (now - as_utc(last_at)).total_seconds() < cfg.report_min_interval_s:
        return None
    if dig.get("gpu") != gpu_digest(body.get("nvidia_smi_xml"), gpus or None, table):
        return None
    total = _rest_clean(body, now, table, int(dig.get("signals") or 0))
    if total is None:
        return None
    done = conn.execute(_SEEN, {"mid": mid, "was": n, "at": now, "now_n": n + 1, "none": []})
    if done.rowcount != 1:
        s.rollback()
        return None
    s.commit()
    return Accepted(mid, cfg.report_interval_s, total, 0, [], False,
                    Seen(mid, claim, dig["gpu"], int(dig.get("signals") or 0), now,
                         gpus or None))  # fmt: skip


def _rest_clean(body: dict[str, Any], now: datetime, table: Table, base: int) -> int | None:
    """The signals of a report's parts other than nvidia-smi's (cheap to read) added to
    ``base``, when none is a finding or unreadable; else None."""
    rest = report_signals(
        NodeReport(
            at=now,
            kernel_log=body.get("kernel_log") or "",
            nvlink=body.get("nvlink"),
            smart=body.get("smart"),
            ib_ports=body.get("ib_ports"),
            dcgm_health=body.get("dcgm_health"),
        ),
        gpu_count=None,
    )
    total = base + len(rest.signals)
    if rest.unreadable or total > MAX_SIGNALS:
        return None
    if any(table.classify(x).severity != Severity.OK for x in rest.signals):
        return None
    return total


class ReportMemo:
    """One instance's memory of the nodes whose last report was clean (by token hash), so that
    a report saying the same again costs no database call: its heartbeat is kept here and
    written with the others' at the next ``flush`` (the health watch's round, every
    ``watch_interval_s``, before it judges silence). ``validate`` (the same round) forgets
    every node whose token was revoked, machine left use or claim changed, so such a node's
    report goes the full path (and its 401 or 403) within one round. The limit on how often a
    node reports holds here too. A report that changed anything goes the database path, which
    tells what to remember."""

    def __init__(self) -> None:
        self.by_token: dict[str, Seen] = {}

    def forget(self, token_hash: str) -> None:
        self.by_token.pop(token_hash, None)

    def remember(self, token_hash: str, seen: Seen) -> None:
        old = self.by_token.get(token_hash)
        if old is not None and old.machine_id == seen.machine_id:
            seen.pending = old.pending  # still to be counted on the row
        self.by_token[token_hash] = seen

    def quick(
        self, token_hash: str, body: dict[str, Any], *, cfg: HealthConfig, table: Table,
        now: datetime,
    ) -> Accepted | None:  # fmt: skip
        """The report taken in memory, or None (the database path decides). 429 for a node
        reporting too soon."""
        seen = self.by_token.get(token_hash)
        if seen is None:
            return None
        wait = cfg.report_min_interval_s - (now - seen.last_at).total_seconds()
        if wait > 0:
            raise TooMany(
                f"this node reported {cfg.report_min_interval_s - wait:.1f} s ago; report at "
                f"most every {cfg.report_min_interval_s:g} s (send the next after Retry-After)",
                retry_after_s=max(1, math.ceil(wait)),
            )
        if seen.gpu != gpu_digest(body.get("nvidia_smi_xml"), seen.gpus, table):
            return None
        total = _rest_clean(body, now, table, seen.signals)
        if total is None:
            return None
        seen.last_at, seen.pending = now, seen.pending + 1
        return Accepted(seen.machine_id, cfg.report_interval_s, total, 0, [])

    def keep_valid(self, valid: dict[str, tuple[str, str | None, int | None]]) -> None:
        """Forget every node ``validate`` did not find as remembered."""
        for h, x in list(self.by_token.items()):
            if valid.get(h) != (x.machine_id, x.claim_id, x.gpus):
                del self.by_token[h]

    def take_due(self) -> list[tuple[str, str | None, datetime, int]]:
        """The heartbeats to write, (machine, claim, last report, reports), counted as
        written: a failed flush leaves the row one round behind, until the next report's."""
        out = []
        for x in self.by_token.values():
            if x.pending:
                out.append((x.machine_id, x.claim_id, x.last_at, x.pending))
                x.pending = 0
        return out


def validate(s: Session, token_hashes: list[str]) -> dict[str, tuple[str, str | None, int | None]]:
    """Of these node tokens, those still valid for a machine in use: hash -> (machine, claim,
    the inventory's GPU count)."""
    if not token_hashes:
        return {}
    rows = s.execute(
        sa_select(
            col(WgPeer.node_token_hash), col(Machine.id), col(Machine.claim_id),
            col(Machine.gpu_count), col(Machine.state), col(Machine.tenant_id),
            col(WgPeer.tenant_id),
        )
        .join(Machine, col(Machine.id) == col(WgPeer.machine_id))
        .where(col(WgPeer.node_token_hash).in_(token_hashes))
    ).all()  # fmt: skip
    return {
        r[0]: (r[1], r[2], r[3] or None)
        for r in rows
        if r[5] is not None and r[5] == r[6] and State(r[4]) in IN_USE
    }


_FLUSH = (
    _HB.update()
    .where(
        _HB.c.machine_id == bindparam("mid"),
        _HB.c.claim_id == bindparam("claim"),
        _HB.c.last_at < bindparam("at"),
    )
    .values(last_at=bindparam("at"), reports=_HB.c.reports + bindparam("k"))
)


def flush(s: Session, items: list[tuple[str, str | None, datetime, int]]) -> None:
    """The heartbeats taken in memory, (machine, claim, last report, reports), in one
    statement (committed). A row written since by a later report is left as it is."""
    if items:
        s.connection().execute(
            _FLUSH, [{"mid": m, "claim": c, "at": at, "k": k} for m, c, at, k in items]
        )
    s.commit()
