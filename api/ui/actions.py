"""The machine page's actions: which ones a machine offers (its allowed lifecycle actions,
``metald.lifecycle``'s table as ``GET /api/v1/machines/{id}`` reports it, its BMC's
capabilities, its claim, and the caller's role), and the API route each one calls. The page
acts in place (``POST /ui/machines/{id}/act``, answered with the machine's new actions), so
an open serial console stays attached while the machine boots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: What a lifecycle action does, as the confirmation dialog says it.
_LIFECYCLE_WHY = {
    "inspect": "boots the discovery image again (power cycle through the BMC)",
    "maintenance-on": "takes it out of the pool",
    "mark-broken": "takes it out of service and opens a repair",
    "retire": "takes it out of service for good",
}


@dataclass(frozen=True)
class Action:
    """One action of the machine page: its API route, its body, and how it is asked."""

    name: str
    label: str
    method: str
    path: str
    body: dict[str, Any] = field(default_factory=dict)
    #: Asked in a dialog that names the machine (it disrupts whoever uses the machine).
    confirm: bool = False
    #: A reason is required (for the event log), or may be given.
    reason: str = ""  # "required" | "optional" | ""
    #: Form fields the action takes (rename: name; labels: labels; register-bmc: ...).
    fields: tuple[str, ...] = ()
    why: str = ""


ACTIONS: dict[str, Action] = {
    a.name: a
    for a in (
        Action(
            "power-on",
            "Power on",
            "POST",
            "/api/v1/machines/{id}/power",
            {"action": "on", "wait_s": 0},
        ),
        Action(
            "power-cycle",
            "Power cycle",
            "POST",
            "/api/v1/machines/{id}/power",
            {"action": "cycle", "wait_s": 0},
            confirm=True,
            why="restarts it: whatever runs on it stops",
        ),
        Action(
            "power-off",
            "Power off",
            "POST",
            "/api/v1/machines/{id}/power",
            {"action": "off", "wait_s": 0},
            confirm=True,
            why="cuts its power: whatever runs on it stops",
        ),
        Action(
            "inspect",
            "Inspect",
            "POST",
            "/api/v1/machines/{id}/actions",
            {"action": "inspect"},
            confirm=True,
            reason="optional",
            why=_LIFECYCLE_WHY["inspect"],
        ),
        Action(
            "commission",
            "Commission",
            "POST",
            "/api/v1/machines/{id}/commission",
            {},
            confirm=True,
            reason="optional",
            why="inspects it again and runs its commissioning checks",
        ),
        Action(
            "maintenance-on",
            "Maintenance on",
            "POST",
            "/api/v1/machines/{id}/actions",
            {"action": "maintenance-on"},
            confirm=True,
            reason="required",
            why=_LIFECYCLE_WHY["maintenance-on"],
        ),
        Action(
            "maintenance-off",
            "Maintenance off",
            "POST",
            "/api/v1/machines/{id}/actions",
            {"action": "maintenance-off"},
        ),
        Action(
            "repair",
            "Repair",
            "POST",
            "/api/v1/machines/{id}/actions",
            {"action": "repair"},
            reason="optional",
        ),
        Action(
            "mark-broken",
            "Mark broken",
            "POST",
            "/api/v1/machines/{id}/actions",
            {"action": "mark-broken"},
            confirm=True,
            reason="required",
            why=_LIFECYCLE_WHY["mark-broken"],
        ),
        Action(
            "retire",
            "Retire",
            "POST",
            "/api/v1/machines/{id}/actions",
            {"action": "retire"},
            confirm=True,
            reason="required",
            why=_LIFECYCLE_WHY["retire"],
        ),
        Action(
            "release",
            "Release from its claim",
            "POST",
            "/api/v1/claims/{id}/machines/{machine_id}/release",
            {},
            confirm=True,
            why="takes it from its tenant and wipes its disks",
        ),
        Action("rename", "Rename", "PATCH", "/api/v1/machines/{id}", fields=("name",)),
        Action("labels", "Set labels", "PATCH", "/api/v1/machines/{id}/labels", fields=("labels",)),
        Action(
            "register-bmc",
            "Register its BMC",
            "POST",
            "/api/v1/bmcs",
            fields=("address", "protocol", "username", "password", "verify"),
        ),
    )
}

#: Lifecycle actions (``GET /api/v1/machines/{id}``'s ``allowed_actions``), in page order.
LIFECYCLE = ("inspect", "maintenance-on", "maintenance-off", "repair", "mark-broken", "retire")
#: States ``POST /api/v1/machines/{id}/commission`` starts from.
COMMISSION_FROM = frozenset({"ready", "maintenance", "commission-failed"})
#: Power actions, each needing the BMC's power capability.
POWER = ("power-on", "power-cycle", "power-off")


def offered(
    m: dict[str, Any],
    bmc: dict[str, Any] | None,
    allows: Callable[[str, str], bool],
) -> list[Action]:
    """The actions the page offers for this machine: each legal in its state, possible with
    its BMC (none without a BMC; only those its capabilities name, when known), and allowed
    to the caller's role (``allows(method, path)``, the API's own rule)."""
    caps = None if bmc is None else bmc.get("capabilities")
    out: list[str] = []
    if bmc is not None and (caps is None or "power" in caps):
        power = (bmc.get("power_state") or m.get("power_state") or "").lower()
        out += [a for a in POWER if not (a == "power-on" and power == "on")]
        if power == "off":
            out = [a for a in out if a != "power-off"]
    allowed = set(m.get("allowed_actions") or ())
    for a in LIFECYCLE:
        if a in allowed:
            out.append(a)
            if a == "inspect" and m.get("state") in COMMISSION_FROM and not m.get("tenant_id"):
                out.append("commission")
    if "inspect" not in out and m.get("state") in COMMISSION_FROM and not m.get("tenant_id"):
        out.append("commission")
    if m.get("claim_id"):
        out.append("release")
    out += ["rename", "labels"]
    if bmc is None:
        out.append("register-bmc")
    return [ACTIONS[a] for a in out if allows(ACTIONS[a].method, ACTIONS[a].path)]


def body_of(action: Action, m: dict[str, Any], form: Any) -> dict[str, Any] | str:
    """The API body for the action from the page's form, or a sentence saying what is
    missing."""
    body = dict(action.body)
    reason = str(form.get("reason", "")).strip()[:500]
    if action.reason == "required" and not reason:
        return f"{action.label.lower()} needs a reason: say why, for the event log"
    if reason and action.reason:
        body["reason"] = reason
    if action.name == "rename":
        name = str(form.get("name", "")).strip()
        if not name:
            return "give the machine's new name"
        body["name"] = name
    elif action.name == "labels":
        labels: dict[str, str | None] = {}
        text = str(form.get("labels", ""))
        for part in (p.strip() for p in text.replace("\n", ",").split(",")):
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                return f"{part[:40]!r}: write key=value to set a label, key= to remove it"
            labels[key.strip()] = value.strip() or None
        if not labels:
            return "write the labels as key=value, separated by commas (key= removes one)"
        body["labels"] = labels
    elif action.name == "register-bmc":
        for f in ("address", "username", "password"):
            if not str(form.get(f, "")).strip():
                return f"the BMC's {f} is required"
        body.update(
            address=str(form.get("address", "")).strip(),
            protocol=str(form.get("protocol", "auto")) or "auto",
            username=str(form.get("username", "")).strip(),
            password=str(form.get("password", "")),
            machine_id=m["id"],
            verify=form.get("verify", "") != "no",
        )
    return body


__all__ = ["ACTIONS", "Action", "body_of", "offered"]
