"""examples/metald.toml lists every key of the config model (commented or not), so an operator
reads every setting in one place; and the example loads."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from metald.config import Config, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "metald.toml"
_HEADER = re.compile(r"^\[\[?\s*([\w.]+)\s*\]\]?")
_KEY = re.compile(r"^([\w-]+)\s*=")


def _submodel(annotation: object) -> type[BaseModel] | None:
    """The model a field holds (directly, in a list, or optional), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def model_keys(model: type[BaseModel], prefix: str = "") -> set[tuple[str, str]]:
    """(section, key) for every leaf of ``model``; sections are dotted TOML table names."""
    out: set[tuple[str, str]] = set()
    for name, info in model.model_fields.items():
        sub = _submodel(info.annotation)
        if sub is not None:
            out |= model_keys(sub, f"{prefix}.{name}" if prefix else name)
        else:
            out.add((prefix, name))
    return out


def example_keys(text: str) -> set[tuple[str, str]]:
    """(section, key) for every ``key =`` line under its table header, commented or not."""
    section, out = "", set()
    for raw in text.splitlines():
        line = raw.lstrip("#").strip()
        if m := _HEADER.match(line):
            section = m.group(1)
        elif m := _KEY.match(line):
            out.add((section, m.group(1)))
    return out


def test_example_lists_every_key_of_the_config_model() -> None:
    missing = model_keys(Config) - example_keys(EXAMPLE.read_text())
    assert not missing, "examples/metald.toml lacks: " + ", ".join(
        sorted(f"[{s}] {k}" if s else k for s, k in missing)
    )


def test_the_walk_sees_nested_sections() -> None:
    keys = model_keys(Config)
    assert ("", "state_dir") in keys
    assert ("boot.networks", "pool_start") in keys
    assert any(s == "enroll" for s, _ in keys)


def test_example_loads(tmp_path: Path) -> None:
    load_config(str(EXAMPLE), environ={"METALD_STATE_DIR": str(tmp_path)})
