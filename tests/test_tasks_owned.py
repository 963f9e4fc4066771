"""Every background task has an owner (docs/architecture.md, "Services and their tasks").

A service spawns its tasks into its own task group (``metald.service.TaskScope``), which the
daemon's group holds; stopping the service cancels them. So, in ``metald/`` and ``api/``:

- no module-level container (dict, set, list, registry) holds tasks or task runners: such a
  holder outlives every service and nobody cancels it at stop;
- no bare ``asyncio.create_task`` / ``ensure_future`` / ``loop.create_task``: a task made
  that way belongs to nobody. The sites below are the ones left, each with why.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from metald.service import TaskScope

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metald", "api")
SPAWNERS = {"create_task", "ensure_future"}

#: Module-level task holders still allowed: (file, name) -> why.
HOLDERS_ALLOWED: dict[tuple[str, str], str] = {}

#: Bare task creation still allowed: (file, enclosing function) -> (how many, why).
SPAWNS_ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    # The helper itself: the root of a tree of task groups (the daemon's own group).
    ("metald/service.py", "TaskScope._start_host"): (1, "the task-group helper's root"),
    # The heartbeat's loop on its own thread (a slow daemon loop must not fence the instance):
    # its root task and the one heartbeat in flight; stop_beats cancels the root, which
    # cancels the heartbeat, and joins the thread.
    ("metald/fleet/membership.py", "Membership.start_beats"): (1, "the heartbeat thread's root"),
    ("metald/fleet/membership.py", "Membership._beats"): (1, "cancelled by its root task"),
    # Request-scoped: the handler awaits (or cancels) these before it answers.
    ("api/routes_console.py", "_pump"): (1, "request-scoped, cancelled by the handler"),
    ("api/forwarding.py", "proxy_websocket"): (2, "request-scoped, cancelled by the handler"),
    ("api/ui/live.py", "Live.events"): (2, "request-scoped, awaited by the handler"),
    # The BMC subsystem, being split into capability interfaces (issue 25, item 3): its
    # service's TaskScope should own these; today each object cancels its own at close/stop,
    # except the fire-and-forget session closes (drop_sessions, _expire).
    ("metald/bmc/executor.py", "BmcExecutor.drop_sessions"): (1, "issue 25 item 3"),
    ("metald/bmc/executor.py", "BmcExecutor.spawn"): (1, "issue 25 item 3"),
    ("metald/bmc/console.py", "ConsoleService.attach"): (1, "issue 25 item 3"),
    ("metald/bmc/console.py", "ConsoleService.detach"): (1, "issue 25 item 3"),
    ("metald/bmc/ipmi.py", "IpmiDriver._expire"): (1, "issue 25 item 3"),
    ("metald/bmc/power_sync.py", "PowerSync.start"): (1, "issue 25 item 3"),
    ("metald/bmc/sol_link.py", "SolLink.open"): (1, "issue 25 item 3"),
    ("metald/bmc/sol_link.py", "SolLink._run"): (1, "issue 25 item 3"),
    ("metald/bmc/sol_link.py", "SolLink._next"): (2, "a race of two, awaited at once"),
    # The provisioning runner: owned by the Provisioner service (by constructor), which
    # cancels its tasks at stop; callers await the task it returns. The watchdog's one loop
    # is cancelled at its stop. Both should move onto a TaskScope.
    ("metald/provision/netboot.py", "StepRunner.spawn"): (1, "Provisioner.stop cancels it"),
    ("metald/provision/watchdog.py", "Watchdog.start"): (1, "Watchdog.stop cancels it"),
    # The boot plane's servers: each cancels its own tasks at stop (BootPlane stops them).
    # The DHCP server's per-packet report task is its hot path (bench/BOOT.md).
    ("metald/boot/dhcp/lease_feed.py", "LeaseFeed.start"): (1, "LeaseFeed.stop"),
    ("metald/boot/dhcp/lease_feed.py", "LeaseFeed.request_resync"): (1, "LeaseFeed.stop"),
    ("metald/boot/dhcp/lease_store.py", "LeaseStore.submit"): (1, "LeaseStore.drain"),
    ("metald/boot/dhcp/lease_store.py", "LeaseStore._flush_inline"): (1, "LeaseStore.drain"),
    ("metald/boot/dhcp/peers.py", "DhcpPeers.start"): (1, "DhcpPeers.stop"),
    ("metald/boot/dhcp/server.py", "DhcpServer._read_through"): (1, "DhcpServer.stop"),
    ("metald/boot/dhcp/server.py", "DhcpServer._report"): (1, "per-packet hot path"),
    ("metald/boot/ra.py", "RaResponder.start"): (1, "RaResponder.stop"),
    # The event bus's poller: one per process, closed with the app (EventBus.close).
    ("metald/events.py", "EventBus.subscribe"): (1, "EventBus.close"),
}


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _is_spawn(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name not in SPAWNERS:
        return False
    # A TaskGroup's create_task is owned by its group: only the helper holds groups.
    return not (isinstance(f, ast.Attribute) and _dotted(f.value).endswith("_group"))


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


class _Spawns(ast.NodeVisitor):
    """Bare task creation per enclosing (class.)function."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: Counter[str] = Counter()

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        if _is_spawn(node):
            # The outermost function and its class: nested helpers count for their function.
            names = self.scope[:2] if len(self.scope) > 1 else self.scope
            self.found[".".join(names) or "<module>"] += 1
        self.generic_visit(node)


