"""The console's cookie and Origin rules, on requests built in process."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from api.ui.guard import COOKIE, origin_ok, set_cookie


def _cookie_header(secure_scheme: bool) -> str:
    req = make_mocked_request("POST", "/ui/login", headers={"Host": "metald.example"})
    if secure_scheme:
        req = req.clone(scheme="https")
    resp = web.Response()
    set_cookie(resp, req, "sid")
    return resp.cookies[COOKIE].output(header="").strip()


def test_cookie_is_httponly_strict_under_ui_and_secure_under_tls() -> None:
    plain = _cookie_header(False)
    for attr in ("HttpOnly", "SameSite=Strict", "Path=/ui"):
        assert attr in plain
    assert "Secure" not in plain
    assert "Secure" in _cookie_header(True)


def test_origin_must_be_our_own() -> None:
    def req(origin: str | None) -> web.Request:
        headers = {"Host": "metald.example:8443"}
        if origin is not None:
            headers["Origin"] = origin
        return make_mocked_request("POST", "/ui/machines/bulk", headers=headers).clone(
            scheme="https"
        )

    assert origin_ok(req("https://metald.example:8443"), required=True)
    assert not origin_ok(req("http://metald.example:8443"), required=True)  # another scheme
    assert not origin_ok(req("https://metald.example"), required=True)  # another port
    assert not origin_ok(req("https://evil.example"), required=False)
    assert not origin_ok(req("null"), required=False)  # sandboxed frames, file: pages
    assert not origin_ok(req(None), required=True)
    assert origin_ok(req(None), required=False)
