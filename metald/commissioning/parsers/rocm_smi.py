"""``rocm-smi --showallinfo --json`` (AMD GPUs): how many GPUs the driver sees, and what each
reports, judged where the output says something judgeable.

The JSON is one object per card (``card0`` ...) and a ``system`` object; key names move between
ROCm releases ("Card series" in 5.x and 6.0, "Card Series" in 6.1; "GPU ID" then "Device ID").
What it holds, per the captures in ``tests/commissioning/fixtures/SOURCES.md``: model, SKU,
VBIOS, PCI bus, temperatures, power, the PCIe DPM levels ("pcie clock level" and numbered levels
such as ``"1": "16.0GT/s x16 *"``) and the PCIe replay count. It holds no ECC counter and no
throttle reason (``--showrasinfo`` prints a table, not JSON), so those are not judged here.

Judged: the number of cards against the profile's ``gpu_count``; a card reporting no model at
all. Kept as values: model, SKU, VBIOS, bus, junction temperature, replay count, current and
highest PCIe level. Not judged: the PCIe level (AMD GPUs drop to x1 at idle by design, a DPM
level, so a narrow current level is not a fault) and the replay count (a healthy MI250 in the
captures shows 147).
"""

from __future__ import annotations

import json
import re
from typing import Any

from metald.commissioning.verdict import Verdict, error, judge

_PCIE = re.compile(r"([\d.]+)GT/s,? x(\d+)")


def _get(card: dict[str, Any], *names: str) -> str | None:
    low = {k.lower(): v for k, v in card.items()}
    for n in names:
        v = low.get(n.lower())
        if isinstance(v, str) and v and v != "N/A":
            return v
    return None


def _num(v: str | None) -> float | None:
    try:
        return None if v is None else float(v)
    except ValueError:
        return None


def _pcie(card: dict[str, Any]) -> tuple[str | None, str | None]:
    """The current PCIe DPM level and the widest one listed, as "16.0GT/s x16"."""
    cur = _get(card, "pcie clock level")
    m = _PCIE.search(cur or "")
    levels = [_PCIE.search(v) for k, v in card.items() if k.isdigit() and isinstance(v, str)]
    found = [x for x in levels if x is not None]
    top = max(found, key=lambda x: (int(x[2]), float(x[1])), default=None)
    return (
        None if m is None else f"{m[1]}GT/s x{m[2]}",
        None if top is None else f"{top[1]}GT/s x{top[2]}",
    )


def judge_rocm_smi(text: str, *, expected_count: int | None = None) -> Verdict:
    try:
        # rocm-smi prints warnings (e.g. about a card it cannot read) around its JSON, on the
        # same stream the agent keeps: the document is the outermost braces
        doc = json.loads(text[text.index("{") : text.rindex("}") + 1])
    except ValueError as e:
        return error(f"rocm-smi output holds no JSON document: {str(e)[:200]}")
    if not isinstance(doc, dict):
        return error("rocm-smi output is not a JSON object")
    cards = {k: v for k, v in doc.items() if re.fullmatch(r"card\d+", k) and isinstance(v, dict)}
    gpus, problems = [], []
    for name in sorted(cards, key=lambda k: int(k[4:])):
        c = cards[name]
        cur, top = _pcie(c)
        model = _get(c, "Card Series", "Card series", "Card Model", "Card model")
        gpus.append(
            {
                "card": name,
                "model": model,
                "sku": _get(c, "Card SKU"),
                "vbios": _get(c, "VBIOS version"),
                "bus": _get(c, "PCI Bus"),
                "junction_c": _num(_get(c, "Temperature (Sensor junction) (C)")),
                "pcie_replays": _num(_get(c, "PCIe Replay Count")),
                "pcie_current": cur,
                "pcie_top": top,
            }
        )
        if model is None:
            problems.append(f"{name} reports no model")
    driver = _get(doc.get("system") or {}, "Driver version")
    if not cards:
        return error("rocm-smi reported no GPU", driver=driver)
    if expected_count is not None and len(cards) != expected_count:
        problems.insert(0, f"rocm-smi sees {len(cards)} GPUs, the profile expects {expected_count}")
    models = sorted({g["model"] for g in gpus if g["model"]})
    return judge(
        problems,
        f"{len(cards)} AMD GPU(s): {', '.join(models)}",
        gpu_count=len(cards),
        driver=driver,
        gpus=gpus,
    )
