"""What the daemon serves, and to whom: the assets root is never the state folder, the state
folder is private, the provisioning listener answers machines' endpoints only, and the staff
API speaks TLS when given a certificate. In-process daemons on loopback."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from yarl import URL

from metald.config import Config, ConfigError, load_config
from metald.daemon import Daemon
from tests.test_daemon import free_port


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def boot_config(tmp_path: Path, extra: str = "", *, assets: str | None = None) -> Path:
    """A daemon with the boot plane on (no DHCP, no interfaces: HTTP boot only)."""
    assets_line = "" if assets is None else f'assets_dir = "{assets}"\n'
    return _write(
        tmp_path / "metald.toml",
        f'state_dir = "{tmp_path / "state"}"\n[api]\nlisten = "127.0.0.1:{free_port()}"\n'
        f'[boot]\nenabled = true\ndhcp_mode = "off"\nserver_address = "127.0.0.1"\n'
        f"{assets_line}{extra}",
    )


@pytest.mark.parametrize(
    ("assets", "words"),
    [
        (None, ["boot.assets_dir", "required"]),
        ("{state}", ["boot.assets_dir", "is state_dir"]),
        ("{state}/assets", ["boot.assets_dir", "sits inside state_dir"]),
        ("{tmp}", ["boot.assets_dir", "contains state_dir"]),
        ("{state}/../state/.", ["boot.assets_dir", "is state_dir"]),
    ],
)
def test_a_config_that_would_serve_the_state_folder_is_refused(
    tmp_path: Path, assets: str | None, words: list[str]
) -> None:
    """The default config with the boot plane on used to serve <state_dir> as /boot/assets/:
    admin.token, secrets.key and metald.db to anyone on the provisioning network."""
    state = tmp_path / "state"
    path = None if assets is None else assets.format(state=state, tmp=tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(boot_config(tmp_path, assets=path))
    for w in words:
        assert w in str(e.value)
    assert "state_dir" in str(e.value)


def test_secret_files_kept_elsewhere_may_not_sit_in_the_assets_folder(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    conf = boot_config(tmp_path, assets=str(assets))
    text = conf.read_text()
    _write(conf, text + f'[auth]\nadmin_token_file = "{assets}/admin.token"\n')
    with pytest.raises(ConfigError, match=r"auth.admin_token_file: .* is inside boot.assets_dir"):
        load_config(conf)
    _write(conf, text.replace("[api]", f'[store]\nurl = "sqlite:///{assets}/sub/m.db"\n[api]'))
    with pytest.raises(ConfigError, match=r"store.url: .* is inside boot.assets_dir"):
        load_config(conf)
    _write(conf, text)
    assert load_config(conf).boot.assets_dir == str(assets)


def test_daemon_refuses_a_config_built_in_code(tmp_path: Path) -> None:
    cfg = Config.model_validate(
        {"state_dir": str(tmp_path), "boot": {"enabled": True, "server_address": "127.0.0.1"}}
    )
    with pytest.raises(ConfigError, match="boot.assets_dir"):
        Daemon(cfg)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Daemon]:
    """Started by the test through ``start(cfg)``; stopped here."""
    started: list[Daemon] = []

    async def start(cfg: Config) -> Daemon:
        d = Daemon(cfg)
        started.append(d)
        await d.start()
        return d

    yield start  # type: ignore[misc]
    for d in started:
        await d.stop()


async def test_boot_assets_serve_neither_state_nor_dot_files(tmp_path: Path, running) -> None:  # type: ignore[no-untyped-def]
    assets = tmp_path / "assets"
    (assets / "discovery").mkdir(parents=True)
    (assets / "discovery" / "vmlinuz").write_bytes(b"kernel")
    (assets / ".htpasswd").write_text("admin:x")
    (assets / ".git").mkdir()
    (assets / ".git" / "config").write_text("[core]")
    (assets / "discovery" / ".vmlinuz.swp").write_text("swap")
    cfg = load_config(boot_config(tmp_path, assets=str(assets)))
    await running(cfg)
    base = f"http://{cfg.api.listen}/boot/assets"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/discovery/vmlinuz") as r:
            assert r.status == 200 and await r.read() == b"kernel"
        for name in (
            "admin.token",
            "secrets.key",
            "metald.db",
            "../state/admin.token",
            ".htpasswd",
            ".git/config",
            "discovery/.vmlinuz.swp",
        ):
            async with http.get(f"{base}/{name}") as r:
                assert r.status in (403, 404), name
                assert r.content_type == "application/problem+json", name
                body = await r.json()
                assert body["status"] == r.status and body["detail"], name
        async with http.get(f"http://{cfg.api.listen}/boot/nota-mac.ipxe") as r:
            assert r.status == 404 and r.content_type == "application/problem+json"


async def test_state_folder_and_database_are_private(tmp_path: Path, running) -> None:  # type: ignore[no-untyped-def]
    """An existing 0755 state folder with a 0644 database (as older versions left them) is
    narrowed at start; what the daemon creates is for its user only."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    (state / "metald.db").touch()  # an empty file is an empty SQLite database
    os.chmod(state / "metald.db", 0o644)
    port = free_port()
    cfg = load_config(
        _write(tmp_path / "m.toml", f'state_dir = "{state}"\n[api]\nlisten = "127.0.0.1:{port}"\n')
    )
    before = os.umask(0o022)
    try:
        await running(cfg)
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        files = [p for p in state.iterdir() if p.name.startswith("metald.db")]
        assert {p.name for p in files} >= {"metald.db"}
        for p in files + [state / "secrets.key", state / "admin.token"]:
            assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
    finally:
        os.umask(before)


