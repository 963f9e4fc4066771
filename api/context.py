"""What API handlers share: config, store, secrets, the event bus and optional services."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metald.config import Config
from metald.events import EventBus
from metald.limits import Limiter
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
    #: Caps on held mesh long-polls (``[api] mesh_polls_*``; ``metald.limits``).
    mesh_polls: Limiter = field(init=False)

    def __post_init__(self) -> None:
        self.mesh_polls = Limiter(
            "mesh long-polls",
            total=self.cfg.api.mesh_polls_max,
            per={"token": self.cfg.api.mesh_polls_per_token},
            retry_after_s=5,
            advice="poll again after Retry-After",
        )

    @property
    def instance(self) -> str:
        return self.cfg.instance
