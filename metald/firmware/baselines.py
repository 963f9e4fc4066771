"""Firmware baselines (the wanted version of each component, per SKU profile) and the pure
comparison of a machine's recorded versions with one.

A component is named by a Redfish ``FirmwareInventory`` id (``BMC``, ``BIOS``, ``NIC.1``) or a
case-insensitive glob over those ids for a component class (``GPU*``, ``NIC.*``): every
inventory item the name matches must report the wanted version. A component no item matches
is ``missing`` (off baseline: the BMC does not report what the baseline wants checked).
Versions are compared as the BMC reports them (exact text, surrounding blanks ignored);
``older``/``newer`` is a hint from a dotted-number reading, never what decides compliance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

#: How a component's new firmware takes effect once the BMC has written it.
#: ``none``: at once; ``host-reset``: the host must be power-cycled; ``bmc-reset``: the BMC
#: itself restarts (it does so on its own, or is reset through its Manager).
ApplyKind = Literal["none", "host-reset", "bmc-reset"]
#: What a component's comparison found.
Status = Literal["ok", "differs", "missing", "unknown"]
SHA256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]
MAX_COMPONENTS = 64


class Component(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: A FirmwareInventory id, or a glob over ids for a class of components.
    id: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[^\s]+$")]
    version: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    #: Where metald fetches the image (http, https or file); metald verifies ``sha256``
    #: before it offers the image to any BMC.
    url: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = None
    sha256: SHA256 | None = None
    apply: ApplyKind = "none"

    @field_validator("sha256")
    @classmethod
    def _lower(cls, v: str | None) -> str | None:
        return v.lower() if v is not None else None

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(https?|file)://", v):
            raise ValueError("the image URL must be http://, https:// or file://")
        return v

    def updatable(self) -> bool:
        """Whether metald can flash this component (it has an image and its checksum)."""
        return self.url is not None and self.sha256 is not None

    def matches(self, item_id: str) -> bool:
        return fnmatchcase(item_id.lower(), self.id.lower())


class BaselineSpec(BaseModel):
    """What an admin writes: the components of one profile's baseline."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    components: list[Component] = Field(min_length=1, max_length=MAX_COMPONENTS)

    @field_validator("components")
    @classmethod
    def _unique(cls, v: list[Component]) -> list[Component]:
        seen: set[str] = set()
        for c in v:
            if c.id.lower() in seen:
                raise ValueError(f"component {c.id!r} is listed twice")
            seen.add(c.id.lower())
            if (c.url is None) != (c.sha256 is None):
                raise ValueError(f"component {c.id!r}: give both url and sha256, or neither")
        return v


@dataclass(frozen=True)
class Finding:
    """One inventory item (or a component no item matched) against the baseline."""

    component: str
    item: str | None
    want: str
    have: str | None
    status: Status
    #: older / newer / None (not comparable, or equal).
    direction: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {
            "component": self.component,
            "item": self.item,
            "want": self.want,
            "have": self.have,
            "status": self.status,
            "direction": self.direction,
        }


def _numbers(v: str) -> tuple[int, ...] | None:
    parts = re.findall(r"\d+", v)
    return tuple(int(p) for p in parts) if parts else None


def direction(have: str, want: str) -> str | None:
    """``older``/``newer`` when both read as dotted numbers and differ there; else None."""
    a, b = _numbers(have), _numbers(want)
    if a is None or b is None or a == b:
        return None
    return "older" if a < b else "newer"


def compare(components: list[Component], versions: dict[str, str] | None) -> list[Finding]:
    """Every baseline component against ``versions`` (inventory id -> version, as recorded on
    the machine; None or empty: never read, every component ``unknown``)."""
    out: list[Finding] = []
    for c in components:
        if not versions:
            out.append(Finding(c.id, None, c.version, None, "unknown"))
            continue
        items = sorted(k for k in versions if c.matches(k))
        if not items:
            out.append(Finding(c.id, None, c.version, None, "missing"))
            continue
        for item in items:
            have = versions[item]
            if have.strip() == c.version.strip():
                out.append(Finding(c.id, item, c.version, have, "ok"))
            else:
                out.append(
                    Finding(c.id, item, c.version, have, "differs", direction(have, c.version))
                )
    return out


def off_baseline(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status != "ok"]


def component_for(components: list[Component], item_id: str) -> Component | None:
    """The baseline component an inventory item falls under: an exact id first, then the
    first glob that matches."""
    for c in components:
        if c.id.lower() == item_id.lower():
            return c
    return next((c for c in components if c.matches(item_id)), None)
