"""Which asyncio event loop runs metald: uvloop when installed, the standard one otherwise.

The config's top-level ``event_loop`` ("auto", "uvloop", "asyncio"; also
``METALD_EVENT_LOOP=asyncio`` through the usual environment override) chooses: benchmarks
compare the two in one run with it, and it is the fallback should uvloop misbehave on a host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str = "auto") -> tuple[str, Any]:
    """(name, factory) for ``choice``; "auto" falls back to asyncio without uvloop."""
    want = choice.strip().lower()
    if want not in CHOICES:
        raise ValueError(f"event_loop {want!r}: expected one of {', '.join(CHOICES)}")
    if want in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if want == "uvloop":
                raise
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run`` on the chosen loop."""
    _name, factory = loop_factory(choice)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
