"""The layering rules of docs/architecture.md, checked by import-linter on every test run, and
the doc's import graph, redrawn from the code.

The contracts live in pyproject.toml ([tool.importlinter]); a new import that breaks one fails
here with import-linter's report of the offending chain.
"""

from __future__ import annotations

import ast
import functools
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import metald

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
#: Top-level parts of metald that sit beside the layers rather than in them.
OUTSIDE_LAYERS = {"metalctl", "client"}  # HTTP clients of the API: their own contracts


def _contracts() -> dict[str, dict]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in conf["contracts"]}


def test_import_contracts_are_kept() -> None:
    """Every import-linter contract of pyproject.toml holds (``lint-imports``)."""
    r = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_every_part_of_metald_has_a_layer() -> None:
    """A new module or package under metald/ must be placed in the layers contract (or named
    in OUTSIDE_LAYERS), so the layering covers all of the daemon."""
    named: set[str] = set()
    for layer in _contracts()["layers"]["layers"]:
        named |= {m.strip() for m in re.split(r"[|:]", layer)}
    parts = {
        f"metald.{m.name}"
        for m in pkgutil.iter_modules(metald.__path__)
        if m.name not in OUTSIDE_LAYERS and (m.name == "__main__" or not m.name.startswith("_"))
    }
    missing = sorted(parts - named)
    assert not missing, f"place these in [tool.importlinter] layers (pyproject.toml): {missing}"
    assert not sorted(n for n in named if n.startswith("metald.") and n not in parts)


def test_the_docs_tables_are_written_from_the_contracts_and_tests() -> None:
    """docs/architecture.md's layer table, contract table and AST-rule table match
    pyproject.toml's contracts and this file's tests (scripts/architecture_tables.py)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "architecture_tables.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_docs_picture_is_drawn_from_the_code() -> None:
    """docs/architecture.md's import graph matches the code (scripts/import_graph.py)."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _sources() -> list[Path]:
    """The repository's Python sources (tracked or not, outside the venv and caches)."""
    skip = {".venv", ".cache", ".git", "var", "build", "dist", "__pycache__"}
    found = [
        p
        for p in ROOT.rglob("*.py")
        if not skip & set(p.relative_to(ROOT).parts) and not p.name.startswith(".")
    ]
    return [*found, ROOT / "vm-lab" / "vm-lab", ROOT / "scripts" / "bootstrap"]


def test_nothing_edits_the_import_path() -> None:
    """Every package (the lab's too) is installed; code that reaches another folder through
    sys.path or PYTHONPATH hides a missing install and breaks from another directory."""
    pattern = re.compile(r"sys\.path\.(insert|append|extend)|\bPYTHONPATH\b")
    offenders = {
        str(p.relative_to(ROOT))
        for p in _sources()
        if p != Path(__file__) and pattern.search(p.read_text(errors="replace"))
    }
    assert offenders - OTHER_TREE_RUNNERS == set()


#: Bench tools whose job is to run ANOTHER tree's code (an exported earlier commit) with this
#: checkout's installed dependencies, and to load a statement counter into every process of
#: that run: PYTHONPATH is the mechanism, not a hidden missing install.
OTHER_TREE_RUNNERS = {
    "bench/storm_compare.py",
    "bench/sqlcount/sitecustomize.py",
    "bench/health_cost.py",
    # The console's before/after screenshots: the same demo fleet against an exported main.
    "scripts/ui_screenshots.py",
}


def test_benchmarks_import_the_lab_not_the_tests() -> None:
    """bench/ imports no test module, neither as ``tests.x`` nor as a bare name that only
    resolves with tests/ on the path (``boot.labnet``, ``pg``)."""
    products = set(_contracts_root_packages())
    test_names = {"tests"} | {p.stem for p in (ROOT / "tests").iterdir()} - products
    offenders = []
    for p in (ROOT / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{p.name}: {n}" for n in names if n.split(".")[0] in test_names]
    assert not offenders, offenders


def _contracts_root_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "root_packages"
    ]


