"""A metald-like process that carries remediations forward and hangs at a chosen point, for the
kill -9 tests: ``python -m tests.healthwatch.crash_child DB_URL CALLS HANG_AT``.

The scheduler appends each call to ``CALLS`` (one JSON line) so the survivor's test sees what
either process did. ``HANG_AT``: ``drain`` (after the drain reached the scheduler, before its
step is written) or ``replace`` (inside the replacement's transaction, the spare locked); the
process writes ``CALLS.hung`` and sleeps there until it is killed."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from metald.provision import netboot
from metald.store import Store
from tests.healthwatch.helpers import FakeScheduler, health_cfg, workflow


class FileScheduler(FakeScheduler):
    """``FakeScheduler`` whose calls are appended to a file (shared across processes)."""

    def __init__(self, path: Path, hang_at: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.hang_at = hang_at

    def _log(self, op: str, node: str) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps([op, node]) + "\n")
        if op == self.hang_at:
            hang(self.path)

    def drain(self, node: str, reason: str) -> None:
        super().drain(node, reason)
        self._log("drain", node)

    def remove_node(self, node: str, reason: str) -> None:
        super().remove_node(node, reason)
        self._log("remove", node)


def hang(path: Path) -> None:
    Path(f"{path}.hung").write_text("1")
    while True:
        time.sleep(1)


class HangingBoot:
    def __init__(self, path: Path) -> None:
        self.path = path

    def start_provisioning(self, session: Any, machine_ids: list[str], **kw: Any) -> list[str]:
        hang(self.path)
        return netboot.start_provisioning(session, machine_ids, **kw)


def calls(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


async def main(url: str, path: Path, hang_at: str) -> None:
    store = Store(url)
    sched = FileScheduler(path, hang_at if hang_at != "replace" else None)
    kw = {"boot": HangingBoot(path)} if hang_at == "replace" else {}
    wf = workflow(store, sched, health_cfg(), "doomed", **kw)
    await wf.run_all()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
