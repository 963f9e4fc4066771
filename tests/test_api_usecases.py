"""The API delegates domain work to one use case per resource (``metald.usecases``): routes
declare their use case, handlers build no transaction and run no query, lists page through
one read model; and the rules that moved there (the label limit) still hold over HTTP."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from api import listing
from api.app import ROUTERS, all_specs
from metald.errors import Conflict
from metald.usecases.machines import MAX_LABELS, merge_labels

ROOT = Path(__file__).resolve().parents[1]

#: API modules that still run queries of their own (``select``, ``session.get``, a
#: ``store.run``): the next to move below the API. A module that stops doing so must leave
#: this list (the test says so), so it only shrinks.
NOT_MOVED_YET = {
    "api/paging.py",  # the keyset pager the read model (metald.usecases.reads) calls
    "api/routing.py",  # ApiRequest.run: the transaction runner use cases are handed (it
    # stamps an agent token's first use in the request's first commit)
}
#: Calls that reach the store from a module: a query, a transaction, a session of its own.
STORE_CALLS = {"select", "run", "read", "read_aside", "write", "session", "exec", "get"}


def _store_touches(path: Path) -> list[str]:
    """Where the module queries or opens a transaction: ``select(...)``, ``x.store.run``/
    ``read``/``read_aside``, ``req.run``/``req.write``, ``s.exec``/``s.get`` on a session
    named ``s``/``session``, and imports of ``select``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module in ("sqlmodel", "sqlalchemy")
            and any(a.name == "select" for a in node.names)
        ):
            found.append(f"{node.lineno}: imports select")
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "select":
            found.append(f"{node.lineno}: select(...)")
        elif isinstance(f, ast.Attribute) and f.attr in STORE_CALLS:
            owner = ast.unparse(f.value)
            if (
                owner.endswith("store")
                or (owner == "req" and f.attr in ("run", "write"))
                or (owner in ("s", "session") and f.attr in ("exec", "get"))
            ):
                found.append(f"{node.lineno}: {owner}.{f.attr}(...)")
    return found


def _api_modules() -> list[Path]:
    return sorted((ROOT / "api").rglob("*.py"))


def test_moved_api_modules_leave_queries_and_transactions_to_use_cases() -> None:
    offenders = {}
    for p in _api_modules():
        rel = str(p.relative_to(ROOT))
        if rel not in NOT_MOVED_YET and (touches := _store_touches(p)):
            offenders[rel] = touches
    assert not offenders, (
        f"move these queries and transactions into a use case (metald/usecases/): {offenders}"
    )


def test_the_not_yet_moved_list_only_shrinks() -> None:
    clean = sorted(
        rel for rel in NOT_MOVED_YET if not _store_touches(ROOT / rel) and (ROOT / rel).exists()
    )
    assert not clean, f"these no longer touch the store: take them off NOT_MOVED_YET: {clean}"


def test_store_models_contract_lists_only_modules_not_moved_yet() -> None:
    """The import contract's ignore list (pyproject.toml) is the same work list: a module
    may import the store's models only while its queries have not moved."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in conf["contracts"] if c["id"] == "api-without-store-models")
    assert contract["source_modules"] == ["api"]
    assert contract["forbidden_modules"] == ["metald.store.models"]
    ignored = {i.split(" -> ")[0] for i in contract.get("ignore_imports", [])}
    as_paths = {"api/" + m.removeprefix("api.").replace(".", "/") + ".py" for m in ignored}
    assert as_paths <= NOT_MOVED_YET, sorted(as_paths - NOT_MOVED_YET)


MOVED = {
    "routes_machines",
    "routes_tenants",
    "routes_tokens",
    "routes_images",
    "routes_join",
    "routes_commissioning",
    "routes_claims",
    "routes_instances",
    "routes_events",
    "routes_agent",
}


def test_moved_routes_declare_their_use_case() -> None:
    """Every route of a moved module names the use case it hands off to (``whoami`` only
    reads its own token)."""
    missing = [
        f"{s.method} {s.path}"
        for s in all_specs(ROUTERS)
        if s.handler.__module__.removeprefix("api.") in MOVED
        and s.use_case is None
        and s.path != "/api/v1/whoami"
    ]
    assert not missing, missing


def test_lists_answer_through_one_read_model() -> None:
    """The list endpoints of the moved modules build their answer with ``api.listing``
    (no copied items/total/limit/offset/next skeleton)."""
    for name in MOVED:
        src = (ROOT / "api" / f"{name}.py").read_text()
        assert "total=" not in src and "offset=q.offset" not in src, name
    assert listing.answer and listing.paging


# ---- the label limit, moved from the handler into metald.usecases.machines --------------


def test_merge_labels_sets_removes_and_caps() -> None:
    assert merge_labels({"a": "1", "b": "2"}, {"a": None, "c": "3"}) == {"b": "2", "c": "3"}
    full = {f"k{i}": "v" for i in range(MAX_LABELS)}
    assert merge_labels(full, {"k0": "w"})["k0"] == "w"  # a change within the limit
    assert len(merge_labels(full, {"k0": None, "new": "v"})) == MAX_LABELS
    with pytest.raises(Conflict, match=f"at most {MAX_LABELS} labels"):
        merge_labels(full, {"one-more": "v"})


async def test_label_limit_over_http(api) -> None:  # type: ignore[no-untyped-def]
    """A 65th label is a 409 and changes nothing; removing one makes room again."""
    client, tokens, _ = api
    tech = tokens.header("technician")
    url = f"/api/v1/machines/{tokens.machine_free}/labels"
    r = await client.get(f"/api/v1/machines/{tokens.machine_free}", headers=tech)
    have = (await r.json())["labels"]
    fill = {f"fill-{i}": "x" for i in range(MAX_LABELS - len(have))}
    r = await client.patch(url, json={"labels": fill}, headers=tech)
    assert r.status == 200 and len((await r.json())["labels"]) == MAX_LABELS
    r = await client.patch(url, json={"labels": {"one-more": "x"}}, headers=tech)
    assert r.status == 409 and "at most 64 labels" in (await r.json())["detail"]
    r = await client.get(f"/api/v1/machines/{tokens.machine_free}", headers=tech)
    assert "one-more" not in (await r.json())["labels"]
    r = await client.patch(url, json={"labels": {"fill-0": None, "one-more": "x"}}, headers=tech)
    assert r.status == 200 and (await r.json())["labels"]["one-more"] == "x"
