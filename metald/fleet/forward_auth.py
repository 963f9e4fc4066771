"""Proof that a request was forwarded by another instance of the fleet, not sent by a client.

An instance that forwards a request to the instance owning a BMC (``api.routes_bmc``,
``api.routes_console``) marks it ``X-Metald-Forwarded-By: <instance>``, and the owner then runs
it where it is instead of forwarding it again. A client could set that header itself (on the
console route a non-owner would then open its own SOL session to another instance's BMC), so
the mark carries ``X-Metald-Forward-Auth``: an HMAC-SHA256 over the method, the path with its
query, the instance id, a Unix timestamp and a random nonce, keyed with a key derived from the
shared secrets key (``SecretBox.derive_key``), which only instances hold. ``verify`` accepts it
for ``WINDOW_S`` seconds either side of its own clock and each nonce once (replays inside the
window are refused too); anything else is a 403 (``ForwardRefused``), never a silent forward.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import weakref
from collections.abc import Mapping

from metald.errors import MetaldError
from metald.secrets import SecretBox

#: The forwarding instance's id; set by instances only, and only with a valid ``AUTH``.
FORWARDED = "X-Metald-Forwarded-By"
#: ``t=<unix seconds>,n=<nonce>,s=<hex HMAC>``.
AUTH = "X-Metald-Forward-Auth"
#: How far a forward's timestamp may be from the receiving instance's clock (seconds).
WINDOW_S = 30.0
#: Nonces remembered (a replay inside the window is refused); a flood beyond this is refused
#: too rather than forgetting nonces still inside the window.
MAX_NONCES = 100_000
_PURPOSE = "forward-auth/v1"


class ForwardRefused(MetaldError):
    status = 403
    title = "Forwarded request refused"


def _mac(key: bytes, method: str, path_qs: str, instance: str, ts: int, nonce: str) -> str:
    msg = "\n".join((method.upper(), path_qs, instance, str(ts), nonce)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


class _Verifier:
    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def remember(self, nonce: str, now: float) -> bool:
        with self.lock:
            if len(self.seen) >= MAX_NONCES:
                self.seen = {n: exp for n, exp in self.seen.items() if exp > now}
            if nonce in self.seen or len(self.seen) >= MAX_NONCES:
                return False
            self.seen[nonce] = now + 2 * WINDOW_S
            return True


_verifiers: weakref.WeakKeyDictionary[SecretBox, _Verifier] = weakref.WeakKeyDictionary()


def _verifier(box: SecretBox) -> _Verifier:
    v = _verifiers.get(box)
    if v is None:
        v = _verifiers[box] = _Verifier(box.derive_key(_PURPOSE))
    return v


def sign(box: SecretBox, method: str, path_qs: str, instance: str) -> dict[str, str]:
    """The headers that mark a request this instance forwards (``method path_qs``, the path
    as the receiving instance will see it)."""
    ts, nonce = int(time.time()), secrets.token_urlsafe(16)
    mac = _mac(_verifier(box).key, method, path_qs, instance, ts, nonce)
    return {FORWARDED: instance, AUTH: f"t={ts},n={nonce},s={mac}"}


def verify(box: SecretBox, method: str, path_qs: str, headers: Mapping[str, str]) -> str | None:
    """The forwarding instance's id if the request carries a valid forward mark; None when it
    carries none (a client's request). ForwardRefused when it carries a forged, altered, stale
    or replayed one."""
    instance = headers.get(FORWARDED)
    auth = headers.get(AUTH)
    if instance is None and auth is None:
        return None
    refused = ForwardRefused(
        f"{FORWARDED} is set only by metald instances forwarding to a BMC's owner, with a "
        f"signed {AUTH} at most {WINDOW_S:.0f} s old; this one did not verify. Send the "
        "request without these headers (if instances forward it: check that they share the "
        "secrets key and that their clocks agree)"
    )
    if not instance or not auth:
        raise refused
    try:
        fields = dict(part.split("=", 1) for part in auth.split(","))
        ts, nonce, mac = int(fields["t"]), fields["n"], fields["s"]
    except (KeyError, ValueError):
        raise refused from None
    v = _verifier(box)
    now = time.time()
    good = hmac.compare_digest(_mac(v.key, method, path_qs, instance, ts, nonce), mac)
    if not good or abs(now - ts) > WINDOW_S or not v.remember(nonce, now):
        raise refused
    return instance
