"""Machine inventory: the agent's payload schema, its normalisation, and enrollment rules."""

from metald.inventory.changes import diff
from metald.inventory.intake import AcceptedInventory, validate_inventory
from metald.inventory.normalize import NormalizedInventory, inventory_document, normalize
from metald.inventory.rules import EnrollmentRule, apply_rules
from metald.inventory.schema import (
    InventoryError,
    InventoryPayload,
    ReplayedInventory,
    ReplayState,
    WrongMachine,
    check_machine,
    check_replay,
    parse_payload,
)

__all__ = [
    "AcceptedInventory",
    "validate_inventory",
    "EnrollmentRule",
    "InventoryError",
    "InventoryPayload",
    "NormalizedInventory",
    "ReplayState",
    "ReplayedInventory",
    "WrongMachine",
    "apply_rules",
    "check_machine",
    "check_replay",
    "diff",
    "inventory_document",
    "normalize",
    "parse_payload",
]
