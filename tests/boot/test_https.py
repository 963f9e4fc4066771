"""HTTPS for machines without an operator's PKI: metald's own boot CA (made once, key 0600),
the listener certificate issued from it, the CA's fingerprint on the agents' kernel command line
and the CA at /boot/ca.pem; ``[boot] require_https`` refusing token paths over plain HTTP."""

from __future__ import annotations

import datetime as dt
import hashlib
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509

from metald.boot import pki
from metald.boot.hooks import BootAction, BootTarget, MemoryBootHooks
from metald.boot.http import boot_routes, require_https_middleware
from metald.boot.plane import http_base_url, https_required
from metald.config import ConfigError, load_config
from tests.boot.test_built_ipxe_choice import _cfg, _install
from tests.test_daemon import free_port
from tests.test_listeners import boot_config, running  # noqa: F401  (fixture)

MAC = "52:54:00:00:00:aa"


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_the_ca_is_made_once_with_a_private_key(tmp_path: Path) -> None:
    tls = pki.ensure_boot_tls(tmp_path / "state", "10.0.0.1")
    state = tmp_path / "state"
    assert _mode(state / pki.CA_KEY) == 0o600 and _mode(state / pki.TLS_KEY) == 0o600
    ca = x509.load_pem_x509_certificate(tls.ca_pem)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    leaf.verify_directly_issued_by(ca)
    # an ordinary TLS client that trusts only the CA accepts the listener's certificate name
    ctx = ssl.create_default_context(cadata=tls.ca_pem.decode())
    assert ctx.get_ca_certs()[0]["subject"]
    again = pki.ensure_boot_tls(state, "10.0.0.1")
    assert again.ca_pem == tls.ca_pem and again.cert.read_bytes() == tls.cert.read_bytes()
    # the fingerprint is openssl's
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(state / pki.CA_CERT)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert tls.fingerprint == "sha256:" + out.split("=", 1)[1].strip().replace(":", "").lower()


def test_the_listener_certificate_follows_the_address_and_renews_but_the_ca_stays(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = pki.ensure_boot_tls(state, "10.0.0.1")
    leaf1 = first.cert.read_bytes()
    moved = pki.ensure_boot_tls(state, "boot.example")
    assert moved.ca_pem == first.ca_pem and moved.cert.read_bytes() != leaf1
    names = x509.load_pem_x509_certificate(moved.cert.read_bytes()).extensions
    assert (
        x509.DNSName("boot.example")
        in names.get_extension_for_class(x509.SubjectAlternativeName).value
    )
    leaf2 = moved.cert.read_bytes()
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=380)  # within 30 days of its end
    renewed = pki.ensure_boot_tls(state, "boot.example", now=later)
    assert renewed.ca_pem == first.ca_pem and renewed.cert.read_bytes() != leaf2


def test_half_a_ca_is_reported_not_replaced(tmp_path: Path) -> None:
    state = tmp_path / "state"
    pki.ensure_boot_tls(state, "10.0.0.1")
    (state / pki.CA_CERT).unlink()
    with pytest.raises(pki.PkiError, match="restore it from the backup"):
        pki.ensure_boot_tls(state, "10.0.0.1")
    assert (state / pki.CA_KEY).exists()


def test_a_ca_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    pki.ensure_boot_tls(state, "10.0.0.1")
    (state / pki.CA_KEY).chmod(0o644)
    with pytest.raises(pki.PkiError, match="chmod 600"):
        pki.ensure_boot_tls(state, "10.0.0.1")


