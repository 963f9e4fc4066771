"""A tenant's cloud-init user-data: what form it is, whether cloud-init would accept it, and
metald's own vendor-data beside it. Pure (the schema is read once from a file).

Forms accepted (cloud-init's own, by their first line or MIME type): ``#cloud-config``
(YAML, checked against cloud-init's JSON schema), ``#!`` scripts, ``#cloud-boothook``,
``#include`` (URLs the node fetches itself), ``## template: jinja`` (a template over one of
the others) and ``Content-Type: multipart/...`` MIME archives whose parts are any of these.
The tenant's bytes are served unchanged as ``user-data``; metald's hostname, SSH keys and
join material go to ``vendor-data``, which cloud-init applies under the user-data (a key the
user-data sets wins).

The schema is the one Debian's ``cloud-init`` package installs
(``cloudinit/config/schemas/schema-cloud-config-v1.json``); it is validated the way
``cloud-init schema`` does: JSON Schema draft 4 with format checks (cloud-init's deprecation
notes are not errors there either).
"""

from __future__ import annotations

import email
import email.policy
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

#: Where Debian's cloud-init package puts the cloud-config schema.
DEBIAN_SCHEMA = (
    "/usr/lib/python3/dist-packages/cloudinit/config/schemas/schema-cloud-config-v1.json"
)
#: Default size limit of one user-data (OpenStack's config drive takes 64 KiB too).
MAX_BYTES = 64 * 1024
#: MIME types of multipart parts cloud-init handles, and the first lines of single forms.
PART_TYPES = {
    "text/cloud-config": "cloud-config",
    "text/x-shellscript": "script",
    "text/cloud-boothook": "boothook",
    "text/x-include-url": "include",
    "text/jinja2": "jinja",
    "text/cloud-config-archive": "cloud-config-archive",
    "text/part-handler": "part-handler",
}
STARTS = (
    ("#cloud-config-archive", "cloud-config-archive"),
    ("#cloud-config", "cloud-config"),
    ("#!", "script"),
    ("#cloud-boothook", "boothook"),
    ("#include", "include"),
    ("## template: jinja", "jinja"),
    ("#part-handler", "part-handler"),
)


class UserDataError(ValueError):
    """The user-data would not run as the tenant expects; the message says what to fix."""


@dataclass(frozen=True)
class Checked:
    #: cloud-config, script, boothook, include, jinja, multipart, ...
    form: str
    size: int
    sha256: str
    #: multipart: the forms of the parts, in order.
    parts: tuple[str, ...] = ()


@functools.cache
def _validator(path: str) -> Any:
    from jsonschema import Draft4Validator, FormatChecker  # type: ignore[import-untyped]
    from jsonschema.validators import create  # type: ignore[import-untyped]

    try:
        schema = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserDataError(
            f"metald cannot check cloud-config: no cloud-init schema at {path} ({e.strerror}); "
            "install Debian's cloud-init package or set provision.cloud_config_schema"
        ) from None
    # Built as cloud-init builds it: draft 4's keywords, but a "$ref" does not hide the
    # keywords beside it (cloud-init checks "type" next to "$ref", stock draft 4 would not).
    cls = create(
        meta_schema=Draft4Validator.META_SCHEMA,
        validators=dict(Draft4Validator.VALIDATORS),
        type_checker=Draft4Validator.TYPE_CHECKER,
        version="cloud-init-draft4",
    )
    return cls(schema, format_checker=FormatChecker())


def schema_errors(config: Any, schema_path: str = DEBIAN_SCHEMA) -> list[str]:
    """cloud-init's schema errors for one parsed cloud-config, as ``path: message`` lines."""
    if not isinstance(config, dict):
        return [
            "the cloud-config must be a mapping of module keys (it is a YAML "
            f"{type(config).__name__})"
        ]
    errors = sorted(_validator(schema_path).iter_errors(config), key=lambda e: list(e.path))
    out = []
    for e in errors:
        where = ".".join(str(p) for p in e.path) or "(top level)"
        out.append(f"{where}: {e.message}")
    return out


#: Values a cloud-config may expand to, aliases counted each time they are used: YAML aliases
#: let a kilobyte stand for billions of values, which the schema check would then walk.
MAX_VALUES = 100_000


def _expands_within(config: Any, budget: int = MAX_VALUES) -> bool:
    stack = [config]
    seen = 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > budget:
            return False
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


#: Deepest flow nesting ([ and {) read: PyYAML's parser recurses per level, slowly.
MAX_DEPTH = 64