def test_existing_database_files_are_narrowed(tmp_path: Path) -> None:
    from metald.daemon import secure_state_dir

    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    for name in ("metald.db", "metald.db-wal", "other.txt"):
        (state / name).touch()
        os.chmod(state / name, 0o644)
    changed = secure_state_dir(state)
    assert len(changed) == 3
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "metald.db").stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "metald.db-wal").stat().st_mode) == 0o600
    assert secure_state_dir(state) == []


async def test_provisioning_and_staff_listeners_are_apart(tmp_path: Path, running) -> None:  # type: ignore[no-untyped-def]
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "ipxe.efi").write_bytes(b"efi")
    prov = f"127.0.0.1:{free_port()}"
    cfg = load_config(boot_config(tmp_path, f'http_listen = "{prov}"\n', assets=str(assets)))
    await running(cfg)
    admin = (tmp_path / "state" / "admin.token").read_text().strip()
    auth = {"Authorization": f"Bearer {admin}"}
    staff = f"http://{cfg.api.listen}"
    machines = f"http://{prov}"
    async with aiohttp.ClientSession() as http:
        # Machines' endpoints answer on the provisioning listener...
        async with http.get(f"{machines}/boot/assets/ipxe.efi") as r:
            assert r.status == 200
        async with http.get(f"{machines}/boot/52:54:00:00:00:aa.ipxe") as r:
            assert r.status == 200 and "#!ipxe" in await r.text()
            assert f"{machines}/boot/assets/" in await r.text()  # machines use this listener
        async with http.post(
            f"{machines}/api/v1/join", json={"token": "x", "public_key": "y"}
        ) as r:
            assert r.status in (401, 422)  # reached the join handler
        async with http.get(f"{machines}/api/v1/agent/provision") as r:
            assert r.status == 401  # reached the agent route, which wants its token
        # ... and nothing else does, even with an admin token.
        for path in ("/api/v1/machines", "/api/v1/tokens", "/healthz", "/api/v1/openapi.json"):
            async with http.get(f"{machines}{path}", headers=auth) as r:
                assert r.status == 404, path
                assert r.content_type == "application/problem+json"
                assert "provisioning listener" in (await r.json())["detail"]
        for raw in (
            "/api/v1/agent/../machines",
            "/boot/../api/v1/machines",
            "/api/v1/agent/%2e%2e/machines",
            "/boot/%2e%2e/api/v1/tokens",
            "/api/v1/join/../tokens",
        ):
            async with http.get(URL(f"{machines}{raw}", encoded=True), headers=auth) as r:
                assert r.status == 404, raw
        # The staff API serves the fleet, not the machines' endpoints.
        async with http.get(f"{staff}/api/v1/machines", headers=auth) as r:
            assert r.status == 200
        for path in ("/boot/assets/ipxe.efi", "/boot/52:54:00:00:00:aa.ipxe"):
            async with http.get(f"{staff}{path}") as r:
                assert r.status == 404, path
        async with http.post(f"{staff}/api/v1/join", json={"token": "x", "public_key": "y"}) as r:
            assert r.status == 404


