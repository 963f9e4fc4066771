"""Kernel and initrd over plain HTTP, checked by iPXE (``[boot] assets_http_listen``): metald's
image-signing certificate (issued by its boot CA, code signing only), detached CMS signatures
that verify against the boot CA (openssl, as iPXE's imgverify does) and fail on a changed
byte, scripts that load from the plain listener and verify before booting, and the report of a
failed check as a ``boot.image_refused`` event. The real iPXE doing it in QEMU is
tests/e2e/test_signed_assets_lab.py (METALD_LAB_LONG=1)."""

from __future__ import annotations

import datetime as dt
import subprocess
from pathlib import Path

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from sqlmodel import select
from yarl import URL

from metald.boot import pki, signing
from metald.boot.hooks import BootAction, BootTarget
from metald.boot.http import asset_routes, boot_routes
from metald.boot.ipxe import SignedAssets, render_boot_script
from metald.config import EnrollConfig, load_config
from metald.enrollment import enrollment_boot_hooks
from metald.store.models import Event
from tests.dhcp_leases import add_lease
from tests.test_listeners import running  # noqa: F401  (fixture)

MAC = "52:54:00:aa:00:41"
SIGNED = SignedAssets("http://10.0.0.1:8082", signing.SIGNER_NAME)
TARGET = BootTarget(
    BootAction.DISCOVERY, "discovery/vmlinuz", "discovery/initrd.img", {"metald.token": "t0k"}
)


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two boot CAs, made once for the module (an RSA 3072 key takes seconds on a busy box)."""
    out = []
    for name in ("ca1", "ca2"):
        folder = tmp_path_factory.mktemp(name)
        pki.ensure_ca(folder)
        out.append(folder)
    return out


def _state(ca: Path, into: Path) -> Path:
    """A state folder holding a copy of the boot CA in ``ca``."""
    into.mkdir(mode=0o700, parents=True)
    for name in (pki.CA_CERT, pki.CA_KEY):
        (into / name).write_bytes((ca / name).read_bytes())
    (into / pki.CA_KEY).chmod(0o600)
    return into


def _openssl_verify(sig: Path, content: Path, ca: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["openssl", "cms", "-verify", "-binary", "-inform", "DER", "-in", str(sig),
         "-content", str(content), "-CAfile", str(ca), "-purpose", "any", "-out", "/dev/null"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_the_signing_certificate_is_code_signing_only_from_the_boot_ca(
    tmp_path: Path, cas: list[Path]
) -> None:
    state = _state(cas[0], tmp_path / "state")
    s = signing.ensure_signer(state)
    ca = x509.load_pem_x509_certificate((state / pki.CA_CERT).read_bytes())
    s.cert.verify_directly_issued_by(ca)
    eku = s.cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CODE_SIGNING]  # not a TLS server certificate
    assert s.cert.subject.rfc4514_string() == f"CN={signing.SIGNER_NAME}"
    assert (state / signing.SIGN_KEY).stat().st_mode & 0o777 == 0o600
    assert signing.ensure_signer(state).cert == s.cert  # kept
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=380)
    assert signing.ensure_signer(state, now=later).cert != s.cert  # issued again near its end
    # the listener's certificate cannot sign images: it is no code-signing certificate
    tls = pki.ensure_boot_tls(state, "10.0.0.1")
    leaf = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    assert (
        ExtendedKeyUsageOID.CODE_SIGNING
        not in leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )


def test_a_signature_verifies_against_the_ca_and_fails_on_one_changed_byte(
    tmp_path: Path, cas: list[Path]
) -> None:
    state = _state(cas[0], tmp_path / "state")
    s = signing.ensure_signer(state)
    data = tmp_path / "vmlinuz"
    data.write_bytes(bytes(range(256)) * 4000)
    sig = tmp_path / "vmlinuz.sig"
    sig.write_bytes(signing.sign(s, data.read_bytes()))
    ok = _openssl_verify(sig, data, state / pki.CA_CERT)
    assert ok.returncode == 0, ok.stderr
    # no signed attributes: iPXE's cms.c checks the signature over the content digest itself
    dump = subprocess.run(
        ["openssl", "cms", "-cmsout", "-print", "-inform", "DER", "-in", str(sig)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "signedAttrs: <ABSENT>" in " ".join(dump.split()) and "eContent: <ABSENT>" in dump
    # signed from the file in chunks: the same bytes as signing it from memory
    assert signing.sign_file(s, data) == sig.read_bytes()
    raw = bytearray(data.read_bytes())
    raw[123456] ^= 1
    data.write_bytes(bytes(raw))
    assert _openssl_verify(sig, data, state / pki.CA_CERT).returncode != 0
    # a CA that is not metald's does not vouch for it either
    other = signing.ensure_signer(_state(cas[1], tmp_path / "other"))
    data.write_bytes(bytes(range(256)) * 4000)
    assert _openssl_verify(sig, data, tmp_path / "other" / pki.CA_CERT).returncode != 0
    assert other.cert != s.cert


def test_the_script_loads_from_the_plain_listener_and_verifies_before_booting() -> None:
    body = render_boot_script(TARGET, mac=MAC, public_url="https://10.0.0.1:8443", signed=SIGNED)
    lines = body.splitlines()
    kernel = next(i for i, ln in enumerate(lines) if ln.startswith("kernel "))
    assert lines[kernel].startswith(
        "kernel --name vmlinuz http://10.0.0.1:8082/boot/assets/discovery/vmlinuz "
    )
    assert (
        "initrd --name initrd.img http://10.0.0.1:8082/boot/assets/discovery/initrd.img"
        in (lines[kernel + 1])
    )
    checks = [
        f"imgverify --signer {signing.SIGNER_NAME} vmlinuz "
        "https://10.0.0.1:8443/boot/signatures/discovery/vmlinuz || goto refused",
        f"imgverify --signer {signing.SIGNER_NAME} initrd.img "
        "https://10.0.0.1:8443/boot/signatures/discovery/initrd.img || goto refused",
    ]
    boot = lines.index("boot || goto untrusted")
    assert all(lines.index(c) < boot for c in checks)
    assert lines.index("imgtrust") == boot - 1  # only a verified image runs
    refused = lines[lines.index(":refused") :]
    assert any(f"/boot/image-refused/{MAC}/" in ln for ln in refused)
    assert "boot" not in [ln.split()[0] for ln in refused if ln.strip()]  # never boots it
    # ... and loads again with this script, whose token is unspent (a script fetched again
    # would carry none: one token per boot)
    assert refused[: refused.index(":untrusted")][-1] == "goto load"
    assert lines.index(":load") == kernel - 1
    # the signatures come over HTTPS only: over plain HTTP they would not stop a replay
    plain = render_boot_script(TARGET, mac=MAC, public_url="http://10.0.0.1:8080", signed=SIGNED)
    assert "imgverify" not in plain and "8082" not in plain
    # another server's kernel (a tenant's stateless image URL) is loaded as given, unchecked
    other = BootTarget(BootAction.PROVISION, "https://images.example/k", "discovery/initrd.img")
    body = render_boot_script(other, mac=MAC, public_url="https://10.0.0.1:8443", signed=SIGNED)
    assert "kernel https://images.example/k " in body
    assert "imgverify" in body and " vmlinuz https://" not in body


async def test_signatures_follow_the_file_and_failures_are_recorded(  # type: ignore[no-untyped-def]
    aiohttp_client, store, tmp_path: Path, cas: list[Path]
) -> None:
    assets = tmp_path / "assets"
    (assets / "discovery").mkdir(parents=True)
    kernel = assets / "discovery" / "vmlinuz"
    kernel.write_bytes(b"kernel v1" * 5000)
    state = _state(cas[0], tmp_path / "state")
    signer = signing.AssetSigner(signing.ensure_signer(state))
    hooks = enrollment_boot_hooks(store, "t", EnrollConfig(), leased_clients_only=True)
    await hooks.client_seen(MAC, arch="bios", network="prov", relay_agent=None)
    app = web.Application()
    app.add_routes(
        boot_routes(
            hooks, assets, "https://10.0.0.1:8443", signed=SIGNED, signer=signer, ca_pem=None
        )
    )
    c = await aiohttp_client(app)
    r = await c.get("/boot/signatures/discovery/vmlinuz")
    assert r.status == 200 and r.content_type == "application/pkcs7-signature"
    sig = tmp_path / "sig"
    sig.write_bytes(await r.read())
    assert _openssl_verify(sig, kernel, state / pki.CA_CERT).returncode == 0
    # the file replaced (a new discovery image): the next signature is the new file's
    kernel.write_bytes(b"kernel v2" * 5000)
    sig.write_bytes(await (await c.get("/boot/signatures/discovery/vmlinuz")).read())
    assert _openssl_verify(sig, kernel, state / pki.CA_CERT).returncode == 0
    (assets / ".secret").write_text("x")
    for bad in (
        "/boot/signatures/%2e%2e/state/boot-ca.key",
        "/boot/signatures/.secret",
        "/boot/signatures/nope",
    ):
        r = await c.get(URL(bad, encoded=True))
        assert r.status in (403, 404) and r.content_type == "application/problem+json"

    # A failed check: only the lease holder's report counts, one event per half minute.
    url = f"/boot/image-refused/{MAC}/0x2f0b9e3c?file=discovery/initrd.img"
    r = await c.get(url)
    assert r.status == 403
    add_lease(store, MAC, "127.0.0.1")
    assert (await c.get(url)).status == 200
    assert await (await c.get(url)).text() == "already recorded\n"
    with store.session() as s:
        (ev,) = s.exec(select(Event).where(Event.kind == "boot.image_refused")).all()
    assert ev.data == {  # type: ignore[comparison-overlap]
        "mac": MAC,
        "file": "discovery/initrd.img",
        "errno": "0x2f0b9e3c",
        "client": "127.0.0.1",
    }
    assert ev.reason and "failed iPXE's signature check" in ev.reason


async def test_the_plain_listener_serves_assets_and_nothing_else(  # type: ignore[no-untyped-def]
    aiohttp_client, tmp_path: Path
) -> None:
    (tmp_path / "discovery").mkdir()
    (tmp_path / "discovery" / "vmlinuz").write_bytes(b"k" * 100)
    app = web.Application()
    app.add_routes(asset_routes(tmp_path))
    c = await aiohttp_client(app)
    assert await (await c.get("/boot/assets/discovery/vmlinuz")).read() == b"k" * 100
    for path in (f"/boot/{MAC}.ipxe", "/boot/signatures/discovery/vmlinuz", "/api/v1/join"):
        assert (await c.get(path)).status == 404


def test_assets_http_listen_settings_that_cannot_work_are_refused(
    tmp_path: Path, cas: list[Path]
) -> None:
    from metald.config import ConfigError
    from metald.daemon import _signed_assets

    base = {
        "METALD_BOOT__HTTP_LISTEN": "10.0.0.1:8443",
        "METALD_BOOT__SERVER_ADDRESS": "10.0.0.1",
        "METALD_BOOT__ENABLED": "true",
        "METALD_BOOT__ASSETS_DIR": str(tmp_path / "assets"),
        "METALD_STATE_DIR": str(tmp_path / "state"),
    }
    with pytest.raises(ConfigError, match="must differ"):
        load_config(None, environ={**base, "METALD_BOOT__ASSETS_HTTP_LISTEN": "10.0.0.1:8443"})
    _state(cas[0], tmp_path / "state")
    on = load_config(
        None,
        environ={
            **base,
            "METALD_BOOT__TLS_AUTO": "true",
            "METALD_BOOT__ASSETS_HTTP_LISTEN": ":8082",
        },
    )
    signed, signer = _signed_assets(on)
    assert signed == SignedAssets("http://10.0.0.1:8082", signing.SIGNER_NAME)
    assert signer is not None and (tmp_path / "state" / signing.SIGN_CERT).exists()
    # without metald's own CA there is no authenticated channel for the signatures: unused
    off = load_config(None, environ={**base, "METALD_BOOT__ASSETS_HTTP_LISTEN": ":8082"})
    assert _signed_assets(off) == (None, None)


async def test_a_daemon_serves_images_plainly_and_their_signatures_pinned(  # type: ignore[no-untyped-def]
    tmp_path: Path,
    cas: list[Path],
    running,  # noqa: F811
) -> None:
    """The whole daemon with tls_auto and assets_http_listen: the plain port serves the assets
    folder and nothing else (no script, no signature, no API); the HTTPS script loads from it
    and names signatures that the HTTPS listener serves and openssl verifies against the CA
    the listener chains to."""
    import ssl

    import aiohttp

    from tests.test_daemon import free_port
    from tests.test_listeners import boot_config

    assets = tmp_path / "assets"
    (assets / "discovery").mkdir(parents=True)
    (assets / "discovery" / "vmlinuz").write_bytes(b"kernel" * 1000)
    (assets / "discovery" / "initrd.img").write_bytes(b"initrd" * 1000)
    _state(cas[0], tmp_path / "state")
    port, plain = free_port(), free_port()
    cfg = load_config(
        boot_config(
            tmp_path,
            f'http_listen = "127.0.0.1:{port}"\ntls_auto = true\n'
            f'assets_http_listen = "127.0.0.1:{plain}"\nscript_clients = "any"\n',
            assets=str(assets),
        )
    )
    await running(cfg)
    trust = ssl.create_default_context(cafile=str(tmp_path / "state" / pki.CA_CERT))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"https://127.0.0.1:{port}/boot/{MAC}.ipxe", ssl=trust) as r:
            script = await r.text()
        assert f"http://127.0.0.1:{plain}/boot/assets/discovery/initrd.img" in script, script
        assert f"https://127.0.0.1:{port}/boot/signatures/discovery/initrd.img" in script
        async with http.get(f"http://127.0.0.1:{plain}/boot/assets/discovery/initrd.img") as r:
            (tmp_path / "initrd").write_bytes(await r.read())
        for path in (f"/boot/{MAC}.ipxe", "/boot/signatures/discovery/initrd.img", "/boot/ca.pem"):
            async with http.get(f"http://127.0.0.1:{plain}{path}") as r:
                assert r.status == 404, path
        url = f"https://127.0.0.1:{port}/boot/signatures/discovery/initrd.img"
        async with http.get(url, ssl=trust) as r:
            (tmp_path / "sig").write_bytes(await r.read())
    ok = _openssl_verify(tmp_path / "sig", tmp_path / "initrd", tmp_path / "state" / pki.CA_CERT)
    assert ok.returncode == 0, ok.stderr