def bare_spawns(tree: ast.AST) -> Counter[str]:
    v = _Spawns()
    v.visit(tree)
    return v.found


_CONTAINERS = {"dict", "set", "list", "defaultdict", "WeakKeyDictionary", "WeakValueDictionary"}
_TASKISH = ("Task", "Future", "Runner")


def task_holders(tree: ast.Module) -> list[str]:
    """Module-level names holding tasks: a container annotated with a task (or runner) type,
    or one a function of the module puts the result of create_task/ensure_future into."""
    containers: dict[str, bool] = {}
    for stmt in tree.body:
        target, value, ann = None, None, None
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            target, value, ann = stmt.target.id, stmt.value, stmt.annotation
        elif (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            target, value = stmt.targets[0].id, stmt.value
        if target is None or value is None:
            continue
        is_container = isinstance(value, ast.Dict | ast.Set | ast.List | ast.DictComp) or (
            isinstance(value, ast.Call) and _dotted(value.func).split(".")[-1] in _CONTAINERS
        )
        if is_container:
            taskish = ann is not None and any(t in ast.unparse(ann) for t in _TASKISH)
            containers[target] = taskish
    held = {n for n, taskish in containers.items() if taskish}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        spawned = {
            t.id
            for a in ast.walk(fn)
            if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call) and _is_spawn(a.value)
            for t in a.targets
            if isinstance(t, ast.Name)
        }

        def is_task(e: ast.expr, spawned: set[str] = spawned) -> bool:
            return (isinstance(e, ast.Name) and e.id in spawned) or (
                isinstance(e, ast.Call) and _is_spawn(e)
            )

        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if (
                        isinstance(t, ast.Subscript)
                        and _dotted(t.value) in containers
                        and is_task(node.value)
                    ):
                        held.add(_dotted(t.value))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = _dotted(node.func.value)
                if (
                    owner in containers
                    and node.func.attr in ("add", "append", "setdefault")
                    and any(is_task(a) for a in node.args)
                ):
                    held.add(owner)
    return sorted(held)


def test_no_module_level_task_holders() -> None:
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for name in task_holders(ast.parse(path.read_text(), rel)):
            if (rel, name) not in HOLDERS_ALLOWED:
                found.append(f"{rel}: {name}")
    assert not found, (
        "module-level containers hold tasks nobody cancels at stop; give them to a service's "
        f"TaskScope (metald.service): {found}"
    )


