"""``metalctl machines attestation ID`` (the attestation key, golden values and last verdicts
with the changed PCRs and events) and ``machines accept-golden ID --reason``."""

from __future__ import annotations

import argparse
from typing import Any

from .client import Client
from .output import emit


def register(msub: Any) -> None:
    ma = msub.add_parser("attestation", help="a machine's measured-boot attestation")
    ma.add_argument("id", help="id, name or id prefix")
    ma.set_defaults(func=show)
    mg = msub.add_parser(
        "accept-golden",
        help="accept a held machine's measured boot as its golden values (--reason required)",
    )
    mg.add_argument("id", help="id, name or id prefix")
    mg.add_argument("--reason", required=True)
    mg.set_defaults(func=accept)


def _text(out: dict[str, Any]) -> str:
    key, golden = out["key"], out["golden"]
    lines = [f"machine {out['machine_id']}: {'attested' if out['attested'] else 'not attested'}"]
    lines.append(
        "key:     none enrolled"
        if key is None
        else f"key:     AK {key['ak_name'][:20]}...  {key['ek_check']}"
    )
    if golden is None:
        lines.append("golden:  none yet (learned at the first attestation)")
    else:
        why = f" ({golden['reason']})" if golden.get("reason") else ""
        lines.append(f"golden:  {golden['source']} by {golden['set_by']}{why}")
    for a in out["attestations"]:
        lines.append(f"{a['at']}  {a['machine_state']:<13} {a['status']:<8} {a['summary']}")
        for c in a["changes"]:
            lines.append(f"    PCR {c['pcr']}: {c['golden'][:16]}... -> {c['quoted'][:16]}...")
            for e in c["events"]:
                lines.append(f"      {e['change']:<8} {e['type']} {e['label']}".rstrip())
    return "\n".join(lines)


def show(args: argparse.Namespace, c: Client) -> None:
    emit(args, c.call("GET", f"/api/v1/machines/{args.id}/attestation"), _text)


def accept(args: argparse.Namespace, c: Client) -> None:
    m = c.call("POST", f"/api/v1/machines/{args.id}/attestation/accept", {"reason": args.reason})
    emit(args, m, lambda m: f"{m['name'] or m['id']}: {m['state']} (new golden values accepted)")
