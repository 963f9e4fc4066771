"""How many long-held things (event streams, mesh long-polls, console viewers) one caller and
one instance may hold at once.

A ``Limiter`` counts holds in all and per key of each kind it is told about (a token, a
machine); ``take`` refuses past any cap with a 429 problem that carries ``Retry-After``, before
anything is held, so a refused caller costs nothing but its refusal. Every such cap in metald
is an instance of this one class (docs/security.md, "Held connections")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from metald.errors import MetaldError


class TooMany(MetaldError):
    status = 429
    title = "Too many at once"


@dataclass(frozen=True, eq=False)
class Hold:
    """One thing held: the keys it counts against (kind -> key)."""

    keys: tuple[tuple[str, str], ...]


class Limiter:
    """Caps what is held at once: ``total`` in this instance and ``per[kind]`` for each key of
    that kind (``take(token=..., machine=...)``)."""

    def __init__(
        self,
        what: str,
        *,
        total: int,
        per: Mapping[str, int],
        retry_after_s: int = 5,
        advice: str = "retry later",
        error: type[MetaldError] = TooMany,
    ) -> None:
        self.what = what
        self.total = total
        self.per = dict(per)
        self.retry_after_s = max(1, int(retry_after_s))
        self.advice = advice
        self.error = error
        self._holds: set[Hold] = set()
        self._counts: dict[str, Counter[str]] = {kind: Counter() for kind in self.per}

    def _refuse(self, detail: str) -> MetaldError:
        return self.error(detail, retry_after_s=self.retry_after_s)

    def take(self, **keys: str) -> Hold:
        """A new hold counted against ``keys`` (one per kind in ``per``), or the 429."""
        if set(keys) != set(self.per):
            raise ValueError(f"{self.what}: take() needs exactly the keys {sorted(self.per)}")
        if len(self._holds) >= self.total:
            raise self._refuse(
                f"this metald serves at most {self.total} {self.what} at once; {self.advice}"
            )
        for kind, key in keys.items():
            cap = self.per[kind]
            if self._counts[kind][key] >= cap:
                raise self._refuse(
                    f"a {kind} may hold at most {cap} {self.what} at once; close one first, "
                    f"or {self.advice}"
                )
        hold = Hold(tuple(sorted(keys.items())))
        self._holds.add(hold)
        for kind, key in hold.keys:
            self._counts[kind][key] += 1
        return hold

    def give(self, hold: Hold) -> None:
        """Release a hold (a second release of the same one is a no-op)."""
        if hold not in self._holds:
            return
        self._holds.discard(hold)
        for kind, key in hold.keys:
            self._counts[kind][key] -= 1
            if self._counts[kind][key] <= 0:
                del self._counts[kind][key]

    @contextmanager
    def holding(self, **keys: str) -> Iterator[Hold]:
        hold = self.take(**keys)
        try:
            yield hold
        finally:
            self.give(hold)

    def held(self, kind: str | None = None, key: str | None = None) -> int:
        """Holds in all, or those of one key of a kind."""
        if kind is None:
            return len(self._holds)
        return self._counts[kind][key or ""]
