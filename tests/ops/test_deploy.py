"""deploy/systemd passes systemd-analyze verify, LICENSE is the Apache-2.0 text pyproject names,
and the package builds as a wheel that installs into a fresh venv with working entry points."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "metald.service"
DROPIN = ROOT / "deploy" / "systemd" / "metald.service.d" / "tenants.conf"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
VENV_BIN = Path(sys.executable).parent


def _verify(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # The unit runs /opt/metald/bin/metald; verify checks the executable exists, so point it
    # at this checkout's install.
    unit = tmp_path / "metald.service"
    unit.write_text(text.replace("/opt/metald/bin/metald", str(VENV_BIN / "metald")))
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("with_tenants", [False, True], ids=["unit", "unit+tenants.conf"])
def test_systemd_unit_verifies(tmp_path: Path, with_tenants: bool) -> None:
    text = UNIT.read_text() + (("\n" + DROPIN.read_text()) if with_tenants else "")
    r = _verify(text, tmp_path)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    for needed in (
        "StateDirectory=metald",
        "CAP_NET_BIND_SERVICE",
        "CAP_NET_RAW",
        "CAP_NET_ADMIN",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
    ):
        assert needed in text


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a misspelt directive is reported."""
    r = _verify(UNIT.read_text().replace("ProtectHome=yes", "ProtectHome=sometimes"), tmp_path)
    assert "protect home value" in r.stderr, r.stderr


def test_license_is_apache_2() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] in ("Apache-2.0", {"text": "Apache-2.0"})
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_runtime_dependencies_are_imported() -> None:
    """Every runtime dependency is imported by the product (tftpy was not: it is a test tool)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    modules = {
        "psycopg[binary]": "psycopg",
        "prometheus-client": "prometheus_client",
        "SQLAlchemy": "sqlalchemy",
        "pyroute2": "pyroute2",
        "PyYAML": "yaml",
    }
    sources = "\n".join(
        p.read_text()
        for d in ("metald", "api", "netconfig", "bootassets")
        for p in (ROOT / d).rglob("*.py")
    )
    for dep in deps:
        name = dep.split(">")[0].split("=")[0].split(";")[0].strip()
        module = modules.get(name, name.lower().replace("-", "_"))
        used = f"import {module}" in sources or f"from {module}" in sources
        # SQLAlchemy loads the PostgreSQL driver by the URL's dialect name.
        used = used or (module == "psycopg" and "postgresql+psycopg" in sources)
        assert used, f"{name} is never imported"


@pytest.mark.slow
def test_wheel_installs_and_runs(tmp_path: Path) -> None:
    """Build the wheel, install it (without dependencies: no network) into a fresh venv that
    sees this venv's site-packages through a .pth, and run both entry points from it."""
    dist = tmp_path / "dist"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    wheels = list(dist.glob("metald-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
    )
    site = next((venv / "lib").glob("python3.*/site-packages"))
    deps_site = next(
        p for p in sys.path if p.endswith("site-packages") and p.startswith(str(VENV_BIN.parent))
    )
    (site / "_deps.pth").write_text(deps_site + "\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheels[0]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0 and "no such option: --python" in r.stderr:
        pytest.skip("pip too old for --python")
    assert r.returncode == 0, r.stderr[-3000:]
    # A clean environment: nothing from the test run points Python at this checkout.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    for cmd in ("metald", "metalctl"):
        out = subprocess.run(
            [str(venv / "bin" / cmd), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "0." in out.stdout + out.stderr
    # The installed package is the wheel's, not this checkout's editable one.
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import metald, api; print(metald.__file__, api.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert str(site) in where.stdout and str(ROOT) not in where.stdout, where.stdout + where.stderr
    schema = subprocess.run(
        [str(venv / "bin" / "metald"), "config-schema"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert schema.returncode == 0 and '"properties"' in schema.stdout, schema.stderr[-2000:]
    # Every key described from the shipped example, as in a checkout.
    from metald.config_docs import undocumented

    assert undocumented(json.loads(schema.stdout)) == []
    # The example config, unit, alert rules and dashboard ship under the venv, and the unit's
    # Documentation= names a file that is there (/opt/metald is the venv).
    share = venv / "share" / "metald"
    for name in ("metald.toml", "metald.service", "alerts.yml", "metald.json"):
        assert (share / name).is_file(), name
    assert (share / "metald.service.d" / "tenants.conf").is_file()
    doc = _documentation_path()
    assert (venv / doc.relative_to("/opt/metald")).is_file(), doc
    check = subprocess.run(
        [str(venv / "bin" / "metald"), "check-config", "--config", str(share / "metald.toml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**env, "METALD_STATE_DIR": str(tmp_path / "state")},
    )
    assert check.returncode == 0 and "config ok" in check.stdout, check.stderr[-2000:]


def _documentation_path() -> Path:
    line = next(x for x in UNIT.read_text().splitlines() if x.startswith("Documentation="))
    return Path(line.removeprefix("Documentation=file://"))


def test_the_unit_documentation_ships_and_the_schema_describes_every_key() -> None:
    """The unit's Documentation= named a file nothing installed; the config schema described 8
    keys. Both come from what the wheel ships now (pyproject data-files)."""
    doc = _documentation_path()
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "data-files"
    ]
    folder = str(doc.parent.relative_to("/opt/metald"))
    patterns = shipped.get(folder, [])
    assert any(Path("docs", doc.name).match(p) for p in patterns), (
        folder,
        shipped,
    )
    assert (ROOT / "docs" / doc.name).is_file()
    r = subprocess.run(
        [VENV_BIN / "metald", "config-schema"], capture_output=True, text=True, timeout=60
    )
    from metald.config_docs import undocumented

    schema = json.loads(r.stdout)
    assert undocumented(schema) == []
    assert "CIDRs of BMCs" in schema["$defs"]["BmcConfig"]["properties"]["networks"]["description"]


def test_check_config_needs_a_file() -> None:
    """It printed "config ok" for the built-in defaults when no file was given."""
    r = subprocess.run(
        [VENV_BIN / "metald", "check-config"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--config" in r.stderr and "config ok" not in r.stdout