async def test_tls_auto_serves_https_pinned_to_metalds_own_ca(tmp_path: Path, running) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    assets = tmp_path / "assets"
    assets.mkdir()
    port = free_port()
    cfg = load_config(
        boot_config(
            tmp_path, f'http_listen = "127.0.0.1:{port}"\ntls_auto = true\n', assets=str(assets)
        )
    )
    assert http_base_url(cfg) == f"https://127.0.0.1:{port}"
    await running(cfg)
    ca_file = tmp_path / "state" / pki.CA_CERT
    assert _mode(tmp_path / "state" / pki.CA_KEY) == 0o600
    trust = ssl.create_default_context(cafile=str(ca_file))
    base = f"https://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/boot/ca.pem", ssl=trust) as r:
            assert r.status == 200 and await r.read() == ca_file.read_bytes()
        async with http.get(f"{base}/boot/{MAC}.ipxe", ssl=trust) as r:
            assert r.status == 200
            script = await r.text()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with http.get(f"{base}/boot/ca.pem") as r:  # the system's roots: not trusted
                await r.read()
    fp = (
        "sha256:"
        + hashlib.sha256(
            x509.load_pem_x509_certificate(ca_file.read_bytes()).public_bytes(
                pki.serialization.Encoding.DER
            )
        ).hexdigest()
    )
    assert f"metald.ca={fp}" in script and f"metald.url={base}" in script


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("tls_auto = true\n", "tls_auto needs boot.http_listen"),
        (
            'http_listen = "127.0.0.1:1"\ntls_auto = true\ntls_cert = "/c"\ntls_key = "/k"\n',
            "not both",
        ),
        ('http_listen = "127.0.0.1:1"\nrequire_https = true\n', "plain HTTP: set boot.tls_cert"),
        ("require_https = true\n", "api.tls_cert"),
        (
            'http_listen = "127.0.0.1:1"\ntls_auto = true\nrequire_https = true\n'
            'http_url = "http://10.0.0.1/"\n',
            "http_url is http://",
        ),
    ],
)
def test_https_settings_that_cannot_work_are_refused(
    tmp_path: Path, extra: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(boot_config(tmp_path, extra, assets=str(tmp_path / "assets")))


def test_require_https_defaults_on_with_a_certificate_and_metalds_ipxe(tmp_path: Path) -> None:
    tls = 'http_listen = "127.0.0.1:1"\ntls_auto = true\n'
    assert not https_required(_cfg(tmp_path, tls), True)  # Debian's iPXE: cannot fetch HTTPS
    _install(tmp_path, "undionly.kpxe", "snponly.efi")
    assert not https_required(_cfg(tmp_path, tls), True)  # arm64 still on Debian's
    _install(tmp_path, "snponly-arm64.efi")
    assert https_required(_cfg(tmp_path, tls), True)
    assert not https_required(_cfg(tmp_path), False)  # no certificate
    assert not https_required(_cfg(tmp_path, tls + "require_https = false\n"), True)
    assert not https_required(_cfg(tmp_path, tls + 'ipxe = "debian"\n'), True)


async def _plain_app(aiohttp_client, require: bool):  # type: ignore[no-untyped-def]
    """The machines' routes over plain HTTP, as a listener without TLS would serve them."""
    hooks = MemoryBootHooks(
        BootTarget(BootAction.DISCOVERY, "d/vmlinuz", "d/initrd", {"metald.token": "s3cret"})
    )
    hooks.targets["52:54:00:00:00:01"] = BootTarget(BootAction.LOCAL)

    async def agent(request: web.Request) -> web.Response:
        return web.json_response({"auth": request.headers.get("Authorization")})

    app = web.Application(middlewares=[require_https_middleware()] if require else [])
    app.add_routes(
        boot_routes(hooks, Path("/nonexistent"), "http://10.0.0.1", require_https=require)
    )
    for path in ("/api/v1/agent/next", "/api/v1/join", "/api/v1/mesh", "/api/v1/health/report"):
        app.router.add_post(path, agent)
    return await aiohttp_client(app)


@pytest.mark.parametrize(
    "path", ["/api/v1/agent/next", "/api/v1/join", "/api/v1/mesh", "/api/v1/health/report"]
)
async def test_require_https_refuses_token_paths_over_plain_http(aiohttp_client, path: str) -> None:  # type: ignore[no-untyped-def]
    c = await _plain_app(aiohttp_client, True)
    r = await c.post(path, headers={"Authorization": "Bearer x"})
    assert r.status == 403 and r.content_type == "application/problem+json"
    body = await r.json()
    assert body["title"] == "HTTPS required" and "https://" in body["detail"]
    off = await _plain_app(aiohttp_client, False)
    assert (await off.post(path)).status == 200  # what plain HTTP did before


async def test_require_https_refuses_scripts_that_carry_a_token(aiohttp_client) -> None:  # type: ignore[no-untyped-def]
    c = await _plain_app(aiohttp_client, True)
    r = await c.get(f"/boot/{MAC}.ipxe")
    assert r.status == 403 and "s3cret" not in await r.text()
    assert "boot.require_https" in (await r.json())["detail"]
    # a script with no token (boot from disk) still goes to any iPXE
    r = await c.get("/boot/52:54:00:00:00:01.ipxe")
    assert r.status == 200 and "exit 0" in await r.text()
    off = await _plain_app(aiohttp_client, False)
    assert "s3cret" in await (await off.get(f"/boot/{MAC}.ipxe")).text()


def test_an_operator_chain_without_its_root_is_named_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pin is the chain's last certificate unless boot.tls_ca names the root: a chain that
    stops below its root is said at start (the agents could not verify against its leaf)."""
    issuer = pki.ensure_boot_tls(tmp_path / "state", "10.0.0.1")  # a leaf issued by a CA
    with caplog.at_level("WARNING", logger="metald.boot.pki"):
        leaf_only = pki.operator_tls(str(issuer.cert), str(issuer.key), "")
    assert "set boot.tls_ca" in caplog.text
    assert leaf_only.ca_pem == issuer.cert.read_bytes()
    caplog.clear()
    ca_file = tmp_path / "state" / pki.CA_CERT
    with caplog.at_level("WARNING", logger="metald.boot.pki"):
        named = pki.operator_tls(str(issuer.cert), str(issuer.key), str(ca_file))
    assert named.fingerprint == issuer.fingerprint and caplog.text == ""


def test_tls_auto_defaults_on_only_with_metalds_ipxe_built_with_its_own_ca(
    tmp_path: Path,
) -> None:
    """Unset, ``[boot] tls_auto`` is on when metald's own iPXE is installed for every
    architecture and trusts this state folder's CA (``ipxe/ca.pem`` = ``boot-ca.pem``): then
    require_https defaults on too. Off, with the sentence saying why, without the build, with
    a build trusting another CA, or before the CA is made. Fails on the old code (tls_auto
    defaulted to false)."""
    listen = 'http_listen = "127.0.0.1:1"\n'
    cfg, why = pki.resolve_tls_auto(_cfg(tmp_path, listen))
    assert cfg.boot.tls_auto is False and why and "not installed for every architecture" in why
    assert "python -m bootassets ipxe --ca" in why
    _install(tmp_path, "undionly.kpxe", "snponly.efi", "snponly-arm64.efi")
    built_ca = tmp_path / "assets" / "ipxe" / "ca.pem"
    other, _ = pki.ensure_ca(tmp_path / "other")  # a build trusting another CA
    built_ca.write_bytes((tmp_path / "other" / pki.CA_CERT).read_bytes())
    cfg, why = pki.resolve_tls_auto(_cfg(tmp_path, listen))
    assert cfg.boot.tls_auto is False and why and "metald boot-ca makes it" in why
    pki.ensure_ca(tmp_path / "state")
    cfg, why = pki.resolve_tls_auto(_cfg(tmp_path, listen))
    assert cfg.boot.tls_auto is False and why and "not this metald's CA" in why
    built_ca.write_bytes((tmp_path / "state" / pki.CA_CERT).read_bytes())
    cfg, why = pki.resolve_tls_auto(_cfg(tmp_path, listen))
    assert cfg.boot.tls_auto is True and why is None
    assert cfg.boot.tls and http_base_url(cfg) == "https://10.0.0.1:1"
    assert https_required(cfg, True)
    # as set wins; no provisioning listener or an operator certificate: not applicable
    assert (
        pki.resolve_tls_auto(_cfg(tmp_path, listen + "tls_auto = false\n"))[0].boot.tls_auto
        is False
    )
    assert pki.resolve_tls_auto(_cfg(tmp_path))[0].boot.tls_auto is False
    assert pki.resolve_tls_auto(_cfg(tmp_path))[1] is None
    assert (
        pki.resolve_tls_auto(_cfg(tmp_path, listen + 'ipxe = "debian"\n'))[0].boot.tls_auto is False
    )


def test_metald_boot_ca_makes_the_ca_to_build_ipxe_with(tmp_path: Path) -> None:
    """``metald boot-ca`` makes the CA a first start with tls_auto would, and prints its path
    (the --ca of python -m bootassets ipxe); again, the same CA."""
    from metald.__main__ import main

    conf = tmp_path / "metald.toml"
    conf.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    assert main(["boot-ca", "--config", str(conf)]) == 0
    ca = tmp_path / "state" / pki.CA_CERT
    first = ca.read_bytes()
    assert _mode(tmp_path / "state" / pki.CA_KEY) == 0o600
    assert main(["boot-ca", "--config", str(conf)]) == 0
    assert ca.read_bytes() == first
