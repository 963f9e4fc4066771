"""A BMC command already handed to the driver stops at this instance's lease end: no
retransmission or retry leaves after it fenced itself (its BMCs move 2 s later by default,
while the command's own budget is timeout_s x (retries + 1)). A BMC that never answers counts
what reaches it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metald.bmc import ownership
from metald.bmc.base import PowerAction
from metald.bmc.control import NotOwner
from metald.bmc.service import BmcService
from metald.config import BmcConfig
from metald.machines import create_machine
from metald.secrets import SecretBox
from metald.store import Store
from metald.store.models import Bmc
from tests.fleet.test_bmc_ownership import View, _instance

MARKER = b"end-of-test-marker"


class SilentBmc:
    """A UDP port on loopback that reads every datagram and answers none."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.packets = 0
        self.marked = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            if data == MARKER:
                self.marked.set()
            else:
                self.packets += 1

    def drain(self) -> int:
        """Every packet sent before this call has been read: the count then."""
        self.marked.clear()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(MARKER, ("127.0.0.1", self.port))
        assert self.marked.wait(30)
        return self.packets

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[SilentBmc]:
    bmc = SilentBmc()
    yield bmc
    bmc.close()


class Lease(View):
    until = float("inf")

    def lease_until(self) -> float:
        return self.until


async def test_a_command_in_flight_stops_at_the_lease_end(
    store: Store, tmp_path: Path, silent: SilentBmc
) -> None:
    box = SecretBox.from_file(tmp_path / "k")
    # Old budget: up to 2 x 3 s of retransmissions, long after the lease (0.3 s here) ended.
    cfg = BmcConfig(min_interval_ms=0, timeout_s=3, retries=1, power_sync_interval_s=0)
    svc = BmcService(store, box, cfg, instance="a")
    _instance(store, "a")

    def rows(s: Any) -> str:
        m = create_machine(s, macs=["52:54:00:00:20:01"], actor="test")
        s.add(
            Bmc(
                address="127.0.0.1",
                port=silent.port,
                protocol="ipmi",
                username="admin",
                password_enc=box.encrypt("pw"),
                machine_id=m.id,
            )
        )
        s.commit()
        return m.id

    mid = await store.run(rows)
    view = Lease("a", owner="a")
    svc.ownership = view
    real_run = store.run

    async def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        got = await real_run(fn, *args, **kwargs)
        if fn is ownership.check_and_journal:
            # The store confirmed ownership; the lease then has 0.3 s left (the heartbeat
            # stops landing from here on): the command is handed to the driver inside it.
            view.until = time.monotonic() + 0.3
        return got

    store.run = run  # type: ignore[method-assign]
    try:
        with pytest.raises(NotOwner) as e:
            await svc.control.power(mid, PowerAction.ON)
        assert "fenced itself while a command" in str(e.value)
        sent = silent.drain()
        assert sent >= 1  # the command did go out before the lease ended
        # Nothing is left to retransmit: no task still runs besides this test.
        await asyncio.sleep(0)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        assert silent.drain() == sent
        assert time.monotonic() >= view.until
    finally:
        store.run = real_run  # type: ignore[method-assign]
        await svc.stop()


async def test_a_lease_renewed_after_a_lapse_starts_a_new_epoch(store: Store) -> None:
    """Work bound to the lease goes on across renewals made in time, never across a lapse:
    a heartbeat that lands after this instance fenced itself starts a new epoch."""
    from metald.fleet.membership import Membership
    from tests.fleet.test_membership import Outage, wait_for

    link = Outage(store)
    a = Membership(link, "rack1", heartbeat_s=0.1, dead_after_s=0.6)  # type: ignore[arg-type]
    await a.start()
    try:
        epoch = a.lease_epoch
        before = a.lease_until()
        await wait_for(lambda: a.lease_until() > before)  # renewed in time: same epoch
        assert a.lease_epoch == epoch
        link.down = True
        await wait_for(lambda: a.fenced)
        link.down = False
        await wait_for(lambda: not a.fenced)
        assert a.lease_epoch == epoch + 1
    finally:
        await a.stop()
