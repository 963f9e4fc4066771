"""metald's CPU by thread during the storm's busy phase, from ``STORM_THREADS``'s samples
(``bench/sqlcount/sitecustomize.py``): the phase is the span from the last quiet sample
(under 10 % of a core) before the busiest second to the first quiet one after it.

    python3 bench/threads_split.py /tmp/threads-head.json [/tmp/threads-base.json ...]
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter


def split(path: str) -> tuple[float, Counter[str], float]:
    doc = json.load(open(path))  # noqa: SIM115 - a bench tool
    series = [(t, sum(v.values()), v) for t, v in doc["series"]]
    rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(series, series[1:], strict=False)]
    peak = max(range(len(rates)), key=rates.__getitem__)
    start = peak
    while start > 0 and rates[start - 1] > 0.1:
        start -= 1
    end = peak
    while end < len(rates) - 1 and rates[end + 1] > 0.1:
        end += 1
    t0, _, a = series[start]
    t1, _, b = series[end + 1]
    by: Counter[str] = Counter()
    for k, v in b.items():
        by[re.sub(r"(_\d+)?:\d+$", "", k)] += v - a.get(k, 0.0)
    return t1 - t0, by, sum(by.values())


def main() -> None:
    for path in sys.argv[1:]:
        span, by, total = split(path)
        print(f"== {path}: {span:.1f} s, {total:.2f} s of CPU")
        for name, cpu in by.most_common():
            print(f"  {name:24s} {cpu:7.2f}")


if __name__ == "__main__":
    main()
