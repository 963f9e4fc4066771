"""``dcgmi diag -r <level> -j``: every test result Pass (or Skip); any Fail or Warn fails.

DCGM 2.x/3.x JSON: ``{"DCGM GPU Diagnostic": {"test_categories": [{"category": ...,
"tests": [{"name": ..., "results": [{"gpu_id": ..., "status": "Pass|Fail|Skip|Warn",
"info"/"warnings": ...}]}]}]}}``. Walked generically: any object with ``status`` under a test.
"""

from __future__ import annotations

import json
from typing import Any

from metald.commissioning.verdict import Verdict, error, judge


def judge_dcgm(text: str) -> Verdict:
    try:
        doc = json.loads(text)
    except ValueError as e:
        return error(f"dcgmi diag output is not JSON: {e}")
    diag = doc.get("DCGM GPU Diagnostic") if isinstance(doc, dict) else None
    if not isinstance(diag, dict) or not isinstance(diag.get("test_categories"), list):
        return error("dcgmi diag output has no 'DCGM GPU Diagnostic' test categories")
    results: list[dict[str, Any]] = []
    for cat in diag["test_categories"]:
        for test in cat.get("tests", []) if isinstance(cat, dict) else []:
            for r in test.get("results", []) if isinstance(test, dict) else []:
                if isinstance(r, dict):
                    warn = r.get("warnings") or r.get("warning") or ""
                    if isinstance(warn, list):
                        warn = "; ".join(str(w.get("warning", w)) for w in warn)
                    results.append(
                        {
                            "test": str(test.get("name")),
                            "gpu": r.get("gpu_id", r.get("gpu_ids")),
                            "status": str(r.get("status", "")),
                            "warning": str(warn)[:300],
                        }
                    )
    if not results:
        return error("dcgmi diag reported no test results")
    bad = [r for r in results if r["status"].lower() in ("fail", "warn")]
    problems = [
        f"dcgm {r['test']} {r['status'].lower()}ed on GPU {r['gpu']}"
        + (f": {r['warning']}" if r["warning"] else "")
        for r in bad[:5]
    ]
    return judge(problems, f"dcgm diag: {len(results)} results, none failed", results=results)
