"""Selector.narrow (SQL) must pick exactly the machines Selector.matches (Python) accepts, on
both backends: allocation orders and limits in SQL when narrow says it is exact."""

from __future__ import annotations

import random

from sqlmodel import select

from metald.claims.allocation import Selector
from metald.store import Store
from metald.store.models import Machine

MODELS = [
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 NVL",
    "NVIDIA A100-SXM4-80GB",
    "nvidia h100 80gb hbm3",  # case differs: globs are case-sensitive
    "NVIDIA H100_80GB",  # an underscore, a LIKE wildcard on PostgreSQL
    "NVIDIA H100%",
    None,
]
LABELS = [
    {},
    {"pool": "train"},
    {"pool": "infer"},
    {"pool": "train", "fabric": "ib"},
    {"pool": "Train"},
    {"weird key": "x"},
    {"example.com/zone": "a"},
]
SELECTORS = [
    Selector(),
    Selector(gpu_model="NVIDIA H100*"),
    Selector(gpu_model="NVIDIA H100?80GB*"),
    Selector(gpu_model="NVIDIA H100_80GB"),
    Selector(gpu_model="NVIDIA H100%"),
    Selector(gpu_model="NVIDIA H100_80GB*"),
    Selector(gpu_model="*NVL"),
    Selector(gpu_model="NVIDIA [AH]100*"),  # a character class: not exact, checked in Python
    Selector(gpu_model="NVIDIA H100 80GB HBM3", min_gpu_count=8),
    Selector(labels={"pool": "train"}),
    Selector(labels={"pool": "train", "fabric": "ib"}),
    Selector(labels={"weird key": "x"}),
    Selector(labels={"example.com/zone": "a"}),
    Selector(gpu_model="NVIDIA H100*", labels={"pool": "train"}, min_memory_mb=500_000),
    Selector(rack="r2", min_gpu_count=4),
]


def _fleet(store: Store) -> list[Machine]:
    rng = random.Random(3)
    out = []
    with store.session() as s:
        for i in range(120):
            m = Machine(
                state="ready",
                gpu_model=rng.choice(MODELS),
                gpu_count=rng.choice([0, 4, 8]),
                memory_mb=rng.choice([None, 256_000, 1_000_000]),
                rack=rng.choice([None, "r1", "r2"]),
                labels=dict(rng.choice(LABELS)),
                name=f"m{i}",
            )
            s.add(m)
            out.append(m)
        s.commit()
    return out


def test_narrow_selects_what_matches_accepts(store: Store) -> None:
    fleet = _fleet(store)
    dialect = store.engine.dialect.name
    with store.session() as s:
        for sel in SELECTORS:
            stmt, exact = sel.narrow(select(Machine), dialect)
            got = {m.id for m in s.exec(stmt).all()}
            want = {m.id for m in fleet if sel.matches(m)}
            if exact:
                assert got == want, sel
            else:
                assert want <= got, sel  # a superset, finished by matches()
            assert want, f"the fleet has no machine for {sel}: the case tests nothing"


def test_exactness_is_reported() -> None:
    assert Selector(gpu_model="NVIDIA H100*", labels={"pool": "a"}).narrow(
        select(Machine), "sqlite"
    )[1]
    assert not Selector(gpu_model="NVIDIA [AH]100*").narrow(select(Machine), "sqlite")[1]
    assert not Selector(labels={"weird key": "x"}).narrow(select(Machine), "postgresql")[1]
