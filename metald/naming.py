"""Default machine names (issue 31): a machine is named at enlistment after where it sits
(``metald.machines.default_name``), else a readable generated name, which its serial number
replaces once the inventory gives one. Pure: the store's migration 0034 names the machines
enlisted before it with the same functions."""

from __future__ import annotations

import re

#: Words of generated names (``generated_name``): short, plain, unambiguous when read aloud.
_ADJECTIVES = (
    "amber",
    "bold",
    "brave",
    "brisk",
    "calm",
    "clear",
    "cool",
    "crisp",
    "deft",
    "eager",
    "early",
    "fair",
    "fast",
    "fine",
    "firm",
    "fresh",
    "glad",
    "grand",
    "green",
    "happy",
    "keen",
    "kind",
    "large",
    "light",
    "lively",
    "loyal",
    "lucky",
    "merry",
    "mild",
    "neat",
    "noble",
    "plain",
    "polite",
    "proud",
    "quick",
    "quiet",
    "rapid",
    "ready",
    "right",
    "royal",
    "safe",
    "sharp",
    "shy",
    "silver",
    "smart",
    "solid",
    "spry",
    "steady",
    "still",
    "stout",
    "sunny",
    "super",
    "sure",
    "swift",
    "tidy",
    "true",
    "upbeat",
    "valid",
    "vivid",
    "warm",
    "wise",
    "witty",
    "young",
    "zesty",
)
_NOUNS = (
    "alpaca",
    "badger",
    "beaver",
    "bison",
    "cobra",
    "condor",
    "crane",
    "deer",
    "dingo",
    "dove",
    "eagle",
    "egret",
    "falcon",
    "ferret",
    "finch",
    "fox",
    "gecko",
    "gibbon",
    "goose",
    "heron",
    "hyena",
    "ibis",
    "jackal",
    "koala",
    "lemur",
    "lion",
    "llama",
    "lynx",
    "magpie",
    "marten",
    "mole",
    "moose",
    "newt",
    "okapi",
    "orca",
    "otter",
    "owl",
    "panda",
    "parrot",
    "pelican",
    "puffin",
    "quail",
    "raven",
    "robin",
    "salmon",
    "seal",
    "shark",
    "skunk",
    "sloth",
    "snail",
    "swan",
    "tapir",
    "tiger",
    "toucan",
    "trout",
    "turtle",
    "viper",
    "walrus",
    "whale",
    "wolf",
    "wombat",
    "yak",
    "zebra",
    "zorilla",
)


def generated_name(machine_id: str) -> str:
    """A readable name for a machine with nothing better to be named after, derived from its
    id (``brisk-otter-4f2a9c``): two words and six hex digits of the id, so two machines
    practically never draw the same one (the unique index still decides) and metald can tell
    a generated name from one a person gave (it is this function of the id). Never an id
    prefix: it starts with a word."""
    digits = machine_id.replace("-", "").lower()
    n = int(digits[:8], 16) if len(digits) >= 8 else sum(map(ord, digits))
    return f"{_ADJECTIVES[n % 64]}-{_NOUNS[(n >> 6) % 64]}-{digits[8:14] or digits[:6]}"


def name_from_serial(serial: str | None) -> str | None:
    """A name from the machine's serial number (letters, digits, dots, dashes, underscores),
    or None when the serial gives none (too short to tell machines apart)."""
    if not serial:
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", serial).strip("-._")[:63].rstrip("-._").lower()
    # Not a name that would read as an id prefix (8+ hex digits), nor a bare number.
    if len(slug) < 4 or re.fullmatch(r"[0-9a-f-]{8,}", slug) or slug.isdigit():
        return f"sn-{slug}" if len(slug) >= 4 else None
    return slug


__all__ = ["generated_name", "name_from_serial"]