def test_no_bare_create_task_outside_the_allow_list() -> None:
    extra = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for where, n in bare_spawns(ast.parse(path.read_text(), rel)).items():
            allowed, _why = SPAWNS_ALLOWED.get((rel, where), (0, ""))
            if n > allowed:
                extra.append(f"{rel}: {where} ({n}, {allowed} allowed)")
    assert not extra, (
        "bare create_task/ensure_future: the task belongs to nobody; spawn it into the "
        f"service's TaskScope (metald.service) instead: {extra}"
    )


def test_the_checks_see_what_they_forbid() -> None:
    """The two detectors on the shapes this codebase had (a commissioning SEL-read registry
    and a service's bare create_task), so a check that quietly matches nothing fails."""
    registry = ast.parse(
        "_READS: dict[tuple[str, str], asyncio.Task[Any]] = {}\n"
        "_PLAIN = {}\n"
        "def read(key):\n"
        "    t = asyncio.create_task(go())\n"
        "    _PLAIN[key] = t\n"
    )
    assert task_holders(registry) == ["_PLAIN", "_READS"]
    service = ast.parse(
        "class S:\n"
        "    async def start(self):\n"
        "        self._task = asyncio.get_running_loop().create_task(self._loop())\n"
        "        self._group.create_task(x())\n"
    )
    assert bare_spawns(service) == Counter({"S.start": 1})


async def test_a_scope_cancels_its_tasks_at_close_and_survives_a_failing_one() -> None:
    parent = TaskScope("daemon")
    await parent.open()
    scope = parent.child("svc")
    await scope.open()
    assert scope._host in parent.tasks()  # the service's group runs in the daemon's
    forever = scope.spawn(asyncio_sleep_forever(), name="loop")
    failed = scope.spawn(boom(), name="boom")
    await failed
    assert failed.result() is None and not forever.done()  # one failure ends only itself
    await scope.close()
    assert forever.cancelled() and not scope.tasks() and not scope.is_open
    await parent.close()
    assert not parent.tasks() and not parent.is_open


async def test_start_soon_before_open_runs_and_the_group_ends_with_its_last_task() -> None:
    scope = TaskScope("unstarted")
    ran = []

    async def work() -> None:
        ran.append(1)

    scope.start_soon(work(), name="w")
    scope.start_soon(work(), name="w2")
    await scope.drain()
    assert ran == [1, 1]
    scope.start_soon(work(), name="w3")
    await scope.drain()
    while (host := scope._host) is not None:
        await host  # the group ends by itself once its last task has
    assert ran == [1, 1, 1] and not scope.is_open
    with pytest.raises(RuntimeError):
        scope.spawn(work())


async def test_the_daemon_runs_every_service_group_in_its_own_and_stops_them(
    tmp_path: Path,
) -> None:
    from metald.config import load_config
    from metald.daemon import Daemon
    from tests.test_daemon import free_port

    conf = tmp_path / "metald.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[api]\nlisten = "127.0.0.1:{free_port()}"\n'
        "guard_tenant_nodes = true\n"
    )
    d = Daemon(load_config(str(conf)))
    owners = [s for s in (d.services.fleet, *d.services.hosted()) if hasattr(s, "tasks")]
    names = {s.name for s in owners}
    assert {"fleet", "bmc", "tenant_node_guard", "token-sweeper", "commissioning_sel"} <= names
    await d.start()
    try:
        hosts = d.tasks.tasks()
        for svc in owners:
            assert svc.tasks.is_open and svc.tasks._host in hosts, svc.name
        assert (
            d.services.fleet is not None
            and d.services.fleet._task in d.services.fleet.tasks.tasks()
        )
    finally:
        await d.stop()
    assert not d.tasks.is_open and not d.tasks.tasks()
    assert all(not s.tasks.is_open and not s.tasks.tasks() for s in owners)


async def asyncio_sleep_forever() -> None:
    import asyncio

    await asyncio.Event().wait()


async def boom() -> None:
    raise ValueError("a task's failure")
