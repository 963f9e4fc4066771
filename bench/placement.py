"""Fragmentation of NVLink domains under random claims and releases: metald's placement rule
against a rack-only allocator.

The fleet is the simulated one of tests/claims/nvl72.py: 4 GB200 NVL72 domains of 18 trays
(one rack each). Each run plays the same random sequence of operations to every allocator: a
new claim (trays drawn from SIZES, packed into one domain) or the release of a random held
claim. Measured after every operation: the NVLink domains left wholly free (what a next
18-tray job needs), and the claims refused although enough trays were free in the fleet, in
no one domain (fragmentation refused them, not capacity).

Allocators (each gets the candidates in the same order, by tray name):
- ``metald``: ``metald.claims.placement.choose`` (the fit leaving the largest free blocks).
- ``rack-first-fit``: packs into one rack, the first rack (by name) with room: what an
  orchestrator does with the ``rack`` selector and no view of the others' fragmentation.
- ``rack-random-fit``: one rack, any rack with room, at random.

The placement core is what the allocator runs inside its transaction (``_placed``); this
bench runs it without the database, so it measures the rule, not SQL.

    .venv/bin/python bench/placement.py [--ops 200] [--seeds 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from metald.claims.placement import Candidate, Placement, Unplaceable, choose

DOMAINS, TRAYS = 4, 18
#: Claim sizes in trays (a GB200 tray has 4 GPUs): 4 to 18 trays, whole-rack jobs included.
SIZES = (2, 4, 4, 8, 8, 9, 16, 18)
RELEASE_P = 0.45

Allocator = Callable[[list[Candidate], int, random.Random], list[str]]


def fleet() -> list[Candidate]:
    return [
        Candidate(id=f"d{d}-t{t:02d}", nvlink_domain=f"d{d}", rack=f"r{d}")
        for d in range(DOMAINS)
        for t in range(TRAYS)
    ]


def metald(free: list[Candidate], n: int, rng: random.Random) -> list[str]:
    return choose(free, n, Placement(pack="nvlink-domain"))


def _rack_fit(free: list[Candidate], n: int, order: list[str]) -> list[str]:
    by_rack: dict[str, list[str]] = {}
    for c in free:
        by_rack.setdefault(c.rack or "", []).append(c.id)
    for rack in order:
        if len(by_rack.get(rack, [])) >= n:
            return by_rack[rack][:n]
    raise Unplaceable("no rack with room")


def rack_first_fit(free: list[Candidate], n: int, rng: random.Random) -> list[str]:
    return _rack_fit(free, n, sorted({c.rack or "" for c in free}))


def rack_random_fit(free: list[Candidate], n: int, rng: random.Random) -> list[str]:
    racks = sorted({c.rack or "" for c in free})
    rng.shuffle(racks)
    return _rack_fit(free, n, racks)


ALLOCATORS: dict[str, Allocator] = {
    "metald": metald,
    "rack-first-fit": rack_first_fit,
    "rack-random-fit": rack_random_fit,
}


def operations(seed: int, ops: int, release_p: float = RELEASE_P) -> list[tuple[str, float]]:
    """The same sequence for every allocator: ("claim", size) or ("release", which)."""
    rng = random.Random(seed)
    return [
        ("release", rng.random()) if rng.random() < release_p else ("claim", rng.choice(SIZES))
        for _ in range(ops)
    ]


def run(alloc: Allocator, seq: list[tuple[str, float]], seed: int) -> dict[str, float]:
    rng = random.Random(seed ^ 0x5EED)
    all_trays = fleet()
    held: list[list[str]] = []
    taken: set[str] = set()
    whole, refused, refused_fits, claims = [], 0, 0, 0
    for op, arg in seq:
        free = [c for c in all_trays if c.id not in taken]
        if op == "release":
            if held:
                gone = held.pop(int(arg * len(held)))
                taken.difference_update(gone)
        else:
            claims += 1
            n = int(arg)
            try:
                got = alloc(free, n, rng)
                assert len(got) == n and len({g.split("-")[0] for g in got}) == 1
                held.append(got)
                taken.update(got)
            except Unplaceable:
                refused += 1
                # Fragmentation: enough trays free in the fleet, in no one domain.
                refused_fits += len(free) >= n
        per_domain = {f"d{d}": 0 for d in range(DOMAINS)}
        for c in all_trays:
            if c.id not in taken:
                per_domain[c.nvlink_domain or ""] += 1
        whole.append(sum(1 for v in per_domain.values() if v == TRAYS))
    return {
        "whole_mean": statistics.fmean(whole),
        "whole_end": whole[-1],
        "refused": refused,
        "refused_fragmented": refused_fits,
        "claims": claims,
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=200, help="claims and releases per run")
    ap.add_argument("--seeds", type=int, default=20, help="runs (random sequences)")
    ap.add_argument("--release-p", type=float, default=RELEASE_P, help="share of releases")
    args = ap.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ALLOCATORS}
    for seed in range(args.seeds):
        seq = operations(seed, args.ops, args.release_p)
        for name, alloc in ALLOCATORS.items():
            results[name].append(run(alloc, seq, seed))
    summary = {}
    print(
        f"{DOMAINS} NVL72 domains x {TRAYS} trays, {args.ops} operations x {args.seeds} seeds, "
        f"{args.release_p:.0%} releases"
    )
    print(
        f"{'allocator':<16} {'whole domains free (mean)':>26} {'at end':>7} "
        f"{'refused':>8} {'with enough free trays':>23}"
    )
    for name, rs in results.items():
        s = {k: statistics.fmean(r[k] for r in rs) for k in rs[0]}
        summary[name] = s
        print(
            f"{name:<16} {s['whole_mean']:>26.2f} {s['whole_end']:>7.2f} "
            f"{s['refused']:>8.1f} {s['refused_fragmented']:>23.1f}"
        )
    return summary


if __name__ == "__main__":
    main()
