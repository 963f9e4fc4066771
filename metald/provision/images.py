"""Image specs: what an image row's ``spec`` may hold, validated and normalised. Pure.

- ``stateless``: ``kernel`` plus ``initrd`` and/or ``rootfs`` (http(s) URLs or paths under the
  boot assets folder), optional ``kernel_args``; booted into RAM on every boot.
- both: ``arch``, the CPU architecture it is built for (amd64, the default, or arm64).
- ``disk``: ``url`` (http or https), ``sha256`` (64 hex digits), ``format`` raw or qcow2,
  optional ``size_bytes`` (needed for a write percentage). raw: a ``.gz`` URL is unpacked on the
  fly, the sha256 is of the raw uncompressed bytes, the agent streams it to disk and reads it
  back. qcow2: the sha256 is of the qcow2 file; it needs random access, so the agent downloads
  it into RAM, checks it, converts it onto the disk with qemu-img and compares the two (a qcow2
  larger than the machine's free RAM fails with a message saying to register it as raw).
"""

from __future__ import annotations

import re
from typing import Any

from metald.arch import ARCHES, DEFAULT
from metald.errors import Unprocessable

KINDS = ("stateless", "disk")
FORMATS = ("raw", "qcow2")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ARG_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_FIELDS = {
    "stateless": {"kernel", "initrd", "rootfs", "kernel_args", "arch"},
    "disk": {"url", "sha256", "format", "size_bytes", "arch"},
}


def _is_url(v: str) -> bool:
    return v.startswith(("http://", "https://")) and len(v) > 8 and " " not in v


def _location(field: str, v: Any) -> str:
    """An http(s) URL or a relative path under the assets folder (never outside it)."""
    if not isinstance(v, str) or not v.strip():
        raise Unprocessable(f"{field} must be a URL or a path under the boot assets folder")
    v = v.strip()
    if _is_url(v):
        return v
    if "://" in v or v.startswith("/") or ".." in v.split("/") or " " in v:
        raise Unprocessable(
            f"{field} {v!r} must be an http(s) URL or a relative path under the boot assets "
            "folder (no leading '/', no '..')"
        )
    return v


def _kernel_args(v: Any) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise Unprocessable("kernel_args must be an object of name -> value")
    out: dict[str, str] = {}
    for k, val in v.items():
        if not _ARG_KEY.match(str(k)):
            raise Unprocessable(f"kernel argument name {k!r} may use only letters, digits, _ . -")
        if str(k).startswith("metald."):
            raise Unprocessable(f"kernel argument {k!r}: the metald. prefix is reserved")
        sval = "" if val is None else str(val)
        if any(c.isspace() for c in sval):
            raise Unprocessable(f"kernel argument {k!r} must not contain spaces")
        out[str(k)] = sval
    return out


def normalize_spec(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """The stored spec for an image of ``kind``; raises Unprocessable naming the bad field."""
    if kind not in KINDS:
        raise Unprocessable(f"image kind must be one of {', '.join(KINDS)}, not {kind!r}")
    given = {k for k, v in data.items() if v is not None}
    extra = sorted(given - _FIELDS[kind])
    if extra:
        raise Unprocessable(
            f"a {kind} image does not take {', '.join(extra)}; "
            f"it takes {', '.join(sorted(_FIELDS[kind]))}"
        )
    if kind == "stateless":
        if not data.get("kernel"):
            raise Unprocessable("a stateless image needs a kernel")
        if not data.get("initrd") and not data.get("rootfs"):
            raise Unprocessable("a stateless image needs an initrd or a rootfs (or both)")
        spec: dict[str, Any] = {"kernel": _location("kernel", data["kernel"])}
        for f in ("initrd", "rootfs"):
            if data.get(f):
                spec[f] = _location(f, data[f])
        spec["kernel_args"] = _kernel_args(data.get("kernel_args"))
        spec["arch"] = _arch(data.get("arch"))
        return spec
    url = data.get("url")
    if not isinstance(url, str) or not _is_url(url.strip()):
        raise Unprocessable("a disk image needs url, an http:// or https:// URL")
    sha = str(data.get("sha256") or "").strip().lower()
    if not _SHA256.match(sha):
        raise Unprocessable("sha256 must be the image's SHA-256 as 64 hexadecimal digits")
    fmt = data.get("format") or "raw"
    if fmt == "qcow2" and url.strip().endswith(".gz"):
        raise Unprocessable("a qcow2 image is compressed inside; do not gzip it (no .gz URL)")
    if fmt not in FORMATS:
        raise Unprocessable(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    spec = {"url": url.strip(), "sha256": sha, "format": fmt}
    size = data.get("size_bytes")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise Unprocessable("size_bytes must be a positive whole number")
        spec["size_bytes"] = size
    spec["arch"] = _arch(data.get("arch"))
    return spec


def _arch(v: Any) -> str:
    """The architecture an image is built for: amd64 unless it says (every image was, before
    arm64)."""
    if v is None:
        return DEFAULT
    if v not in ARCHES:
        raise Unprocessable(f"arch must be one of {', '.join(ARCHES)}, not {v!r}")
    return str(v)
