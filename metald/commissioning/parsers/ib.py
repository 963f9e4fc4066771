"""InfiniBand ports from sysfs, as the agent prints them:
``<device>/<port> <state> <rate>`` per line, from /sys/class/infiniband/*/ports/*/{state,rate}
(``mlx5_0/1 4: ACTIVE 400 Gb/sec (4X NDR)``)."""

from __future__ import annotations

import re
from typing import Any

from metald.commissioning.verdict import Verdict, judge

_LINE = re.compile(r"^(\S+/\d+)\s+\d+:\s*(\S+)\s+(\d+(?:\.\d+)?)\s*Gb/sec")


def parse_ib(text: str) -> list[dict[str, Any]]:
    """One ``{"port", "state", "rate_gbps"}`` per port line."""
    ports = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            ports.append({"port": m.group(1), "state": m.group(2), "rate_gbps": float(m.group(3))})
    return ports


def judge_ib(text: str, *, count: int, rate_gbps: int = 0) -> Verdict:
    ports = parse_ib(text)
    good = [p for p in ports if p["state"] == "ACTIVE" and p["rate_gbps"] >= rate_gbps]
    problems = []
    if len(good) < count:
        seen = ", ".join(f"{p['port']} {p['state']} {p['rate_gbps']:g} Gb/s" for p in ports)
        problems.append(
            f"expected {count} InfiniBand port(s) active at {rate_gbps} Gb/s or more, "
            f"found {len(good)} ({seen or 'no port'})"
        )
    return judge(problems, f"{len(good)} InfiniBand port(s) active", ports=ports)
