"""DMI and tool strings that identify nothing: firmware placeholders."""

from __future__ import annotations

#: Strings firmware vendors leave in DMI fields that identify nothing.
_PLACEHOLDERS = {
    "",
    "none",
    "n/a",
    "na",
    "not specified",
    "not applicable",
    "not available",
    "to be filled by o.e.m.",
    "default string",
    "system serial number",
    "system product name",
    "system manufacturer",
    "chassis serial number",
    "base board serial number",
    "0",
    "0123456789",
    "1234567890",
    "123456789",
    "unknown",
    "oem",
    "o.e.m.",
}


def clean(value: str | None) -> str | None:
    """A DMI/tool string, or None when it is a placeholder that identifies nothing."""
    if value is None:
        return None
    v = " ".join(value.split())
    if v.lower() in _PLACEHOLDERS or set(v) <= {"0", "-", " "} or set(v.lower()) <= {"f", "-"}:
        return None
    return v
