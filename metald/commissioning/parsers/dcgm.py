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


#: Most incidents read from one ``dcgmi health -c -j`` document (a hostile node cannot flood).
MAX_HEALTH_INCIDENTS = 256


def parse_health(text: str) -> tuple[str, list[dict[str, str]]]:
    """``dcgmi health --check --json`` (DCGM's ``DcgmiOutputJson``: ``{"header": ["Health
    Monitor Report"], "body": {"Overall Health": {"value": "Healthy|Warning|Failure"},
    "<entity group>": {"children": {"<entity id>": {"value": ..., "children": {"Errors":
    {"children": {"<system>": {"value": ..., "overflow": [message lines]}}}}}}}}}``) -> the
    overall health and one incident per entity and system: ``group``, ``entity``, ``system``,
    ``health`` and ``message`` (the overflow lines joined). ValueError when it is not that
    document."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"dcgmi health output is not JSON: {e}") from None
    body = doc.get("body") if isinstance(doc, dict) else None
    overall = body.get("Overall Health") if isinstance(body, dict) else None
    if not isinstance(overall, dict) or not isinstance(overall.get("value"), str):
        raise ValueError("dcgmi health output has no 'Overall Health'")
    assert isinstance(body, dict)
    out: list[dict[str, str]] = []
    for group, node in body.items():
        if group == "Overall Health" or not isinstance(node, dict):
            continue
        entities = node.get("children")
        for entity, e in entities.items() if isinstance(entities, dict) else []:
            errors = e.get("children", {}).get("Errors", {}) if isinstance(e, dict) else {}
            systems = errors.get("children") if isinstance(errors, dict) else None
            for system, s in systems.items() if isinstance(systems, dict) else []:
                if not isinstance(s, dict):
                    continue
                lines = s.get("overflow")
                lines = lines if isinstance(lines, list) else []
                out.append({
                    "group": str(group)[:32],
                    "entity": str(entity)[:16],
                    "system": str(system)[:32],
                    "health": str(s.get("value") or e.get("value") or "")[:16],
                    "message": " ".join(str(x) for x in lines)[:400],
                })  # fmt: skip
                if len(out) >= MAX_HEALTH_INCIDENTS:
                    return str(overall["value"]), out
    return str(overall["value"]), out
