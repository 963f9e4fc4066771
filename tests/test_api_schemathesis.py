"""Schemathesis against the live OpenAPI document of a running metald API.

The app runs on loopback in a thread of its own (with every optional route module mounted);
schemathesis loads ``/api/v1/openapi.json`` from it and, for every operation and each of the
admin, technician and orchestrator tokens, sends generated requests, valid and invalid, checking
that none is answered 5xx and that every answer (status, media type, body) is the one the
document declares. A bounded number of examples per operation keeps the run well under a minute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api_helpers import LoopbackApi


@schemathesis.check
def not_an_internal_error(ctx, response, case) -> None:  # type: ignore[no-untyped-def]
    """No 5xx but the 502/503 a route documents (upstream BMC failed, service not running:
    the app here runs without a BMC service, which would send traffic to generated addresses;
    status_code_conformance checks they are documented)."""
    if response.status_code >= 500 and response.status_code not in (502, 503):
        raise AssertionError(f"server error {response.status_code}: {response.text[:300]}")


CHECKS = [
    not_an_internal_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
ROLES = ("admin", "technician", "orchestrator")
#: Examples per operation, role and mode (positive and negative data) on SQLite; PostgreSQL
#: gets a quarter: the contract is the same code, the second backend is there for its own errors.
EXAMPLES = 8
#: aiohttp's request-line limit (its HttpParser max_line_size): a generated query past it is
#: answered 400 by the HTTP layer, before the router.
MAX_LINE = 8190
#: Never-ending responses: a client cannot read them to their end.
SKIP = {("GET", "/api/v1/events/stream")}


@pytest.fixture
def loopback_api(db_url: str, tmp_path: Path) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        yield api


def _target_len(url: str) -> int:
    """The request-target's length (path and query) as it goes on the request line."""
    parts = urlsplit(url)
    return len(parts.path) + (len(parts.query) + 1 if parts.query else 0)


def _fuzz(
    op,
    mode,
    base: str,
    session,
    auth: dict[str, str],
    label: str,
    failures: list[str],
    examples: int = EXAMPLES,
) -> None:  # type: ignore[no-untyped-def]
    """Send ``examples`` generated requests for one operation; collect what the checks refuse."""

    @settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case) -> None:  # type: ignore[no-untyped-def]
        response = case.call(base_url=base, session=session, headers=auth, timeout=30)
        if response.status_code == 400 and _target_len(response.request.url) > MAX_LINE:
            # aiohttp's HTTP parser refuses a request line over 8 KiB before any route runs
            # (its own plain 400): the HTTP layer's limit, not the operation's contract.
            return
        try:
            case.validate_response(response, checks=CHECKS, headers=auth)
        except (AssertionError, BaseExceptionGroup) as e:  # one failure, or several at once
            for f in getattr(e, "exceptions", [e]):
                what = f"{getattr(f, 'title', type(f).__name__)}: {getattr(f, 'message', f)}"
                failures.append(f"{op.method.upper()} {op.path} as {label}: {what}")

    try:
        check()
    except Unsatisfiable:
        assert mode is schemathesis.GenerationMode.NEGATIVE  # nothing in it can be invalid


def test_live_openapi_holds_for_generated_requests(loopback_api: LoopbackApi, db_url: str) -> None:
    import requests

    examples = EXAMPLES if db_url.startswith("sqlite") else EXAMPLES // 4

    tokens = loopback_api.tokens
    assert tokens is not None
    schema = schemathesis.openapi.from_url(f"{loopback_api.base}/api/v1/openapi.json")
    session = requests.Session()
    failures: list[str] = []
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if (op.method.upper(), op.path) not in SKIP]
    assert len(operations) > 25
    for op in operations:
        for role in ROLES:
            auth = {"Authorization": f"Bearer {getattr(tokens, role)}"}
            for mode in (
                schemathesis.GenerationMode.POSITIVE,
                schemathesis.GenerationMode.NEGATIVE,
            ):
                _fuzz(
                    op,
                    mode,
                    loopback_api.base,
                    session,
                    auth,
                    f"{role} ({mode})",
                    failures,
                    examples,
                )
    distinct = sorted(set(failures))
    assert not distinct, "\n\n".join(distinct[:20]) + f"\n\n({len(distinct)} distinct failures)"