#: URL prefixes (the first segment after /api/v1/) served by a module of another name.
PREFIX_MODULES = {
    "bmcs": "routes_bmc",
    "whoami": "routes_tokens",
    # What BMCs push (Redfish events) is a health signal: its receiver lives with the report's.
    "bmc-events": "routes_health",
    # The fabric's views (NVLink domains, InfiniBand leaves) live with one topology module.
    "nvlink-domains": "routes_topology",
    "ib-fabric": "routes_topology",
}
#: Subsystems whose routes on a machine (and its agent's) live in their own module.
#: Commissioning's routes on a machine and its agent's live in routes_commissioning.
SUBSYSTEM_PATHS = {
    "routes_commissioning": ("/api/v1/machines/{id}/commission", "/api/v1/agent/commissioning"),
    "routes_firmware": ("/api/v1/machines/{id}/firmware/",),
    "routes_elastic": ("/api/v1/tenants/{id}/elastic-",),
    "routes_topology": ("/api/v1/machines/{id}/topology",),
    "routes_attestation": (
        "/api/v1/machines/{id}/attestation",
        "/api/v1/agent/attestation",
        "/api/v1/attestation/",
    ),
}


#: Subsystems whose routes on one machine live with the subsystem, not in routes_machines.
MACHINE_SUBSYSTEMS = frozenset({"routes_bmc", "routes_console"})


def test_each_routes_module_serves_one_url_prefix() -> None:
    """/api/v1/<prefix>/... is declared in api/routes_<prefix>.py (docs/architecture.md);
    the BMC subsystem's routes on a machine (power, boot device, sensors) are routes_bmc's."""
    import api

    misplaced = []
    for info in pkgutil.iter_modules(api.__path__):
        if not info.name.startswith("routes_"):
            continue
        module = __import__(f"api.{info.name}", fromlist=["router"])
        for spec in module.router.specs:
            path = spec.path
            if not path.startswith("/api/v1/"):
                expected = "routes_system"
            else:
                prefix = path.removeprefix("/api/v1/").split("/")[0]
                expected = PREFIX_MODULES.get(prefix, f"routes_{prefix}")
            subsystem_on_machine = info.name in MACHINE_SUBSYSTEMS and path.startswith(
                "/api/v1/machines/"
            )
            subsystem = path.startswith(SUBSYSTEM_PATHS.get(info.name, ("\0",)))
            if info.name != expected and not (subsystem_on_machine or subsystem):
                misplaced.append(f"{spec.method} {path} in {info.name}, not {expected}")
    assert not misplaced, misplaced


def test_role_sets_are_defined_once() -> None:
    """STAFF and the other role sets of route declarations live in api/routing.py and
    api/roles.py; a second definition drifts from the first."""
    defined: dict[str, list[str]] = {}
    for p in sorted((ROOT / "api").glob("*.py")):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Call, ast.BinOp)):
                for t in node.targets:
                    if isinstance(t, ast.Name) and t.id in {"STAFF", "ADMIN", "AGENT", "CLAIMERS"}:
                        defined.setdefault(t.id, []).append(p.name)
    assert {k: v for k, v in defined.items() if len(v) > 1} == {}


def test_no_subclass_overrides_a_private_method() -> None:
    """Behaviour is configured or composed, never changed by overriding a base class's private
    method (``EnrollmentBootHooks._target`` over ``StoreBootHooks._target`` did)."""
    methods: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for p in [*(ROOT / "metald").rglob("*.py"), *(ROOT / "api").rglob("*.py")]:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                methods[node.name] = {
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and f.name.startswith("_")
                    and not f.name.endswith("__")
                }
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
    overrides = [
        f"{cls}.{name} overrides {base}.{name}"
        for cls, names in methods.items()
        for base in bases[cls]
        for name in sorted(names & methods.get(base, set()))
    ]
    assert not overrides, overrides


def test_route_handlers_leave_integrity_and_service_probing_below() -> None:
    """A handler validates, authorises and delegates (docs/architecture.md): unique-key races
    (IntegrityError) are the domain's to turn into a 409, and a service is reached through a
    typed accessor (api/workflows.py), never probed with hasattr."""
    offenders = []
    for p in sorted((ROOT / "api").glob("routes_*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Name) and node.id == "IntegrityError":
                offenders.append(f"{p.name}:{node.lineno} IntegrityError")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "hasattr"
            ):
                offenders.append(f"{p.name}:{node.lineno} hasattr")
    assert not offenders, offenders


#: Commands that enter or change host networking: only netconfig/ runs them (its functions are
#: what the daemon calls). Netlink (pyroute2) is the host-networking-in-netconfig contract's.
HOST_NETWORK_COMMANDS = ("nsenter", "ip", "nft", "wg")
_SHELL_LINE = re.compile(rf"^\s*({'|'.join(HOST_NETWORK_COMMANDS)})\s+\S", re.MULTILINE)


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }


def host_network_commands(tree: ast.Module) -> list[int]:
    """Lines of ``tree`` that spell a host-networking command: an argv whose first element
    is one (``["nsenter", ...]``), or a shell line that starts with one."""
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in HOST_NETWORK_COMMANDS:
                found.append(node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and _SHELL_LINE.search(node.value)
        ):
            found.append(node.lineno)
    return found


