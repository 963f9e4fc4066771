"""CPU cost of verifying one attestation (quote signature, nonce, event log replay, golden
comparison) on the real swtpm/OVMF fixtures: ``python bench/attestation_verify.py [N]``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from metald.attestation.verify import verify

FIX = Path(__file__).resolve().parent.parent / "tests" / "attestation" / "fixtures"


def _boot(name: str) -> dict[str, bytes]:
    r = lambda suffix: (FIX / f"a-{name}.{suffix}").read_bytes()  # noqa: E731
    return {
        "quote": r("quote.msg"),
        "signature": r("quote.sig"),
        "event_log": r("eventlog"),
        "nonce": bytes.fromhex(r("nonce").decode()),
    }


def main(n: int = 2000) -> None:
    ak = (FIX / "a-ak.tpmt").read_bytes()
    golden = verify(attestation_key=ak, golden=None, **_boot("boot1")).golden
    out = {}
    for name in ("boot1", "boot2"):  # passed, failed (with evidence)
        sub = _boot(name)
        start = time.process_time()
        for _ in range(n):
            v = verify(attestation_key=ak, golden=golden, **sub)
        out[f"{name} ({v.status}) ms_cpu_per_verify"] = round(
            (time.process_time() - start) * 1000 / n, 3
        )
    print(json.dumps(out))
    print(v.summary())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
