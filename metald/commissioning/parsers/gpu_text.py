"""Text outputs of the GPU checks: XID lines in the kernel log, ``nvidia-smi nvlink -s``."""

from __future__ import annotations

import re
from typing import Any

from metald.commissioning.verdict import Verdict, judge

#: ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d+),?\s*(.*)")
#: XIDs that say the GPU or its memory is at fault (NVIDIA's XID catalogue), not the program:
#: 48 DBE, 63/64 row remapping, 74 NVLink, 79 fallen off the bus, 92 high SBE rate,
#: 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC.
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


def parse_xid(kernel_log: str) -> list[dict[str, Any]]:
    """Every XID line of a kernel log (dmesg or the journal's kernel lines): the GPU's PCI
    address, the XID number, the text after it (bounded) and the whole line (bounded)."""
    events = []
    for line in kernel_log.splitlines():
        m = _XID.search(line)
        if m:
            events.append(
                {
                    "pci": m.group(1),
                    "xid": int(m.group(2)),
                    "text": m.group(3)[:200],
                    "line": line.strip()[:400],
                }
            )
    return events


def judge_xid(kernel_log: str) -> Verdict:
    """Any hardware XID in the log fails; application XIDs (13, 31, 43 ...) are reported."""
    events = [{k: e[k] for k in ("pci", "xid", "text")} for e in parse_xid(kernel_log)]
    bad = [e for e in events if e["xid"] in HARDWARE_XIDS]
    problems = [
        f"XID {e['xid']} on GPU {e['pci']}" + (f" ({e['text']})" if e["text"] else "")
        for e in bad[:5]
    ]
    if len(bad) > 5:
        problems.append(f"and {len(bad) - 5} more hardware XIDs")
    return judge(
        problems, f"no hardware XID in the kernel log ({len(events)} XID lines)", xids=events
    )


_GPU = re.compile(r"^GPU (\d+): (.*?) \(UUID")
_LINK = re.compile(r"^\s*Link (\d+): (.*)$")


def parse_nvlink(text: str) -> dict[str, dict[str, str]]:
    """``nvidia-smi nvlink -s``: GPU index -> link number -> what the line says
    (``26.562 GB/s`` or ``<inactive>``)."""
    gpus: dict[str, dict[str, str]] = {}
    current: str | None = None
    for line in text.splitlines():
        g = _GPU.match(line)
        if g:
            current = g.group(1)
            gpus[current] = {}
            continue
        link = _LINK.match(line)
        if link and current is not None:
            gpus[current][link.group(1)] = link.group(2).strip()
    return gpus


def judge_nvlink(text: str, *, links_per_gpu: int | None = None) -> Verdict:
    """``nvidia-smi nvlink -s``: every link of every GPU up (``<inactive>`` fails), and as
    many links per GPU as the profile says."""
    gpus = parse_nvlink(text)
    problems = []
    for gpu, links in gpus.items():
        down = [n for n, v in links.items() if "inactive" in v.lower()]
        if down:
            problems.append(f"GPU {gpu} NVLink link(s) {', '.join(down)} inactive")
        if links_per_gpu is not None and len(links) != links_per_gpu:
            problems.append(f"GPU {gpu} has {len(links)} NVLink links, expected {links_per_gpu}")
    up = sum(1 for links in gpus.values() for v in links.values() if "inactive" not in v.lower())
    return judge(problems, f"{up} NVLink link(s) up on {len(gpus)} GPU(s)", gpus=gpus)
