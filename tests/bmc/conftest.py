"""Fixtures for the BMC tests: real peers, started per test (see ``peers``), and the API over
a real BMC service (``bmc_api``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from metald.bmc.service import BmcService
from metald.config import Config
from metald.secrets import SecretBox
from metald.store import Store
from tests.api_helpers import drain_steps
from tests.bmc.peers import (  # noqa: F401
    fault_bmc,
    ipmi_sim,
    lab_redfish,
    sushy,
    sushy_auth,
    sushy_slow,
    sushy_tls,
)
from tests.conftest import seed


@pytest.fixture
def bmc_settings() -> dict[str, Any]:
    """``[bmc]`` settings of ``bmc_api``'s service beyond its quick defaults (a test module
    overrides this fixture to change them)."""
    return {}


@pytest.fixture
async def bmc_api(
    cfg: Config, store: Store, aiohttp_client: Any, bmc_settings: dict[str, Any]
) -> AsyncIterator[tuple[Any, Any, BmcService]]:
    """(client, tokens, service): the API app with a real BMC service, answering quickly
    (no spacing between commands, 3 s timeouts, one retry, unless ``bmc_settings`` says
    otherwise); the boots it started drained and the service stopped afterwards."""
    from api.app import create_app
    from api.context import AppContext, Services
    from metald.events import EventBus

    secrets = SecretBox.from_file(cfg.secrets_key_path)
    for name, value in {"min_interval_ms": 0, "timeout_s": 3, "retries": 1, **bmc_settings}.items():
        setattr(cfg.bmc, name, value)
    svc = BmcService(store, secrets, cfg.bmc, cfg.instance)
    ctx = AppContext(
        cfg=cfg, store=store, secrets=secrets, bus=EventBus(), services=Services(bmc=svc)
    )
    tokens = seed(store)
    client = await aiohttp_client(create_app(ctx))
    yield client, tokens, svc
    await drain_steps(client)
    await svc.stop()
