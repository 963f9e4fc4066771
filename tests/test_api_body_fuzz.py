"""Fuzzing the request-body path (api/routing.py: read the body, decode, bound, validate).

Two layers, both with hypothesis:

- the core in process: any bytes, split into any pieces as a network would deliver them, fed
  through a real aiohttp StreamReader into ``read_body_bytes``, ``parse_json_object`` and each
  body route's validation. The only outcomes allowed are a value or a 4xx problem. Generation is
  guided by coverage: each example reports, through ``hypothesis.target``, how many distinct
  lines of metald's own code it ran, so hypothesis steers towards inputs that get deeper
  (past decoding, past bounds, into validation) instead of staying on the first refusal;
- the running app on loopback: the same kind of bodies POSTed to every route that takes one,
  with a token the route accepts: every answer is 2xx, or 4xx problem+json, never 5xx.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any
from unittest import mock

import pytest
import requests
from aiohttp import StreamReader
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from pydantic import ValidationError

from api.app import ROUTERS, all_specs
from api.routing import RouteSpec, _Problem, parse_json_object, read_body_bytes
from metald.errors import MetaldError
from metald.inventory import parse_payload
from tests.api_helpers import LoopbackApi
from tests.inventory.conftest import payload

ROOT = str(Path(__file__).resolve().parents[1])
OWN_CODE = (f"{ROOT}/api/", f"{ROOT}/metald/")
BODY_SPECS = [s for s in all_specs(ROUTERS) if s.body is not None]
LIMIT = 64 * 1024

#: Integers at the edges of what columns and parsers hold.
EDGES = [2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**20, -(2**63) - 1, -1, 0]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(EDGES)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.sampled_from(["02:00:00:00:00:01", "maintenance-on", "technician", "acme", "ipmi"]),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=30,
)
#: Objects with the field names the routes know, so validation (not just decoding) is reached.
FIELDS = sorted(
    {name for s in BODY_SPECS for name in s.body.model_fields}  # type: ignore[union-attr]
    | {"labels", "version", "selector", "min_memory_mb", "schema_version", "raw"}
)
known_objects = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6)


@st.composite
def _mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """A valid body with a few bytes flipped, cut, duplicated or inserted."""
    out = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(0, len(out) - 1)))
        op = draw(st.sampled_from(["flip", "cut", "dup", "insert"]))
        if op == "flip" and out:
            out[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del out[i : i + draw(st.integers(1, 16))]
        elif op == "dup":
            out[i:i] = out[i : i + draw(st.integers(1, 16))]
        else:
            out[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(out)


VALID = [
    json.dumps(b).encode()
    for b in (
        {"macs": ["02:00:00:00:00:09"], "name": "n1", "labels": {"a": "b"}},
        {"labels": {"pool": "x", "gen": None}, "version": 3},
        {"action": "maintenance-on", "reason": "r", "version": 1},
        {"name": "t", "role": "orchestrator", "scope": ["x"], "ttl_seconds": 600},
        payload(),
    )
]
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    known_objects.map(lambda v: json.dumps(v).encode()),
    st.sampled_from(VALID).flatmap(_mutated),
    st.integers(1, 200).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(900, 5000).map(lambda n: b'{"labels": ' + b"[" * n + b"]" * n + b"}"),
)


class _LineCounter:
    """The distinct lines of metald's own code one call runs (the coverage signal)."""

    def __init__(self) -> None:
        self.lines: set[tuple[str, int]] = set()

    def _trace(self, frame: FrameType, event: str, _arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(OWN_CODE):
            return None
        if event == "line":
            self.lines.add((frame.f_code.co_filename, frame.f_lineno))
        return self._trace

    def __enter__(self) -> _LineCounter:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *_exc: object) -> None:
        sys.settrace(None)


async def _through_the_core(spec: RouteSpec, raw: bytes, cuts: list[int]) -> None:
    loop = asyncio.get_running_loop()
    stream = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=loop)
    for lo, hi in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        stream.feed_data(raw[lo:hi])
    stream.feed_eof()
    data = parse_json_object(await read_body_bytes(stream, LIMIT))
    if spec.raw_body:
        parse_payload(data)  # the route validates it itself (the inventory schema)
    else:
        assert spec.body is not None
        spec.body.model_validate(data)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(spec=st.sampled_from(BODY_SPECS), raw=bodies, data=st.data())
def test_body_core_gives_a_value_or_a_4xx(spec: RouteSpec, raw: bytes, data: st.DataObject) -> None:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(raw)), max_size=4))))
    with _LineCounter() as seen:
        try:
            asyncio.run(_through_the_core(spec, raw, cuts))
        except _Problem as p:
            assert 400 <= p.status < 500, (p.status, p.detail)
        except (ValidationError, MetaldError) as e:
            assert getattr(e, "status", 422) < 500
    target(float(len(seen.lines)), label="lines of metald run")


@pytest.fixture
def loopback_api(db_url: str, tmp_path: Path) -> Iterator[LoopbackApi]:
    with LoopbackApi(db_url, tmp_path) as api:
        yield api


def _role_for(spec: RouteSpec) -> str | None:
    if spec.roles is None:
        return None
    for role in ("admin", "agent", "orchestrator", "technician"):
        if role in {r.value for r in spec.roles}:
            return role
    raise AssertionError(spec.path)


def test_any_body_on_the_live_app_is_2xx_or_a_4xx_problem(loopback_api: LoopbackApi) -> None:
    tokens = loopback_api.tokens
    assert tokens is not None
    session = requests.Session()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(spec=st.sampled_from(BODY_SPECS), raw=bodies)
    def post(spec: RouteSpec, raw: bytes) -> None:
        path = spec.path.replace("{id}", tokens.machine_free)
        path = path.replace("{bmc_id}", "no-such-bmc")
        role = _role_for(spec)
        headers = {"Content-Type": "application/json"}
        if role is not None:
            headers["Authorization"] = f"Bearer {getattr(tokens, role)}"
        r = session.request(
            spec.method, loopback_api.base + path, data=raw, headers=headers, timeout=30
        )
        assert r.status_code < 500 or r.status_code in (502, 503), (spec.path, r.text)
        if r.status_code >= 400:
            assert r.headers["Content-Type"].startswith("application/problem+json"), r.text
            assert r.json()["status"] == r.status_code

    post()
