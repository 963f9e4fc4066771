"""A typed Python client for the metald API.

``metald.client.sync.Client`` (standard library HTTP, no extra dependency) and
``metald.client.aio.AsyncClient`` (aiohttp, already a dependency of metald) offer the same
calls. This module imports neither, so a program that wants only the synchronous client (as
metalctl does) never loads aiohttp. See docs/client.md.
"""

from metald.client.core import ApiError, Page, PreconditionFailed, claim_settled

__all__ = ["ApiError", "Page", "PreconditionFailed", "claim_settled"]
