"""What the daemon hosts: services with start/stop on the one asyncio loop, and the task
groups that own their background work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

log = logging.getLogger("metald.tasks")

T = TypeVar("T")


class Service(Protocol):
    """A long-running part of metald (API server, DHCP, TFTP, BMC scheduler ...).

    ``start`` returns once the service is serving (sockets bound); ``stop`` releases everything
    and returns once it has. Both are called on the daemon's loop.
    """

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def cancel(task: asyncio.Future[Any] | None) -> None:
    """Cancel a service's background task (if any) and return once it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True if it is set.

    What a service's loop sleeps on between rounds, instead of ``asyncio.wait_for(event.wait(),
    timeout)``: on Python 3.11 that returns the inner result when a cancel comes in the same
    loop pass as the event's wake-up, so the cancel is lost, the loop goes round again and its
    task group's ``close`` waits for it for ever (seen as a hung ``HealthWatch.stop``).
    ``asyncio.timeout`` keeps such a cancel."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def _logged(coro: Coroutine[Any, Any, T], scope: str, name: str | None) -> T | None:
    """A task of a scope: its failure is logged here and ends only itself, never its siblings
    (an ``asyncio.TaskGroup`` would otherwise cancel the whole group on one error)."""
    try:
        return await coro
    except Exception:
        log.exception("%s: background task %s failed", scope, name or "(unnamed)")
        return None


class TaskScope:
    """The background tasks of one service, in an ``asyncio.TaskGroup`` (hypercorn's habit).

    The group runs in a host task of its own, spawned into the ``parent`` scope when that one
    is open (the daemon's), so the daemon's group holds every service's group. ``open`` (the
    service's ``start``) holds the group open until ``close`` (its ``stop``), which cancels
    every task of the group and returns once they have ended.

    ``spawn`` needs an open scope and returns the task. ``start_soon`` may be called before
    ``open`` too (a service used without being started, as the API's tests do): it opens the
    group for as long as it has tasks. A task's failure is logged and ends only that task."""

    def __init__(self, name: str, parent: TaskScope | None = None) -> None:
        self.name = name
        self.parent = parent
        self._group: asyncio.TaskGroup | None = None
        self._host: asyncio.Task[Any] | None = None
        self._entered = asyncio.Event()
        self._closing = asyncio.Event()
        self._held = False
        self._pending: list[tuple[Coroutine[Any, Any, Any], str | None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake = asyncio.Event()

    def child(self, name: str) -> TaskScope:
        """A service's scope whose group runs inside this one's."""
        return TaskScope(name, parent=self)

    @property
    def is_open(self) -> bool:
        return self._group is not None

    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """The tasks running in the group now."""
        return frozenset(self._tasks)

    def _start_host(self) -> None:
        self._entered = asyncio.Event()
        self._closing = asyncio.Event()
        host = self._run(self._entered, self._closing)
        name = f"{self.name}-tasks"
        if self.parent is not None and self.parent.is_open:
            self._host = self.parent.spawn(host, name=name)
        else:
            # The root of a tree of scopes: the daemon's, or a service's used on its own.
            self._host = asyncio.get_running_loop().create_task(host, name=name)

    async def _run(self, entered: asyncio.Event, closing: asyncio.Event) -> None:
        me = asyncio.current_task()
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                entered.set()
                pending, self._pending = self._pending, []
                for coro, name in pending:
                    self._create(coro, name)
                # Held (open): until close. Not held (start_soon alone): until its last task.
                while not closing.is_set() and (self._held or self._tasks):
                    self._wake.clear()
                    await self._wake.wait()
                self._group = None
        finally:
            self._group = None
            if self._host is me:
                self._host = None
        if self._pending and self._host is None and not closing.is_set():
            self._start_host()  # start_soon while the group was ending

    def _create(self, coro: Coroutine[Any, Any, T], name: str | None) -> asyncio.Task[T | None]:
        assert self._group is not None
        task = self._group.create_task(_logged(coro, self.name, name), name=name)
        self._tasks.add(task)
        # A task cancelled before its first step never awaited ``coro``: close it quietly.
        task.add_done_callback(lambda _t: coro.close())
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._wake.set()

    async def open(self) -> None:
        """Hold the group open until ``close``; returns once it is."""
        self._held = True
        self._wake.set()
        if self._host is None or self._closing.is_set():
            self._start_host()
        elif self._entered.is_set() and self._group is None:
            self._start_host()  # the unheld group is ending: a fresh one
        await self._entered.wait()

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str | None = None
    ) -> asyncio.Task[T | None]:
        """Run ``coro`` in the group and return its task (the scope must be open)."""
        if self._group is None:
            coro.close()
            raise RuntimeError(f"{self.name}: its task group is not open (start the service)")
        return self._create(coro, name)

    def start_soon(self, coro: Coroutine[Any, Any, Any], *, name: str | None = None) -> None:
        """Run ``coro`` in the group, opening it for as long as it has tasks if it is not."""
        if self._group is not None:
            self._create(coro, name)
            return
        self._pending.append((coro, name))
        if self._host is None:
            self._start_host()

    async def drain(self) -> None:
        """Wait until every task of the group, and every one queued for it, has ended."""
        while self._pending or self._tasks:
            if self._tasks:
                await asyncio.wait(set(self._tasks))
            elif not self._entered.is_set():
                await self._entered.wait()
            else:
                await asyncio.sleep(0)  # a fresh group is about to take the queued ones

    async def close(self) -> None:
        """Cancel every task of the group and return once they, and the group, have ended."""
        self._held = False
        host, self._host = self._host, None
        self._closing.set()
        self._wake.set()
        pending, self._pending = self._pending, []
        for coro, _ in pending:
            coro.close()
        for task in list(self._tasks):
            task.cancel()
        if host is None:
            return
        if not self._entered.is_set():
            host.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await host
