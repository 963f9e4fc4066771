"""Elastic pools, pure: hostlists against an oracle, slurm.conf lines, resume and suspend
decisions, the spool's request format."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metald.tenants import elastic, elasticspool
from metald.tenants.elastic import ElasticPool, Holdings, Quota


def pool(**kw: object) -> ElasticPool:
    args: dict[str, object] = dict(
        tenant_id="t1", name="gpu", prefix="e", min_nodes=0, max_nodes=3, image_id="img"
    )
    args.update(kw)
    return ElasticPool(**args)  # type: ignore[arg-type]


# ---- hostlists ----------------------------------------------------------------------------


def oracle(groups: list[tuple[str, list[tuple[int, int]]]]) -> list[str]:
    """What a hostlist written from these groups names, by the simplest reading."""
    out = []
    for prefix, ranges in groups:
        if not ranges:
            out.append(prefix)
        for lo, hi in ranges:
            out += [f"{prefix}{i}" for i in range(lo, hi + 1)]
    return out


def write(groups: list[tuple[str, list[tuple[int, int]]]]) -> str:
    parts = []
    for prefix, ranges in groups:
        if not ranges:
            parts.append(prefix)
        else:
            body = ",".join(f"{lo}-{hi}" if hi != lo else str(lo) for lo, hi in ranges)
            parts.append(f"{prefix}[{body}]")
    return ",".join(parts)


ranges = st.tuples(st.integers(0, 300), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1]))
groups = st.lists(
    st.tuples(st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), st.lists(ranges, max_size=4)),
    min_size=1,
    max_size=5,
)


@given(groups)
def test_expand_hostlist_matches_the_oracle(gs: list[tuple[str, list[tuple[int, int]]]]) -> None:
    assert elastic.expand_hostlist(write(gs)) == oracle(gs)


@given(st.from_regex(r"[a-z]{1,4}", fullmatch=True), st.sets(st.integers(1, 200), max_size=30))
def test_compress_then_expand_round_trips(prefix: str, numbers: set[int]) -> None:
    text = elastic.compress_hostlist(prefix, numbers)
    assert elastic.expand_hostlist(text) == [f"{prefix}{n}" for n in sorted(numbers)]


def test_expand_keeps_padding_and_refuses_junk() -> None:
    assert elastic.expand_hostlist("n[01-03],x") == ["n01", "n02", "n03", "x"]
    assert elastic.expand_hostlist("e[1-3,5]") == ["e1", "e2", "e3", "e5"]
    for bad in ("e[1-3", "e]1", "e[3-1]", "e[a]", "e[[1]]", "a,,b", "e[1-99999999]"):
        with pytest.raises(elastic.HostlistError):
            elastic.expand_hostlist(bad)


@given(st.text(max_size=40))
def test_expand_never_fails_otherwise(text: str) -> None:
    try:
        names = elastic.expand_hostlist(text)
    except elastic.HostlistError:
        return
    assert len(names) <= elastic.MAX_POOL_NODES


# ---- pool and slurm.conf ------------------------------------------------------------------


def test_pool_names_and_limits() -> None:
    p = pool(min_nodes=1, max_nodes=3)
    assert p.node_names() == ["e1", "e2", "e3"] and p.hostlist == "e[1-3]"
    assert p.owns("e3") and not p.owns("e4") and not p.owns("e01") and not p.owns("f1")
    assert p.kept() == ["e1"]
    with pytest.raises(ValueError):
        pool(min_nodes=4, max_nodes=3)
    with pytest.raises(ValueError):
        pool(prefix="E;rm")


def test_slurm_conf_lines() -> None:
    progs = elastic.Programs("/w/resume.sh", "/w/suspend.sh", "/w/resume-fail.sh")
    lines = elastic.slurm_conf_lines([pool(min_nodes=2, max_nodes=4)], progs)
    assert "NodeName=e[1-4] State=CLOUD Feature=elastic_gpu" in lines
    assert "ResumeProgram=/w/resume.sh" in lines and "SuspendProgram=/w/suspend.sh" in lines
    assert "ResumeFailProgram=/w/resume-fail.sh" in lines
    assert "SuspendExcNodes=e[1-2]" in lines
    assert any(ln.startswith("PartitionName=elastic_gpu Nodes=e[1-4]") for ln in lines)
    assert elastic.slurm_conf_lines([], progs) == []
    assert not any("SuspendExcNodes" in ln for ln in elastic.slurm_conf_lines([pool()], progs))


# ---- decisions ----------------------------------------------------------------------------


def test_resume_claims_in_order_up_to_the_pool_max() -> None:
    d = elastic.decide_resume(
        pool(max_nodes=3),
        ["e1", "e2", "e3"],
        Holdings(pool_claimed=frozenset({"e1"})),
        Quota(),
        sku=None,
        free_machines=10,
    )
    assert d.already == ["e1"] and d.claim == ["e2", "e3"] and d.down == {}


def test_resume_never_claims_a_fourth_in_a_pool_of_three() -> None:
    p = pool(max_nodes=3)
    held = Holdings(pool_claimed=frozenset({"e1", "e2", "e3"}))
    d = elastic.decide_resume(p, ["e4"], held, Quota(), sku=None, free_machines=10)
    assert d.claim == [] and d.down == {"e4": elastic.REASON_NOT_POOL}


def test_resume_quota_sku_and_no_machine() -> None:
    p = pool(max_nodes=8)
    d = elastic.decide_resume(
        p, ["e1", "e2", "e3"], Holdings(tenant_machines=4), Quota(max_machines=5),
        sku=None, free_machines=10,
    )  # fmt: skip
    assert d.claim == ["e1"] and d.down == {"e2": elastic.REASON_QUOTA, "e3": elastic.REASON_QUOTA}
    d = elastic.decide_resume(
        p, ["e1", "e2"], Holdings(tenant_by_sku={"H100": 1}), Quota(per_sku={"H100": 2}),
        sku="H100", free_machines=10,
    )  # fmt: skip
    assert d.claim == ["e1"] and d.down == {"e2": elastic.REASON_QUOTA}
    d = elastic.decide_resume(p, ["e1", "e2"], Holdings(), Quota(), sku=None, free_machines=1)
    assert d.claim == ["e1"] and d.down == {"e2": elastic.REASON_NO_MACHINE}


@given(
    st.integers(1, 12),
    st.sets(st.integers(1, 12)),
    st.lists(st.integers(1, 14), max_size=20),
    st.integers(0, 12),
)
def test_resume_never_exceeds_max_or_free(
    mx: int, held: set[int], asked: list[int], free: int
) -> None:
    p = pool(max_nodes=mx)
    claimed = frozenset(f"e{i}" for i in held if i <= mx)
    d = elastic.decide_resume(
        p, [f"e{i}" for i in asked], Holdings(pool_claimed=claimed), Quota(),
        sku=None, free_machines=free,
    )  # fmt: skip
    assert len(claimed) + len(d.claim) <= mx
    assert len(d.claim) <= free
    assert not set(d.claim) & claimed
    assert set(d.claim) | set(d.already) | set(d.down) == {f"e{i}" for i in asked}


def test_suspend_never_below_min() -> None:
    p = pool(min_nodes=1, max_nodes=3)
    assert elastic.decide_suspend(p, ["e1", "e2", "e3", "x9"], {"e1", "e2"}) == ["e2"]


# ---- spool --------------------------------------------------------------------------------


def test_request_format(tmp_path: Path) -> None:
    r = elasticspool.parse_request("resume\ne[1-2]\n")
    assert r.op == "resume" and r.names == ["e1", "e2"]
    for bad in ("boom\ne1\n", "resume\n", "resume\ne[1-\n", "resume\ne1\nextra\n"):
        with pytest.raises(elasticspool.RequestError):
            elasticspool.parse_request(bad)
    with pytest.raises(ValueError):
        elasticspool.render_program("resume", tmp_path / "it's")


def test_programs_write_requests_atomically(tmp_path: Path) -> None:
    import subprocess

    progs = elasticspool.install(tmp_path)
    subprocess.run([progs.resume, "e[1-2]"], check=True)
    subprocess.run([progs.suspend, "e2"], check=True)
    reqs = [elasticspool.read(p) for p in elasticspool.pending(tmp_path)]
    assert [(r.op, r.names) for r in reqs] == [("resume", ["e1", "e2"]), ("suspend", ["e2"])]
    assert (tmp_path / "elastic" / "spool").stat().st_mode & 0o077 == 0


def test_node_states_pick_lost_resumes_and_nodes_down_for_want_of_a_machine() -> None:
    pool = elastic.ElasticPool(
        tenant_id="t", name="gpu", prefix="e", min_nodes=0, max_nodes=4, image_id="i"
    )
    ns = elastic.NodeState
    nodes = {
        "e1": ns("alloc#"),  # powering up: must hold a claim
        "e2": ns("down#", elastic.REASON_NO_MACHINE),  # set down by metald, still powering up
        "e3": ns("down~", elastic.REASON_QUOTA),  # slurmctld gave up on it
        "e4": ns("down#", "operator: bad DIMM"),  # not metald's to bring back
        "n7": ns("idle#"),  # a dynamic node, no pool's
        "e9": ns("down#", elastic.REASON_NO_MACHINE),  # beyond the pool's max
    }
    assert elastic.powering_up([pool], nodes) == ["e1"]
    assert elastic.stuck([pool], nodes) == {"e2": True, "e3": False}
    assert elastic.powering_up([pool], {"e1": ns("idle~"), "e2": ns("mix")}) == []
    assert ns("down*#").base == "down" and ns("idle%").base == "idle"
