"""Waiting for a condition in a test: poll it until it holds, with a deadline that only stops
a hung test (it decides nothing; no test sleeps for a duration)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _failed(what: str, explain: Callable[[], str] | None) -> AssertionError:
    return AssertionError(f"never happened: {what}" + (f"\n{explain()}" if explain else ""))


def wait_for(
    what: str,
    cond: Callable[[], T],
    timeout: float = 60.0,
    *,
    every: float = 0.05,
    ignore: tuple[type[BaseException], ...] = (),
    explain: Callable[[], str] | None = None,
) -> T:
    """``cond()``'s first truthy value, polled every ``every`` seconds; past ``timeout`` an
    AssertionError naming ``what`` (and ``explain()``: a log, the lab's state). An exception
    in ``ignore`` counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except ignore:
            got = None  # type: ignore[assignment]
        if got:
            return got
        if time.monotonic() > deadline:
            raise _failed(what, explain)
        time.sleep(every)


async def eventually(
    what: str, cond: Callable[[], T], timeout: float = 20.0, *, every: float = 0.005
) -> T:
    """``wait_for`` inside an event loop: polls without blocking it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (got := cond()):
        if loop.time() > deadline:
            raise _failed(what, None)
        await asyncio.sleep(every)
    return got