def test_host_networking_commands_run_only_in_netconfig() -> None:
    """Host networking lives in netconfig/: the daemon and the API call its functions
    (``netns.exec_argv``, ``netns.run``, ``links.veth_to_bridge`` ...), never nsenter, ip, nft
    or wg themselves."""
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _product_sources()
        for line in host_network_commands(_tree(p))
    ]
    assert not offenders, offenders


def test_the_host_networking_check_sees_argv_and_shell_lines() -> None:
    """The host-networking check finds an argv and a shell line, not a dict key or a
    docstring."""
    assert host_network_commands(ast.parse('subprocess.run(["nsenter", "--net=x", "sysctl"])')) == [
        1
    ]
    assert host_network_commands(ast.parse('S = """trap\nip netns delete "$NS"\n"""')) == [1]
    assert host_network_commands(ast.parse('d = {"ip": 1}\nc = ("network", "ip")')) == []
    assert host_network_commands(ast.parse('def f():\n    """ip netns exec: no."""')) == []


def _product_sources() -> list[Path]:
    return [*sorted((ROOT / "metald").rglob("*.py")), *sorted((ROOT / "api").rglob("*.py"))]


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A product source, parsed once for every check of this file."""
    return ast.parse(path.read_text())


def _is_state_member(node: ast.AST) -> bool:
    """``State.X`` or ``State.X.value``."""
    if isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in {"State", "S"}
    )


def state_writes(tree: ast.Module) -> list[int]:
    """Lines of ``tree`` that assign a ``State`` to a ``.state`` or update Machine.state."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "state" for t in node.targets
        ):
            if any(_is_state_member(n) for n in ast.walk(node.value)):
                found.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "values"
            and "update(Machine)" in ast.unparse(node.func.value)
            and any(k.arg == "state" for k in node.keywords)
        ):
            found.append(node.lineno)
    return found


def state_sets(tree: ast.Module) -> int:
    """How many collections of two or more ``State`` members ``tree`` spells."""
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, (ast.Set, ast.List, ast.Tuple))
        and len(node.elts) >= 2
        and all(_is_state_member(e) for e in node.elts)
    )


def test_machine_states_change_only_in_machines() -> None:
    """A machine's state changes only through metald/machines.py (``machines.transition``):
    no other product module assigns a ``State`` to a ``.state`` or updates Machine.state."""
    offenders = [
        f"{p.relative_to(ROOT)}:{line}"
        for p in _product_sources()
        if p != ROOT / "metald" / "machines.py"
        for line in state_writes(_tree(p))
    ]
    assert not offenders, offenders


#: Literal sets of machine states outside lifecycle.py, each with why it is not derived there.
STATE_SET_EXCEPTIONS = {
    # the two states a discovery-image boot starts from; not yet a lifecycle set of its own
    "metald/enrollment.py": 1,
}


def test_state_sets_are_derived_from_the_lifecycle_table() -> None:
    """Sets of machine states live in metald/lifecycle.py, derived from its table: no other
    product module spells a collection of two or more ``State`` members."""
    found = {
        str(p.relative_to(ROOT)): n
        for p in _product_sources()
        if p != ROOT / "metald" / "lifecycle.py" and (n := state_sets(_tree(p)))
    }
    assert found == STATE_SET_EXCEPTIONS


def test_the_state_checks_see_writes_and_sets() -> None:
    """The state checks find a ``.state`` write, a Machine.state update and a literal set of
    states, and not a claim's string state or a single state."""
    assert state_writes(ast.parse("m.state = State.READY.value")) == [1]
    assert state_writes(ast.parse("s.execute(update(Machine).values(state=x))")) == [1]
    assert state_writes(ast.parse('c.state = "released"')) == []
    assert state_sets(ast.parse("if m.state in (State.A.value, State.B.value): pass")) == 1
    assert state_sets(ast.parse("x = {S.A, S.B}\ny = [State.A]")) == 1


def test_every_routes_module_is_mounted() -> None:
    """Each api/routes_*.py module's router is listed in ``api.app.ROUTERS``."""
    from api.app import ROUTERS

    mounted = {r for r in ROUTERS}
    missing = []
    for p in sorted((ROOT / "api").glob("routes_*.py")):
        module = __import__(f"api.{p.stem}", fromlist=["router"])
        if module.router not in mounted:
            missing.append(p.stem)
    assert not missing, missing
