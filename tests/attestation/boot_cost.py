"""The agent's attestation step, timed: the real agent (busybox sh, tpm2-tools) against a real
metald (loopback, SQLite) and a real swtpm. Not a test (timings never decide one): run

    .venv/bin/python -m tests.attestation.boot_cost [steady-boots]

It prints the first discovery boot (key made and enrolled) and each steady-state discovery
boot (metald holds the AK), wall-clock seconds around ``attest discovery``."""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from metald.lifecycle import State
from metald.store.models import Machine
from tests.api_helpers import LoopbackApi
from tests.attestation import test_agent_attest as t


def main(steady: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t._tools(tmp)
        log = t._header_only_log(tmp)
        tpm_gen = t.tpm.__wrapped__(tmp)  # type: ignore[attr-defined]
        tcti = next(tpm_gen)
        try:
            with LoopbackApi(f"sqlite:///{tmp / 'metald.db'}", tmp) as api:
                with api.store.session() as s:
                    m = Machine(state=State.DISCOVERED.value)
                    s.add(m)
                    s.commit()
                    mid = m.id
                steady_s: list[float] = []
                for i in range(steady + 1):
                    token = t._boot(api, mid, State.INSPECTING, f"b{i}")
                    shutil.rmtree(tmp / "state", ignore_errors=True)
                    start = time.monotonic()
                    out = t._attest(api, tmp, token, tcti, log, "discovery")
                    took = time.monotonic() - start
                    verdict = [ln for ln in out.splitlines() if "attestation:" in ln]
                    kind = "first boot (enroll)" if i == 0 else "steady-state boot"
                    print(f"{kind}: {took:.3f} s  {verdict[-1] if verdict else out[-300:]}")
                    if i:
                        steady_s.append(took)
                if steady_s:
                    print(f"steady-state median: {statistics.median(steady_s):.3f} s")
        finally:
            next(tpm_gen, None)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
