"""topology.conf (tree and block) and IMEX nodes_config.cfg from the tenant's nodes. Pure."""

from __future__ import annotations

from metald.tenants import slurm
from metald.tenants.slurm import TopoNode

A = "00000001-0000-4000-8000-000000000001.1"
B = "00000002-0000-4000-8000-000000000002.2"
NODES = [
    TopoNode("gb-a1", A, "leaf-a", "10.40.0.11"),
    TopoNode("gb-a0", A, "leaf-a", "10.40.0.10"),
    TopoNode("gb-b0", B, "leaf-b", "10.40.0.2"),
    TopoNode("cpu0", None, None, "10.40.0.99"),
]


def test_tree_nests_nvlink_domains_in_leaves_under_one_root() -> None:
    assert slurm.render_topology_tree(NODES).splitlines()[1:] == [
        "SwitchName=nvl-00000001-1-leaf-a Nodes=gb-a0,gb-a1",
        "SwitchName=ib-leaf-a Switches=nvl-00000001-1-leaf-a",
        "SwitchName=nvl-00000002-2-leaf-b Nodes=gb-b0",
        "SwitchName=ib-leaf-b Switches=nvl-00000002-2-leaf-b",
        "SwitchName=ib-other-nodes Nodes=cpu0",
        "SwitchName=ib-other Switches=ib-other-nodes",
        "SwitchName=root Switches=ib-leaf-a,ib-leaf-b,ib-other",
    ]
    assert slurm.render_topology_tree([]) == ""


def test_block_plugin_gets_one_block_per_domain() -> None:
    assert slurm.render_topology_block(NODES).splitlines()[1:] == [
        "BlockName=nvl-00000001-1 Nodes=gb-a0,gb-a1",
        "BlockName=nvl-00000002-2 Nodes=gb-b0",
    ]
    assert slurm.topology_plugin((22, 5, 8)) == "topology/tree"
    assert slurm.topology_plugin((24, 11)) == "topology/block"


def test_imex_nodes_config_per_domain() -> None:
    assert slurm.imex_nodes_config(NODES) == {A: "10.40.0.10\n10.40.0.11\n", B: "10.40.0.2\n"}


def test_hostile_leaf_names_stay_bare_words() -> None:
    text = slurm.render_topology_tree([TopoNode("n1", None, "leaf a;Nodes=ALL\nx", None)])
    assert len(text.splitlines()) == 3  # comment, the leaf's node switch, the leaf
    assert all(" " not in ln.split(" ", 1)[0] for ln in text.splitlines()[1:])
    assert "Nodes=ALL" not in text
