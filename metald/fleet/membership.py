"""This instance's membership in the fleet: register, heartbeat, know who is alive, own a share.

Ownership is computed, not stored: the owner of an object is the rendezvous-hash winner among
the live instances eligible for it. Every instance refreshes the member list at each heartbeat,
so when one dies the survivors agree on its objects' new owners one heartbeat after it is
judged dead (``dead_after_s``).

Self-fencing: an instance that has not written a heartbeat for ``dead_after_s - heartbeat_s``
(cut off from the store, or stalled) stops claiming anything, before the others can judge it
dead and take its share, so one object never has two owners acting at once. The heartbeat runs
on its own thread and connection (``Store.heartbeat``) so request work cannot delay it into
fencing; work bound to the lease (BMC commands) ends at ``lease_until()`` and does not survive a
lapse (``lease_epoch``).

The heartbeat is also *driven* from a thread of its own (with a small event loop of its own),
not from the daemon's loop: under CPU starvation the daemon's loop lags by seconds behind its
queue of DHCP packets and HTTP requests, and a heartbeat scheduled on it, and whose answer is
handled on it, came late enough to fence an instance whose peers were just as starved (every
instance of a 10,000-machine storm fenced itself 5-13 times, issue 33). The daemon's loop still
vouches for itself: it ticks a clock the heartbeat thread reads, and a loop that has not ticked
for ``loop_stall_s`` (a deadlock, a callback that never returns) gets no more heartbeats, so the
instance fences itself and is taken over as if it had died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from ipaddress import ip_address, ip_network
from typing import Any

from prometheus_client import Gauge, Histogram

from metald import __version__
from metald.fleet import registry
from metald.fleet.registry import Member
from metald.fleet.rendezvous import owner
from metald.metrics import REGISTRY
from metald.service import TaskScope, cancel
from metald.store import Store

log = logging.getLogger("metald.fleet")

fenced_gauge = Gauge(
    "metald_fleet_fenced",
    "1 while this instance is fenced (no heartbeat confirmed within its lease): it owns nothing",
    registry=REGISTRY,
)
loop_lag = Histogram(
    "metald_event_loop_lag_seconds",
    "How late the daemon's event loop ran a timer (the fleet's loop watch, every ~0.25 s)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
    registry=REGISTRY,
)


def _in_networks(address: str, networks: list[str]) -> bool:
    """Whether a BMC address lies in one of the CIDRs; an unparseable host name is eligible
    everywhere (its address is only known to the resolver)."""
    if not networks:
        return True
    host = address.split("://", 1)[-1].split("/", 1)[0]
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        ip = ip_address(host)
    except ValueError:
        return True
    return any(ip in ip_network(n, strict=False) for n in networks)


class Membership:
    """The ``fleet`` service: heartbeat and ownership for this instance."""

    name = "fleet"

    def __init__(
        self,
        store: Store,
        instance: str,
        *,
        heartbeat_s: float = 2.0,
        dead_after_s: float = 10.0,
        api_url: str | None = None,
        serves: dict[str, Any] | None = None,
        tasks: TaskScope | None = None,
        loop_stall_s: float = 20.0,
    ) -> None:
        if dead_after_s <= heartbeat_s:
            raise ValueError("fleet.dead_after_s must be longer than fleet.heartbeat_s")
        self.store = store
        self.instance = instance
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        #: The daemon's loop not seen running for this long: no more heartbeats (it is hung).
        self.loop_stall_s = loop_stall_s
        self.api_url = api_url
        self.serves = serves or {}
        #: This process holds the store alone (SQLite's lock): a name still marked alive in it
        #: belongs to a process that is gone.
        self.sole_user = False
        self.incarnation = str(uuid.uuid4())
        self._members: list[Member] = []
        #: Monotonic time the member list (and its heartbeat ages) was read.
        self.members_at = time.monotonic()
        self._last_ok: float | None = None
        #: Bumped whenever a heartbeat lands after the lease it renews had already ended: work
        #: started under an older epoch was interrupted by a fenced moment and must not go on
        #: under the new lease (its objects may have moved meanwhile).
        self.lease_epoch = 0
        self._taken_over = False
        self._said_fenced = False
        self._said_stalled = False
        #: The daemon's loop watch's tasks; the daemon's scope holds it (``tasks=``).
        self.tasks = tasks if tasks is not None else TaskScope(self.name)
        self._task: asyncio.Task[None | None] | None = None
        self._listeners: list[Callable[[], None]] = []
        #: The daemon's loop (listeners run there) and the last time it ran the watch.
        self._main: asyncio.AbstractEventLoop | None = None
        self.loop_tick = time.monotonic()
        self._seen = self._view()
        #: The heartbeat's thread and its own loop (``_beats``).
        self._thread: threading.Thread | None = None
        self._beat_loop: asyncio.AbstractEventLoop | None = None
        self._beat_task: asyncio.Task[None] | None = None

    @property
    def members(self) -> list[Member]:
        return self._members

    @members.setter
    def members(self, members: list[Member]) -> None:
        self._members, self.members_at = members, time.monotonic()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the daemon's loop) whenever the live set or this instance's
        fencing changes, so owners act at once instead of at their next interval."""
        self._listeners.append(callback)

    def _view(self) -> tuple[frozenset[str], bool]:
        return frozenset(m.name for m in self.live()), self.fenced

    def _check(self) -> None:
        """On the daemon's loop: tell the listeners if the view changed since they last heard."""
        fenced, said, self._said_fenced = self.fenced, self._said_fenced, self.fenced
        if fenced and not said:
            # Said once, at the fencing deadline, not when the hung store call finally fails.
            log.error(
                "fenced: no heartbeat written for %.1f s; owning nothing (no BMC commands, "
                "no DHCP answers, no hubs) until the store answers again",
                self.fence_after_s,
            )
        view = self._view()
        if view != self._seen:
            self._seen = view
            for cb in self._listeners:
                cb()

    def _changed(self) -> None:
        """Have ``_check`` run on the daemon's loop: now when called there, else soon."""
        main = self._main
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if main is None or running is main:
            self._check()
        elif not main.is_closed():
            with contextlib.suppress(RuntimeError):  # the daemon's loop closed meanwhile
                main.call_soon_threadsafe(self._check)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        started = time.monotonic()
        await self.store.run(
            registry.register,
            name=self.instance,
            incarnation=self.incarnation,
            version=__version__,
            api_url=self.api_url,
            host=socket.gethostname(),
            serves=self.serves,
            dead_after_s=self.dead_after_s,
            pid=os.getpid(),
            sole_user=self.sole_user,
        )
        self._last_ok = started
        await self.refresh()
        self._main = asyncio.get_running_loop()
        self.loop_tick = time.monotonic()
        self._seen = self._view()
        # Read when scraped: one Membership per process (the last started, in tests).
        fenced_gauge.set_function(lambda: 1.0 if self.fenced else 0.0)
        await self.tasks.open()
        self._task = self.tasks.spawn(self._watch(), name="fleet-loop-watch")
        self.start_beats()

    def start_beats(self) -> None:
        """Start the heartbeat's thread (``start`` does; tests that drive beats by hand don't
        call it again after ``stop_beats``)."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._beat_loop = loop
            self._beat_task = loop.create_task(self._beats())
            ready.set()
            try:
                loop.run_until_complete(self._beat_task)
            except asyncio.CancelledError:
                pass
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=run, name="fleet-heartbeat", daemon=True)
        self._thread.start()
        ready.wait()

    async def stop_beats(self) -> None:
        thread, loop, task = self._thread, self._beat_loop, self._beat_task
        self._thread = self._beat_loop = self._beat_task = None
        if thread is None or loop is None or task is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop already ended
            loop.call_soon_threadsafe(task.cancel)
        # A heartbeat stuck in the store's lane is abandoned (its thread is the store's).
        await asyncio.to_thread(thread.join, 10)

    async def stop(self) -> None:
        await self.stop_beats()
        await cancel(self._task)
        self._task = None
        await self.tasks.close()
        if not self._taken_over:
            try:
                # On the heartbeat's lane (one thread, first in first out): after a heartbeat
                # still in flight there, whose commit would otherwise land after this one and,
                # clearing ``stopped_at``, show a stopped instance alive until dead_after_s
                # (its share not taken over meanwhile; a restart refused under its name).
                await self.store.heartbeat(
                    registry.mark_stopped,
                    self.instance,
                    self.incarnation,
                    timeout_s=self.beat_timeout_s,
                )
            except Exception:  # noqa: BLE001 - the others then wait out dead_after_s
                log.warning("could not record this instance as stopped", exc_info=True)

    def health(self) -> str:
        if self._taken_over:
            return "taken over by another process"
        return "fenced (store unreachable)" if self.fenced else "running"

    async def _watch(self) -> None:
        """On the daemon's loop: tick the clock the heartbeat thread reads (this loop runs),
        measure how late it runs, and tell listeners at the fencing deadline itself (BMC
        sessions end, hubs go down), not up to a heartbeat later."""
        tick = min(0.25, self.heartbeat_s / 2)
        said_at = 0.0
        worst = 0.0
        while True:
            planned = time.monotonic() + tick
            until = self.lease_until()
            wake = until + 0.001 if planned - tick < until < planned else planned
            await asyncio.sleep(max(0.0, wake - time.monotonic()))
            now = time.monotonic()
            lag = max(0.0, now - wake)
            self.loop_tick = now
            loop_lag.observe(lag)
            worst = max(worst, lag)
            if worst >= 1.0 and now - said_at >= 10.0:
                log.warning("event loop ran %.1f s late (worst in the last 10 s)", worst)
                said_at, worst = now, 0.0
            self._check()

    async def _beats(self) -> None:
        """On the heartbeat's thread: a heartbeat every ``heartbeat_s``, whatever the daemon's
        loop is doing. A heartbeat that hangs on an unreachable store must not stop the clock:
        fencing is judged by time (``lease_until``), and the daemon's loop watch tells the
        listeners when it passes."""
        beat: asyncio.Task[None] | None = None
        try:
            while True:
                if beat is None or beat.done():
                    beat = asyncio.ensure_future(self.beat_once())
                await asyncio.sleep(self.heartbeat_s)
        finally:
            await cancel(beat)

    async def beat_once(self) -> None:
        try:
            await self._beat()
        finally:
            self._changed()

    async def _beat(self, *, again: bool = True) -> None:
        stalled = time.monotonic() - self.loop_tick
        if self._main is not None and stalled > self.loop_stall_s:
            # The daemon's loop has not run for this long (hung, not just slow): its work
            # must stop and be taken over, as if it had died. No heartbeat, so it fences.
            if not self._said_stalled:
                log.error(
                    "the event loop has not run for %.0f s: no heartbeat, this instance fences "
                    "itself and the others take over its share",
                    stalled,
                )
            self._said_stalled = True
            return
        if self._said_stalled:
            log.warning("the event loop runs again: heartbeats resume")
            self._said_stalled = False
        was_fenced = self.fenced
        started = time.monotonic()  # the store's heartbeat time is at or after this moment
        try:
            mine = await self.store.heartbeat(
                registry.beat, self.instance, self.incarnation, timeout_s=self.beat_timeout_s
            )
        except Exception as e:  # noqa: BLE001 - a store outage is survived, fenced
            log.warning("heartbeat failed (%s): %s", type(e).__name__, e)
            return
        if not mine:
            if not self._taken_over:
                log.error(
                    "instance %s was registered by another process: this one owns nothing",
                    self.instance,
                )
            self._taken_over = True
            return
        if again and started + self.fence_after_s < time.monotonic() + self.heartbeat_s:
            # This heartbeat hung (a cut link that healed without a reset) and landed too late
            # to hold the lease, counted from when it was sent, until the next one is due:
            # write a fresh one at once rather than leave the fence for a moment and fence
            # again (owners would let go, take back and let go).
            await self._beat(again=False)
            return
        if time.monotonic() >= self.lease_until():
            self.lease_epoch += 1
        self._last_ok = started
        if was_fenced:
            log.warning("heartbeat written again: no longer fenced")
        try:
            await self.refresh()
        except Exception as e:  # noqa: BLE001
            log.warning("reading the fleet's members failed: %s", e)

    async def refresh(self) -> None:
        self.members = await self.store.heartbeat(
            registry.members, self.dead_after_s, timeout_s=self.beat_timeout_s
        )

    # --- ownership -------------------------------------------------------------------------

    @property
    def beat_timeout_s(self) -> float:
        """A heartbeat statement's bound: half the fencing age, so a heartbeat stuck on a lock
        fails and the next one still lands before this instance fences itself."""
        return self.fence_after_s / 2

    @property
    def fence_after_s(self) -> float:
        return self.dead_after_s - self.heartbeat_s

    def lease_until(self) -> float:
        """The monotonic time this instance fences itself at, from its last heartbeat (0 when
        it holds nothing). A store call that confirmed ownership is acted on only before the
        deadline read *before* the call: a reply delayed on a cut link (TCP retransmits it
        after the link heals) can arrive after the others took over, and a heartbeat written
        since then does not make the old answer true again."""
        if self._taken_over or self._last_ok is None:
            return 0.0
        if self.sole_user:
            # SQLite's lock: no other instance can run on this store, so none can take over;
            # fencing would only stop the one instance there is (a slow disk is not a cut).
            return math.inf
        return self._last_ok + self.fence_after_s

    @property
    def fenced(self) -> bool:
        return time.monotonic() >= self.lease_until()

    def live(self) -> list[Member]:
        return [m for m in self.members if m.alive or m.name == self.instance]

    def bmc_owner(self, bmc_id: str, address: str) -> str | None:
        """The live instance that owns a BMC: the rendezvous winner among live instances whose
        ``[bmc] networks`` hold its address."""
        eligible = [
            m.name
            for m in self.live()
            if _in_networks(address, list(m.serves.get("bmc_networks") or []))
        ]
        return owner(f"bmc:{bmc_id}", eligible)

    def owns_bmc(self, bmc_id: str, address: str) -> bool:
        return not self.fenced and self.bmc_owner(bmc_id, address) == self.instance

    def hub_owner(self, tenant_id: str) -> str | None:
        """The live instance with ``[tenants] hubs = true`` that runs a tenant's hub."""
        return owner(f"hub:{tenant_id}", [m.name for m in self.live() if m.serves.get("hubs")])

    def owns_hub(self, tenant_id: str) -> bool:
        return not self.fenced and self.hub_owner(tenant_id) == self.instance

    def key_owner(self, key: str) -> str | None:
        """The live instance that owns an object every instance may own (a sweep, a machine
        without a BMC): the rendezvous winner among all live instances."""
        return owner(key, [m.name for m in self.live()])

    def owns_key(self, key: str) -> bool:
        return not self.fenced and self.key_owner(key) == self.instance

    def owns_machine(self, machine_id: str, bmc: tuple[str, str] | None) -> bool:
        """Whether this instance sweeps a machine: the owner of its BMC (``bmc`` is its id and
        address), or for a machine without one the rendezvous owner of ``machine:<id>``."""
        if bmc is not None:
            return self.owns_bmc(*bmc)
        return self.owns_key(f"machine:{machine_id}")
