"""Credentials out of image specs shown to anyone but an admin. Pure.

Image URLs often carry what fetches them: ``https://user:pass@mirror/...`` or a pre-signed
object-store URL (``X-Amz-Signature``, ``sig``, ``token`` ...). The agent that installs the
image gets the spec as stored; listings for technicians and orchestrators get it with the
userinfo and every secret-looking query value replaced by ``REDACTED``, and with the values of
secret-looking kernel arguments replaced the same way.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "REDACTED"
#: Query parameter and kernel argument names whose values are credentials: signatures, tokens,
#: keys, passwords, credentials (AWS/GCS/Azure pre-signed URLs included).
SECRET_NAME = re.compile(
    r"(sig|signature|token|secret|password|passwd|pass|pwd|key|credential|auth|session)",
    re.IGNORECASE,
)
URL_FIELDS = ("url", "kernel", "initrd", "rootfs")


def redact_url(url: str) -> str:
    """``url`` without userinfo and with secret-looking query values replaced."""
    if "://" not in url:
        return url  # a path under the assets folder
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, REDACTED if SECRET_NAME.search(k) else v) for k, v in pairs], safe="/:"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_spec(spec: dict[str, Any]) -> dict[str, Any]:
    out = dict(spec)
    for field in URL_FIELDS:
        if isinstance(out.get(field), str):
            out[field] = redact_url(out[field])
    if isinstance(out.get("kernel_args"), dict):
        out["kernel_args"] = {
            k: (REDACTED if SECRET_NAME.search(k) else v) for k, v in out["kernel_args"].items()
        }
    return out
