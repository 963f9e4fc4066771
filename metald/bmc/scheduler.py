"""Everything between "run this BMC command" and the driver: written once, for every protocol.

- Commands to one BMC run one at a time, in arrival order, at least ``min_interval_s`` apart:
  BMCs are small computers that drop sessions or wedge when hammered.
- At most ``max_concurrency`` commands are in flight across the fleet.
- Each attempt has a deadline; retryable failures are retried with full-jitter exponential
  backoff, so a rack that failed together does not retry together. Auth failures are never
  retried (that only locks accounts). A non-idempotent command (power cycle) is not re-sent when
  the failed attempt may have reached the BMC: a cycle done twice is worse than an error.
- Each BMC has a health state (ok, auth-failed, unreachable, error), changed only here.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from prometheus_client import Counter, Histogram

from metald.bmc.base import (
    BmcAuthError,
    BmcError,
    BmcTimeout,
    BmcUnreachable,
    BmcUnsupported,
)
from metald.metrics import REGISTRY

log = logging.getLogger(__name__)
T = TypeVar("T")

commands = Counter(
    "metald_bmc_commands_total",
    "BMC commands by operation and outcome",
    ["op", "result"],
    registry=REGISTRY,
)
attempts_retried = Counter(
    "metald_bmc_retries_total",
    "BMC command attempts retried after a failure",
    ["op"],
    registry=REGISTRY,
)
command_seconds = Histogram(
    "metald_bmc_command_seconds",
    "BMC command latency, queueing and retries included",
    ["op"],
    registry=REGISTRY,
)


class Health(StrEnum):
    UNKNOWN = "unknown"
    OK = "ok"
    AUTH_FAILED = "auth-failed"
    UNREACHABLE = "unreachable"
    ERROR = "error"


def health_after(exc: BaseException | None) -> Health | None:
    """The health an outcome proves; None where it proves nothing about the BMC."""
    if exc is None or isinstance(exc, BmcUnsupported):
        return Health.OK  # it answered, if only to say no
    if isinstance(exc, BmcAuthError):
        return Health.AUTH_FAILED
    if isinstance(exc, BmcUnreachable | BmcTimeout):
        return Health.UNREACHABLE
    if isinstance(exc, BmcError):
        return Health.ERROR
    return None


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
    return rng.uniform(0.0, min(cap_s, base_s * (2**attempt)))


@dataclass
class _Lane:
    """One BMC's queue: a FIFO lock and when its last command ended."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_end: float = float("-inf")
    health: Health = Health.UNKNOWN
    detail: str | None = None


HealthListener = Callable[[str, Health, str | None], Any]


class BmcScheduler:
    def __init__(
        self,
        *,
        max_concurrency: int = 256,
        min_interval_s: float = 0.2,
        timeout_s: float = 10.0,
        retries: int = 3,
        backoff_base_s: float = 0.25,
        backoff_cap_s: float = 8.0,
        on_health: HealthListener | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self.on_health = on_health
        self._rng = rng or random.Random()
        self._slots = asyncio.Semaphore(max_concurrency)
        self._lanes: dict[str, _Lane] = {}
        self.in_flight = 0
        self.peak_in_flight = 0

    def health(self, key: str) -> tuple[Health, str | None]:
        lane = self._lanes.get(key)
        return (lane.health, lane.detail) if lane else (Health.UNKNOWN, None)

    def forget(self, key: str) -> None:
        self._lanes.pop(key, None)

    async def run(
        self,
        key: str,
        op: Callable[[], Awaitable[T]],
        *,
        name: str,
        idempotent: bool = True,
        timeout_s: float | None = None,
    ) -> T:
        """Run ``op`` for the BMC ``key`` under the rules above; raises the last BmcError."""
        lane = self._lanes.setdefault(key, _Lane())
        started = time.monotonic()
        async with lane.lock:
            try:
                result = await self._attempts(
                    lane, op, name, idempotent, timeout_s or self.timeout_s
                )
            except BaseException as e:
                self._set_health(key, lane, e)
                commands.labels(name, type(e).__name__).inc()
                raise
            finally:
                lane.last_end = asyncio.get_running_loop().time()
                command_seconds.labels(name).observe(time.monotonic() - started)
            self._set_health(key, lane, None)
            commands.labels(name, "ok").inc()
            return result

    async def _attempts(
        self,
        lane: _Lane,
        op: Callable[[], Awaitable[T]],
        name: str,
        idempotent: bool,
        timeout_s: float,
    ) -> T:
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            wait = lane.last_end + self.min_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                async with self._slots:
                    self.in_flight += 1
                    self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                    try:
                        # asyncio.timeout, not wait_for: no extra task per command.
                        async with asyncio.timeout(timeout_s):
                            return await op()
                    finally:
                        self.in_flight -= 1
                        lane.last_end = loop.time()
            except TimeoutError:
                err: BmcError = BmcTimeout(f"no answer within {timeout_s:g} s")
                err.maybe_delivered = True
            except BmcError as e:
                err = e
            if not err.retryable or attempt >= self.retries:
                raise err
            if not idempotent and err.maybe_delivered:
                raise err
            delay = backoff_delay(attempt, self.backoff_base_s, self.backoff_cap_s, self._rng)
            log.info("BMC %s failed (%s), retry %d in %.2f s", name, err, attempt + 1, delay)
            attempts_retried.labels(name).inc()
            attempt += 1
            await asyncio.sleep(delay)

    def _set_health(self, key: str, lane: _Lane, exc: BaseException | None) -> None:
        new = health_after(exc)
        if new is None:
            return
        detail = None if exc is None or new is Health.OK else str(exc)
        if (new, detail) == (lane.health, lane.detail):
            return
        old = lane.health
        lane.health, lane.detail = new, detail
        if old is not new:
            log.info("BMC %s health %s -> %s%s", key, old, new, f": {detail}" if detail else "")
        if self.on_health is not None:
            self.on_health(key, new, detail)
