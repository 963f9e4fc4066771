"""The alerting rules pass their promtool unit tests, and a real Prometheus (Debian's) scraping a
running metald finds every series the rules and the Grafana dashboard read."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.api_helpers import LoopbackApi
from tests.ops.fleet_data import NETWORK, populate
from tests.ops.promql import metric_names
from tests.waiting import wait_for
from vmlab.labnet import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "metald.json"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMTOOL is None or PROMETHEUS is None,
    reason="Debian's prometheus package (promtool, prometheus) is missing: run scripts/bootstrap",
)


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def dashboard_exprs() -> dict[str, str]:
    if not DASHBOARD.exists():
        return {}
    doc = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in doc["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            out[f"{panel['title']}#{i}"] = target["expr"]
    return out


def test_metric_names_of_an_expression() -> None:
    expr = (
        'sum by (instance) (rate(metald_api_requests_total{status=~"5.."}[5m])) '
        '/ on (instance) group_left max(up{job="metald"}) > bool 0.05 '
        "and histogram_quantile(0.9, sum by (le) (rate(metald_x_bucket[$__rate_interval])))"
    )
    assert metric_names(expr) == {"metald_api_requests_total", "up", "metald_x_bucket"}


@needs_prometheus
def test_rules_pass_their_unit_tests() -> None:
    r = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts_test.yml"],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def _fleet(cfg: Any, store: Any, tokens: Any) -> None:
    cfg.boot.networks = [NETWORK]
    populate(store, tokens)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback only
        return json.load(r)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, LoopbackApi]]:
    url = f"sqlite:///{tmp_path / 'metald.db'}"
    with LoopbackApi(url, tmp_path, _fleet) as metald:
        # Scraped and evaluated once a second so the test waits seconds, not minutes.
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": "metald",
                    "static_configs": [{"targets": [f"127.0.0.1:{metald.port}"]}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        port = free_port()
        log = (tmp_path / "prometheus.log").open("w")
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.console.templates=/nonexistent",
                "--web.console.libraries=/nonexistent",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}", metald
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def _wait(cond, what: str, proc_log: Path, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    """``wait_for`` with Prometheus's log in the failure (a refused connection: not yet)."""
    return wait_for(
        what,
        cond,
        timeout,
        every=0.2,
        ignore=(OSError,),
        explain=lambda: f"prometheus log:\n{proc_log.read_text()[-3000:]}",
    )


@needs_prometheus
def test_prometheus_scrapes_every_series_the_rules_and_dashboard_read(
    prometheus: tuple[str, LoopbackApi], tmp_path: Path
) -> None:
    base, _metald = prometheus
    log = tmp_path / "prometheus.log"
    wanted: dict[str, set[str]] = {}
    for where, expr in {**rule_exprs(), **dashboard_exprs()}.items():
        for name in metric_names(expr):
            wanted.setdefault(name, set()).add(where)
    assert "metald_instance_heartbeat_age_seconds" in wanted

    def names() -> set[str] | None:
        have = set(_get(f"{base}/api/v1/label/__name__/values")["data"])
        return have if wanted.keys() <= have else None

    try:
        have = _wait(names, "every series the rules and dashboard read", log)
    except AssertionError:
        have = set(_get(f"{base}/api/v1/label/__name__/values")["data"])
        missing = {n: sorted(w) for n, w in wanted.items() if n not in have}
        raise AssertionError(f"never scraped: {missing}") from None
    assert "metald_build_info" in have and "process_cpu_seconds_total" in have

    # Each series has data now (not only a name from an earlier scrape). Asked until every one
    # answers at once: a scrape that failed (a loaded box) marks every series stale until the
    # next one, and a single query once landed in that gap.
    def without_sample() -> list[str]:
        return [
            name
            for name in sorted(wanted)
            if not _get(f"{base}/api/v1/query?query={urllib.parse.quote(f'count({name})')}")[
                "data"
            ]["result"]
        ]

    try:
        _wait(lambda: without_sample() == [], "a current sample of every series", log)
    except AssertionError:
        raise AssertionError(f"no current sample: {without_sample()}") from None

    # Prometheus loaded the rules and evaluates them without error; the unreachable BMC in the
    # data makes its alert pending (it has a 10 minute "for") once an evaluation saw a scrape.
    def rules() -> dict[str, Any] | None:
        groups = _get(f"{base}/api/v1/rules")["data"]["groups"]
        by_name = {r["name"]: r for g in groups for r in g["rules"]}
        bmc = by_name.get("MetaldBmcsUnreachable", {})
        return by_name if bmc.get("state") in {"pending", "firing"} else None

    loaded = _wait(rules, "MetaldBmcsUnreachable to be pending", log)
    assert set(loaded) == set(rule_exprs())
    assert all(r["health"] == "ok" for r in loaded.values()), loaded
    assert loaded["MetaldDhcpPoolNearlyFull"]["state"] == "inactive"  # 3 of 10 addresses
