"""What Slurm's commands print about nodes and jobs, parsed. Pure: text in, facts out.

``scontrol show node -o NAME``: one line of ``Key=value`` fields; values may hold spaces
(``OS=Linux 6.1 #1 SMP``) and ``Reason=`` is the last field and may hold anything (it is
free text; Slurm appends ``[user@time]``). ``State=`` is the base state and its flags joined
by ``+`` (``MIXED+DRAIN+DYNAMIC_NORM``, ``IDLE+DYNAMIC_NORM+NOT_RESPONDING``).
"""

from __future__ import annotations

import re

from metald.health.scheduler import NodeState, NodeStatus

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_]*)=")
_STAMP = re.compile(r"\s*\[[^\]@]*@[^\]]*\]$")
#: ``scontrol show node`` of a node it does not know (exit status 1).
NOT_FOUND = re.compile(r"^Node \S+ not found", re.MULTILINE)
#: ``squeue -w`` of a node it does not know (exit status 1).
INVALID_NODE = re.compile(r"error: Invalid node name")


def parse_show_node(line: str) -> dict[str, str]:
    """The fields of one ``scontrol show node -o`` line."""
    text = line.strip()
    reason = None
    head, sep, tail = text.partition(" Reason=")
    if sep:
        text, reason = head, tail
    keys = list(_KEY.finditer(text))
    out = {}
    for i, m in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(text)
        out[m.group(1)] = text[m.end() : end].strip()
    if reason is not None:
        out["Reason"] = reason.strip()
    return out


def node_status(fields: dict[str, str]) -> NodeStatus:
    """A node's state: not responding first (a silent node is whatever else it was), then
    down, drain (draining while jobs remain), allocated, idle."""
    raw = fields.get("State", "")
    base, *flags = raw.split("+")
    base = base.rstrip("*~#!%$@^-")
    reason = fields.get("Reason")
    reason = _STAMP.sub("", reason) if reason else None
    busy = base in ("ALLOCATED", "MIXED", "COMPLETING") or "COMPLETING" in flags
    if "NOT_RESPONDING" in flags or raw.split("+")[0].endswith("*"):
        state = NodeState.NOT_RESPONDING
    elif base == "DOWN":
        state = NodeState.DOWN
    elif "DRAIN" in flags or base in ("DRAIN", "DRAINED", "DRAINING"):
        state = NodeState.DRAINING if busy or base == "DRAINING" else NodeState.DRAINED
    elif busy:
        state = NodeState.ALLOCATED
    elif base == "IDLE":
        state = NodeState.IDLE
    else:
        state = NodeState.UNKNOWN
    return NodeStatus(state, reason or None, raw)


def parse_jobs(text: str) -> list[str]:
    """``squeue -h -o %i`` (one job id per line)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def parse_reasons(text: str) -> dict[str, str]:
    """``sinfo -R -h -N -o %N|%E``: node -> reason."""
    out = {}
    for line in text.splitlines():
        node, sep, reason = line.partition("|")
        if sep and node.strip():
            out[node.strip()] = reason.strip()
    return out
