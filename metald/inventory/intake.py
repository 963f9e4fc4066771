"""One call for the inventory endpoint: validate, check machine and replay, normalise.

Pure: the caller (``metald.enrollment.accept_inventory``) reads the machine's stored
``inventory`` document, calls ``validate_inventory``, and on success writes ``document`` and ``machine_fields`` in one
transaction; on any of the three errors it writes nothing but an event. The replay state lives
inside the stored document (key ``agent``), so refusing a post leaves everything untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metald.inventory.changes import diff
from metald.inventory.normalize import NormalizedInventory, inventory_document, normalize
from metald.inventory.schema import (
    InventoryPayload,
    ReplayState,
    check_machine,
    check_replay,
    parse_payload,
)


@dataclass(frozen=True)
class AcceptedInventory:
    payload: InventoryPayload
    normalized: NormalizedInventory
    #: The new ``Machine.inventory`` value (normalised view, payload, replay state).
    document: dict[str, Any]
    #: The ``Machine`` columns to set (vendor ... gpu_count).
    machine_fields: dict[str, Any]
    #: What changed since the stored inventory (empty on the first one): for ``inventory.changed``.
    changes: list[str]


def validate_inventory(
    body: Any, *, token_machine_id: str, stored: dict[str, Any] | None
) -> AcceptedInventory:
    """Raises ``InventoryError`` (422), ``WrongMachine`` (403) or ``ReplayedInventory`` (409)."""
    payload = parse_payload(body)
    check_machine(payload, token_machine_id)
    previous = (stored or {}).get("agent")
    state: ReplayState = check_replay(previous, payload)
    normalized = normalize(payload)
    document = {**inventory_document(payload, normalized), "agent": state.model_dump()}
    return AcceptedInventory(
        payload=payload,
        normalized=normalized,
        document=document,
        machine_fields=normalized.machine_fields(),
        changes=diff(stored, normalized) if stored else [],
    )
