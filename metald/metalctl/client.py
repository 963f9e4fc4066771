"""metalctl's HTTP client: ``metald.client.sync.Client``, the same one orchestrators use."""

from __future__ import annotations

from metald.client.core import ApiError, Query
from metald.client.sync import Client

__all__ = ["ApiError", "Client", "Query"]
