"""What API handlers share: config, store, secrets, the event bus and optional services."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metald.config import Config
from metald.events import EventBus
from metald.secrets import SecretBox
from metald.store import Store


@dataclass
class AppContext:
    cfg: Config
    store: Store
    secrets: SecretBox
    bus: EventBus
    #: Optional services the daemon hosts (e.g. "bmc": BmcService); absent ones answer 503.
    services: dict[str, Any] = field(default_factory=dict)

    @property
    def instance(self) -> str:
        return self.cfg.instance