async def test_one_listener_serves_both_with_a_warning(tmp_path: Path, running, caplog) -> None:  # type: ignore[no-untyped-def]
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "ipxe.efi").write_bytes(b"efi")
    cfg = load_config(boot_config(tmp_path, assets=str(assets)))
    await running(cfg)
    assert any("boot.http_listen is empty" in r.getMessage() for r in caplog.records)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{cfg.api.listen}/boot/assets/ipxe.efi") as r:
            assert r.status == 200
        async with http.get(f"http://{cfg.api.listen}/healthz") as r:
            assert r.status == 200


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "metald-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "api.crt", tmp_path / "api.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_staff_api_over_tls(tmp_path: Path, running) -> None:  # type: ignore[no-untyped-def]
    cert, key = self_signed(tmp_path)
    port = free_port()
    conf = _write(
        tmp_path / "m.toml",
        f'state_dir = "{tmp_path / "state"}"\n[api]\nlisten = "127.0.0.1:{port}"\n'
        f'tls_cert = "{cert}"\ntls_key = "{key}"\n',
    )
    await running(load_config(conf))
    trust = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession() as http:
        async with http.get(f"https://127.0.0.1:{port}/healthz", ssl=trust) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                await r.read()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with http.get(f"https://127.0.0.1:{port}/healthz") as r:
                await r.read()


async def test_provisioning_listener_over_tls(tmp_path: Path, running) -> None:  # type: ignore[no-untyped-def]
    """boot.tls_cert: machines reach their endpoints over HTTPS only, and the scripts point
    them at https URLs (what metald's own iPXE, pinned to the CA, fetches)."""
    tls = tmp_path / "tls"
    tls.mkdir()
    cert, key = self_signed(tls)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "ipxe.efi").write_bytes(b"efi")
    port = free_port()
    extra = f'http_listen = "127.0.0.1:{port}"\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
    cfg = load_config(boot_config(tmp_path, extra, assets=str(assets)))
    await running(cfg)
    trust = ssl.create_default_context(cafile=str(cert))
    machines = f"https://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{machines}/boot/52:54:00:00:00:aa.ipxe", ssl=trust) as r:
            assert r.status == 200
            assert f"{machines}/boot/assets/" in await r.text()  # https all the way
        async with http.get(f"{machines}/boot/assets/ipxe.efi", ssl=trust) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"http://127.0.0.1:{port}/boot/assets/ipxe.efi") as r:
                await r.read()
        # a client that does not trust the certificate's CA gets nothing
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with http.get(f"{machines}/boot/52:54:00:00:00:aa.ipxe") as r:
                await r.read()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ('http_listen = "127.0.0.1:1"\ntls_cert = "/x.crt"\n', "set both"),
        ('tls_cert = "/x.crt"\ntls_key = "/x.key"\n', "needs boot.http_listen"),
    ],
)
def test_provisioning_tls_needs_both_files_and_its_listener(
    tmp_path: Path, extra: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(boot_config(tmp_path, extra, assets=str(tmp_path / "assets")))


def test_a_tls_key_may_not_sit_in_the_assets_folder(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    extra = (
        f'http_listen = "127.0.0.1:1"\ntls_cert = "{assets}/c.pem"\ntls_key = "{assets}/k.pem"\n'
    )
    with pytest.raises(ConfigError, match=r"boot.tls_key: .* is inside boot.assets_dir"):
        load_config(boot_config(tmp_path, extra, assets=str(assets)))


def test_tls_needs_both_files(tmp_path: Path) -> None:
    conf = _write(tmp_path / "m.toml", '[api]\ntls_cert = "/x.crt"\n')
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        load_config(conf)


def test_hidden_files_are_refused_by_the_shared_path_check(tmp_path: Path) -> None:
    """One rule for TFTP and HTTP (metald/boot/paths.py): no dot file or dot folder."""
    from metald.boot.paths import PathRefused, safe_path

    root = tmp_path / "root"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "config").write_text("[core]")
    (root / ".htpasswd").write_text("x")
    (root / "ok.efi").write_bytes(b"1")
    r = root.resolve()
    assert safe_path(r, "ok.efi") == r / "ok.efi"
    assert safe_path(r, "./ok.efi") == r / "ok.efi"
    for name in (".htpasswd", ".git/config", "sub/.hidden", ".git\\config"):
        with pytest.raises(PathRefused) as e:
            safe_path(r, name)
        assert e.value.reason == "hidden", name