def _flow_depth(text: str) -> int:
    """The deepest [ / { nesting, quotes and comments not told apart: an upper bound."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}" and depth:
            depth -= 1
    return deepest


def _cloud_config(text: str, schema_path: str, where: str) -> None:
    if _flow_depth(text) > MAX_DEPTH:
        raise UserDataError(f"{where}: nested deeper than {MAX_DEPTH} levels of [ and {{")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserDataError(f"{where}: not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    except (ValueError, TypeError, RecursionError) as e:
        # a value YAML types but cannot build (a 13th month), or nesting too deep
        raise UserDataError(f"{where}: not valid YAML: {type(e).__name__}") from None
    if config is None:
        return  # an empty cloud-config does nothing, as cloud-init reads it
    if not _expands_within(config):
        raise UserDataError(
            f"{where}: expands to more than {MAX_VALUES} values (YAML aliases repeated); "
            "write the values out, or fetch them with #include"
        )
    errs = schema_errors(config, schema_path)
    if errs:
        raise UserDataError(
            f"{where}: cloud-init's schema refuses it: "
            + "; ".join(errs[:10])
            + (f" (and {len(errs) - 10} more)" if len(errs) > 10 else "")
        )


def _single_form(text: str) -> str | None:
    first = text.lstrip("\ufeff").split("\n", 1)[0].rstrip("\r")
    for start, form in STARTS:
        if first.startswith(start):
            return form
    return None


def check(data: str, *, max_bytes: int = MAX_BYTES, schema_path: str = DEBIAN_SCHEMA) -> Checked:
    """The form of ``data`` if cloud-init would run it; else ``UserDataError`` saying why."""
    raw = data.encode()
    if len(raw) > max_bytes:
        raise UserDataError(
            f"user-data is {len(raw)} bytes, more than the {max_bytes} allowed; fetch the rest "
            "from the node (#include, or a script that downloads it)"
        )
    digest = hashlib.sha256(raw).hexdigest()
    if "\x00" in data:
        raise UserDataError("user-data holds a NUL byte; send text (cloud-init forms), not binary")
    head = data.lstrip()[:200].lower()
    if head.startswith("content-type:") or head.startswith("mime-version:"):
        parts = _multipart(data, schema_path)
        return Checked("multipart", len(raw), digest, parts)
    form = _single_form(data)
    if form is None:
        raise UserDataError(
            "user-data must start with #cloud-config, #! (a script), #cloud-boothook, #include, "
            "'## template: jinja' or be a MIME multipart archive (Content-Type: multipart/mixed)"
        )
    if form == "cloud-config":
        _cloud_config(data, schema_path, "user-data")
    return Checked(form, len(raw), digest)


def _multipart(data: str, schema_path: str) -> tuple[str, ...]:
    msg = email.message_from_string(data, policy=email.policy.compat32)
    if not msg.is_multipart():
        raise UserDataError(
            "user-data has MIME headers but is not multipart; use Content-Type: multipart/mixed "
            "with a boundary"
        )
    forms: list[str] = []
    for i, part in enumerate(msg.walk()):
        if part.is_multipart():
            continue
        ctype = part.get_content_type()
        payload = part.get_payload(decode=True)
        text = payload.decode(errors="replace") if isinstance(payload, bytes) else ""
        form = PART_TYPES.get(ctype)
        if ctype == "text/plain":
            form = _single_form(text)  # cloud-init sniffs text/plain parts by their first line
        if form is None:
            raise UserDataError(
                f"multipart part {i} has type {ctype!r}, which cloud-init ignores; use one of "
                + ", ".join(sorted(PART_TYPES))
            )
        if form == "cloud-config":
            _cloud_config(text, schema_path, f"multipart part {i} (text/cloud-config)")
        forms.append(form)
    if not forms:
        raise UserDataError("the multipart user-data has no parts")
    return tuple(forms)


def vendor_data(
    *, hostname: str, ssh_authorized_keys: list[str], write_files: list[dict[str, str]]
) -> str:
    """metald's own cloud-config, served as vendor-data beside the tenant's user-data (JSON is
    YAML). The tenant's user-data overrides a key it sets too (cloud-init's merge)."""
    cfg: dict[str, Any] = {
        "hostname": hostname,
        "preserve_hostname": False,
        "ssh_authorized_keys": list(ssh_authorized_keys),
    }
    if write_files:
        cfg["write_files"] = write_files
    return "#cloud-config\n" + json.dumps(cfg, indent=2) + "\n"
