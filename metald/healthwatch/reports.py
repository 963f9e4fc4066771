"""The node agent's health report, accepted: authenticated by the node token (the mesh's),
rate-limited through the machine's heartbeat row (so every instance sees the same limit),
parsed by ``metald.health.node`` with the machine's inventory, classified, and folded into
its faults with the witness ``node`` whatever the body says."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlmodel import Session

from metald.errors import Forbidden
from metald.health.classify import Severity, Table
from metald.health.config import HealthConfig
from metald.health.node import NodeReport, report_signals
from metald.healthwatch import faults
from metald.healthwatch.workflow import open_for
from metald.lifecycle import IN_USE, State
from metald.limits import TooMany
from metald.store.models import Machine, NodeHeartbeat, as_utc
from metald.tenants import mesh


@dataclass(frozen=True)
class Accepted:
    machine_id: str
    interval_s: int
    signals: int
    new_faults: int
    unreadable: list[str]
    #: A remediation was opened (the watch should look now).
    remediation: bool = False


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
    )
    got = report_signals(report, gpu_count=m.gpu_count or None)
    classified = [table.classify(sig) for sig in got.signals]
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
    s.add(hb)
    s.commit()
    return Accepted(
        m.id,
        cfg.report_interval_s,
        len(got.signals),
        new_faults,
        got.unreadable,
        opened is not None,
    )
