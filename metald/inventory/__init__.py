"""Machine inventory: the agent's payload schema, its normalisation, and enrollment rules."""

from metald.inventory.enroll import EnrollmentRule, apply_rules, diff
from metald.inventory.normalize import NormalizedInventory, inventory_document, normalize
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
