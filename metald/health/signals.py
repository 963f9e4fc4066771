"""Health signals: one observation of a machine in use, with its evidence and its witness.

A signal says what was seen (``kind`` and ``code``, optionally a number), on which part
(``subject``: a GPU's PCI address, a sensor, a disk, an InfiniBand port, the node), by whom
(``witness``) and the raw text that shows it (``evidence``: the SEL record, the XID line, the
nvidia-smi field). The witness is set by the code path that receives the observation, never
read from the payload: a node report is ``NODE`` whatever it claims to be.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

#: Evidence kept per signal (a hostile BMC or node cannot make a record unbounded).
MAX_EVIDENCE = 500


class Witness(StrEnum):
    #: The machine's BMC (event log, Redfish events, sensors): the witness a tenant cannot forge.
    BMC = "bmc"
    #: metald's own observation (a node that stopped reporting, a read that timed out).
    METALD = "metald"
    #: The tenant's scheduler, run by metald beside the tenant's cluster.
    SCHEDULER = "scheduler"
    #: The node agent inside the machine: the tenant has root there.
    NODE = "node"


class Kind(StrEnum):
    SEL = "sel"  # an IPMI system event log record
    REDFISH_LOG = "redfish-log"  # a Redfish LogService entry or pushed event
    SENSOR = "sensor"  # a sensor past a threshold (code "<kind>:<health>")
    XID = "xid"  # a kernel NVRM Xid line (code: the XID number)
    GPU_ECC = "gpu-ecc"  # nvidia-smi ECC counters (code: which counter)
    GPU_PAGES = "gpu-pages"  # retired pages / remapped rows (code: pending or failure)
    GPU_THROTTLE = "gpu-throttle"  # an active clocks slowdown reason (code: the reason)
    GPU_COUNT = "gpu-count"  # GPUs the driver sees against the inventory (code: missing)
    NVLINK = "nvlink"  # an NVLink link's state (code: inactive)
    DCGM_HEALTH = "dcgm-health"  # dcgmi health's verdict (code: warning or failure)
    SMART = "smart"  # a disk's SMART health (code: failed, critical-warning, media-errors)
    IB_PORT = "ib-port"  # an InfiniBand port's state (code: the state)
    SILENCE = "silence"  # no node report for a while (value: seconds)
    SCHEDULER_STATE = "scheduler-state"  # the tenant's scheduler's node state (code: state)
    TIMEOUT = "timeout"  # one read that did not answer in time


#: The code a witness uses to say a part is fine now (a clear; see ``metald.health.trust``).
OK = "ok"


@dataclass(frozen=True)
class Signal:
    kind: Kind
    witness: Witness
    #: The part: a GPU's PCI address, a sensor or disk name, ``mlx5_0/1``, or ``node``.
    subject: str
    #: What the classification table matches (an XID number, a counter name, a state).
    code: str
    at: datetime
    #: The raw text that shows it, bounded to MAX_EVIDENCE characters.
    evidence: str = ""
    #: A number where the code has one (a count, a rate per hour, seconds of silence).
    value: float | None = None

    def __post_init__(self) -> None:
        if len(self.evidence) > MAX_EVIDENCE:
            object.__setattr__(self, "evidence", self.evidence[: MAX_EVIDENCE - 3] + "...")

    @property
    def is_clear(self) -> bool:
        return self.code == OK
