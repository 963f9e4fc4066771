"""Serial consoles of machines, through their BMCs: one shared link per machine, many viewers,
one writer, and the last 64 KiB kept for whoever attaches later.

The ``console`` daemon service owns every link and the task that keeps each one up: the first
viewer of a machine opens its BMC's Serial-over-LAN (``metald.bmc.sol_link``), a link that
drops is re-opened with backoff while anyone watches, and the link closes ``linger_s`` after
the last viewer leaves (SOL is one per BMC: holding it idle would lock out ipmitool at the
rack). What the console printed stays in the machine's ring buffer in this process's memory,
never in the store. Attaching and leaving are events naming who, and in which mode.

A viewer is a bounded queue: one that falls ``max_queued`` chunks behind is cut off (its
WebSocket closes with a reason) rather than letting a slow client grow memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from metald.bmc.base import BmcAuthError, BmcError
from metald.errors import MetaldError
from metald.limits import Hold, Limiter
from metald.machines import add_event
from metald.store.db import Store

log = logging.getLogger(__name__)

RING_BYTES = 64 * 1024
LINGER_S = 60.0
MAX_QUEUED = 1024
BACKOFF_S = (1.0, 2.0, 5.0, 10.0)


class ConsoleUnsupported(MetaldError):
    status = 409
    title = "No serial console"


class WriterTaken(MetaldError):
    status = 409
    title = "Console writer already attached"


class RingBuffer:
    """The last ``size`` bytes written."""

    def __init__(self, size: int = RING_BYTES) -> None:
        self.size = size
        self._buf = bytearray()

    def append(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) > self.size:
            del self._buf[: len(self._buf) - self.size]

    def snapshot(self) -> bytes:
        return bytes(self._buf)

    def __len__(self) -> int:
        return len(self._buf)


#: Builds the link for a machine, given where its output goes. Raises ConsoleUnsupported when
#: the machine's BMC has no console metald speaks.
LinkFactory = Callable[[str, Callable[[bytes], None]], Awaitable[Any]]


@dataclass(eq=False)
class Viewer:
    actor: str
    writer: bool
    #: Console output (bytes) and status notes (dicts); None: cut off, with ``cut_reason``.
    queue: asyncio.Queue[bytes | dict[str, Any] | None] = field(
        default_factory=lambda: asyncio.Queue(MAX_QUEUED)
    )
    cut_reason: str | None = None
    #: Its place under the service's viewer caps (``ConsoleService.limiter``).
    hold: Hold | None = None

    def offer(self, item: bytes | dict[str, Any]) -> None:
        if self.cut_reason is not None:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            self.cut_reason = "this viewer fell too far behind the console and was cut off"
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.get_nowait()
                self.queue.put_nowait(None)


@dataclass(eq=False)
class MachineConsole:
    machine_id: str
    ring: RingBuffer = field(default_factory=RingBuffer)
    viewers: set[Viewer] = field(default_factory=set)
    writer: Viewer | None = None
    link: Any = None
    state: str = "idle"
    detail: str | None = None
    task: asyncio.Task[None] | None = None
    linger: asyncio.TimerHandle | None = None

    def output(self, data: bytes) -> None:
        self.ring.append(data)
        for v in self.viewers:
            v.offer(data)

    def note(self, state: str, detail: str | None = None) -> None:
        self.state, self.detail = state, detail
        for v in self.viewers:
            v.offer({"type": "status", "state": state, "detail": detail})


class ConsoleService:
    name = "console"

    def __init__(
        self,
        store: Store,
        instance: str,
        link_factory: LinkFactory,
        *,
        linger_s: float = LINGER_S,
        backoff_s: tuple[float, ...] = BACKOFF_S,
        viewers_per_token: int = 8,
        viewers_per_machine: int = 16,
        viewers_max: int = 256,
    ) -> None:
        self.store = store
        self.instance = instance
        self.link_factory = link_factory
        self.linger_s = linger_s
        self.backoff_s = backoff_s
        self.consoles: dict[str, MachineConsole] = {}
        #: Viewers held at once per token, per machine and in this instance (``bmc.console_
        #: viewers_*``; the same mechanism as event streams and mesh long-polls).
        self.limiter = Limiter(
            "console viewers",
            total=viewers_max,
            per={"token": viewers_per_token, "machine": viewers_per_machine},
            retry_after_s=5,
            advice="retry once a viewer has left",
        )
        self._stopping = False

    async def start(self) -> None:
        self._stopping = False

    async def stop(self) -> None:
        self._stopping = True
        for c in list(self.consoles.values()):
            for v in list(c.viewers):
                v.cut_reason = "metald is stopping"
                v.offer({"type": "status", "state": "stopping", "detail": None})
                with contextlib.suppress(asyncio.QueueFull):
                    v.queue.put_nowait(None)
            await self._shut(c)

    async def check(self, machine_id: str) -> None:
        """Raise the reason the machine can have no console (no BMC, a protocol without one),
        so the API answers with a problem before any WebSocket opens."""
        check = getattr(self.link_factory, "check", None)
        if check is not None:
            await check(machine_id)

    # --- viewers ---

    async def attach(
        self, machine_id: str, actor: str, mode: str, token: str = ""
    ) -> tuple[Viewer, bytes]:
        """A viewer of the machine's console and the buffered output to show it first.
        ``mode``: write (409 if someone writes), read, or auto (write when free). Past a cap
        (``limiter``: per ``token``, per machine, in all) a 429, before any event is written."""
        c = self.consoles.get(machine_id)
        if mode == "write" and c is not None and c.writer is not None:
            raise WriterTaken(
                f"{c.writer.actor} is typing on this console; attach read-only "
                "(mode=read) or ask them to leave",
                writer=c.writer.actor,
            )
        hold = self.limiter.take(token=token or actor, machine=machine_id)
        if c is None:
            c = self.consoles[machine_id] = MachineConsole(machine_id)
        writes = mode == "write" or (mode == "auto" and c.writer is None)
        v = Viewer(actor=actor, writer=writes, hold=hold)
        if c.linger is not None:
            c.linger.cancel()
            c.linger = None
        c.viewers.add(v)
        if writes:
            c.writer = v
        try:
            await self._event("console.attached", machine_id, actor, v)
        except BaseException:
            c.viewers.discard(v)
            if c.writer is v:
                c.writer = None
            self.limiter.give(hold)
            raise
        if c.task is None or c.task.done():
            c.task = asyncio.get_running_loop().create_task(
                self._keep_up(c), name=f"console {machine_id}"
            )
        return v, c.ring.snapshot()

    async def detach(self, machine_id: str, v: Viewer) -> None:
        c = self.consoles.get(machine_id)
        if c is None or v not in c.viewers:
            return
        c.viewers.discard(v)
        if v.hold is not None:
            self.limiter.give(v.hold)
        if c.writer is v:
            c.writer = None
        await self._event("console.detached", machine_id, v.actor, v)
        if not c.viewers and not self._stopping:
            c.linger = asyncio.get_running_loop().call_later(
                self.linger_s, lambda: asyncio.ensure_future(self._idle(c))
            )

    def type(self, machine_id: str, v: Viewer, data: bytes) -> bool:
        """Keys from a viewer; False (nothing sent) unless it is the writer and a link is up."""
        c = self.consoles.get(machine_id)
        if c is None or c.writer is not v or c.link is None:
            return False
        c.link.write(data)
        return True

    def send_break(self, machine_id: str, v: Viewer) -> bool:
        c = self.consoles.get(machine_id)
        if c is None or c.writer is not v or c.link is None:
            return False
        c.link.send_break()
        return True

    def status(self, machine_id: str) -> dict[str, Any]:
        c = self.consoles.get(machine_id)
        if c is None:
            return {"state": "idle", "detail": None, "writer": None, "viewers": 0}
        return {
            "state": c.state,
            "detail": c.detail,
            "writer": c.writer.actor if c.writer else None,
            "viewers": len(c.viewers),
            "watching": sorted(v.actor for v in c.viewers),
        }

    # --- the link ---

    async def _keep_up(self, c: MachineConsole) -> None:
        """Open the link, and re-open it with backoff when it drops, while anyone watches."""
        failures = 0
        while c.viewers and not self._stopping:
            c.note("connecting")
            try:
                link = await self.link_factory(c.machine_id, c.output)
                await link.open()
            except ConsoleUnsupported as e:
                c.note("unsupported", e.detail)
                return
            except MetaldError as e:  # the BMC was unlinked or removed meanwhile
                c.note("failed", e.detail)
                return
            except (BmcError, OSError) as e:
                failures += 1
                c.note("reconnecting", f"{e}; retrying")
                if isinstance(e, BmcAuthError) and failures > 2:
                    c.note("failed", str(e))
                    return
                await asyncio.sleep(self.backoff_s[min(failures, len(self.backoff_s)) - 1])
                continue
            c.link = link
            failures = 0
            c.note("connected", "took over an SOL session left active" if link.took_over else None)
            try:
                reason = await link.closed
            finally:
                c.link = None
            if not c.viewers or self._stopping:
                break
            if getattr(getattr(link, "core", None), "deactivated", False):
                # Someone took SOL (ipmitool at the rack): taking it back at once would fight
                # them; a viewer attaching again takes it back on purpose.
                c.note("ended", f"{reason}; attach again to take the console back")
                for v in list(c.viewers):
                    v.cut_reason = reason
                    v.offer({"type": "status", "state": "ended", "detail": reason})
                    with contextlib.suppress(asyncio.QueueFull):
                        v.queue.put_nowait(None)
                break
            c.note("reconnecting", reason)
            failures += 1
            await asyncio.sleep(self.backoff_s[min(failures, len(self.backoff_s)) - 1])

    async def _idle(self, c: MachineConsole) -> None:
        if c.viewers:
            return
        await self._shut(c)
        c.note("idle")

    async def _shut(self, c: MachineConsole) -> None:
        if c.linger is not None:
            c.linger.cancel()
            c.linger = None
        link = c.link
        if link is not None:
            with contextlib.suppress(Exception):
                await link.close()
        if c.task is not None and not c.task.done():
            c.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await c.task
        c.task = None

    async def _event(self, kind: str, machine_id: str, actor: str, v: Viewer) -> None:
        mode = "write" if v.writer else "read"

        def write(s: Any) -> None:
            add_event(
                s,
                kind,
                actor,
                machine_id=machine_id,
                reason=f"{actor} {'attached to' if kind.endswith('attached') else 'left'} "
                f"the serial console ({mode})",
                data={"mode": mode},
                instance=self.instance,
            )
            s.commit()

        try:
            await self.store.run(write)
        except Exception:  # noqa: BLE001 - an audit row must not break the console itself
            log.exception("recording %s for %s failed", kind, machine_id)
