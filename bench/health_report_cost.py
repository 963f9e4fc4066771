"""CPU of one node health report in metald: parse, classify, fold (no root, no peers).

    .venv/bin/python bench/health_report_cost.py [--repeats 500] [--gpus 8]

The report is the real A100 ``nvidia-smi -q -x`` capture (tests/fixtures/gpu/) with its one
``<gpu>`` element repeated ``--gpus`` times (the bus id left as it is: the parser does not
care), plus one XID 79 kernel line. Prints the median of 7 runs of the process CPU per report
for ``metald.health.node.report_signals`` + ``DEFAULT_TABLE.classify`` + ``trust.fold``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from metald.health.classify import DEFAULT_TABLE
from metald.health.node import NodeReport, report_signals
from metald.health.trust import Health, fold

XML = (
    Path(__file__).resolve().parents[1]
    / "tests/fixtures/gpu/nvidia-smi-q-x_a100-sxm4-80gb_mig_drv535.54.03.xml"
)
XID = "[  912.104] NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=500)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    text = XML.read_text()
    gpu = re.search(r"<gpu id=.*?</gpu>\n", text, re.S)
    assert gpu is not None
    xml = text.replace(gpu.group(0), gpu.group(0) * args.gpus)
    report = NodeReport(datetime.now(UTC), kernel_log=XID, nvidia_smi_xml=xml)
    runs = []
    for _ in range(7):
        t = time.process_time()
        for _ in range(args.repeats):
            signals = report_signals(report, gpu_count=args.gpus).signals
            fold(Health(), (DEFAULT_TABLE.classify(s) for s in signals))
        runs.append((time.process_time() - t) / args.repeats * 1e6)
    print(
        f"{args.gpus} GPU(s): median {statistics.median(runs):.0f} us CPU per report "
        f"(runs: {', '.join(f'{r:.0f}' for r in runs)})"
    )


if __name__ == "__main__":
    main()
