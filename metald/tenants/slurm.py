"""Slurm driver: configless control-plane slurm.conf and a node's join material. Pure.

The control plane (slurmctld + munged) listens on the hub's overlay address; nodes are dynamic
(``slurmd -Z``) and fetch their configuration from it (``--conf-server``). slurmctld records
each node's NodeAddr from the source address of its registration, i.e. its overlay address.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass, field
from typing import Any

SLURMCTLD_PORT = 6817
MUNGE_KEY_BYTES = 1024


def generate_munge_key() -> bytes:
    return os.urandom(MUNGE_KEY_BYTES)


def feature_name(text: str) -> str:
    """A Slurm feature from free text: 'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def node_conf(*, gpu_count: int, features: list[str], gpu_type: str | None = None) -> str:
    """The ``--conf`` string of a dynamic node: its GPUs (Gres) and features."""
    parts = []
    if gpu_count > 0:
        parts.append(
            f"Gres=gpu:{feature_name(gpu_type)}:{gpu_count}"
            if gpu_type
            else f"Gres=gpu:{gpu_count}"
        )
    clean = [f for f in (feature_name(x) for x in features) if f]
    if clean:
        parts.append("Feature=" + ",".join(dict.fromkeys(clean)))
    return " ".join(parts)


def cloud_join_material(*, hub_address: str, munge_key: bytes, node_name: str) -> dict[str, Any]:
    """Join material of an elastic pool's node: a CLOUD node slurmctld already knows by name
    (``slurmd -N name``, no ``-Z``); its Gres and features are the pool's, from slurm.conf."""
    conf_server = f"{hub_address}:{SLURMCTLD_PORT}"
    return {
        "kind": "slurm",
        "conf_server": conf_server,
        "node_name": node_name,
        "munge_key": base64.b64encode(munge_key).decode(),
        "slurmd_args": ["-N", node_name, "--conf-server", conf_server],
    }


def join_material(
    *,
    hub_address: str,
    munge_key: bytes,
    node_name: str,
    gpu_count: int = 0,
    gpu_type: str | None = None,
    features: list[str] | None = None,
) -> dict[str, Any]:
    conf_server = f"{hub_address}:{SLURMCTLD_PORT}"
    args = ["-Z", "-N", node_name, "--conf-server", conf_server]
    conf = node_conf(gpu_count=gpu_count, features=features or [], gpu_type=gpu_type)
    if conf:
        args += ["--conf", conf]
    return {
        "kind": "slurm",
        "conf_server": conf_server,
        "node_name": node_name,
        "munge_key": base64.b64encode(munge_key).decode(),
        "slurmd_args": args,
    }


@dataclass
class ControlPlane:
    cluster_name: str
    host_name: str
    address: str
    state_dir: str
    spool_dir: str
    run_dir: str
    log_dir: str
    max_nodes: int = 1024
    partition: str = "main"
    extra: list[str] = field(default_factory=list)
    #: Added to ``enable_configless`` (elastic pools add cloud_reg_addrs ...).
    slurmctld_parameters: list[str] = field(default_factory=list)


def render_slurm_conf(cp: ControlPlane) -> str:
    """slurm.conf for a configless control plane with dynamic nodes (Slurm 22.05+)."""
    lines = [
        f"ClusterName={cp.cluster_name}",
        f"SlurmctldHost={cp.host_name}({cp.address})",
        "SlurmctldParameters=" + ",".join(["enable_configless", *cp.slurmctld_parameters]),
        f"SlurmctldPort={SLURMCTLD_PORT}",
        "SlurmdPort=6818",
        "AuthType=auth/munge",
        "MpiDefault=none",
        "CryptoType=crypto/munge",
        f"MaxNodeCount={cp.max_nodes}",
        # 22.05 needs this for dynamic nodes (no fan-out tree over unknown nodes).
        "TreeWidth=65533",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ReturnToService=2",
        f"StateSaveLocation={cp.state_dir}",
        f"SlurmdSpoolDir={cp.spool_dir}",
        f"SlurmctldPidFile={cp.run_dir}/slurmctld.pid",
        f"SlurmdPidFile={cp.run_dir}/slurmd.pid",
        f"SlurmctldLogFile={cp.log_dir}/slurmctld.log",
        f"SlurmdLogFile={cp.log_dir}/slurmd.log",
        *cp.extra,
        f"PartitionName={cp.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


# ---- topology --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopoNode:
    """A tenant node and where it sits: Slurm node name, NVLink domain (None: not placed by
    NVLink), InfiniBand leaf, and the address its peers reach it on (IMEX)."""

    name: str
    nvlink_domain: str | None = None
    ib_leaf: str | None = None
    address: str | None = None


#: Slurm 23.11 brought topology/block (NVLink domains as blocks); 22.05 has topology/tree.
BLOCK_SINCE = (23, 11)


def topology_plugin(version: tuple[int, ...]) -> str:
    return "topology/block" if tuple(version[:2]) >= BLOCK_SINCE else "topology/tree"


def switch_name(kind: str, value: str) -> str:
    """A Slurm switch/block name from a domain or leaf id: bare word, short, unique enough
    (an NVLink domain's UUID prefix and clique id)."""
    if kind == "nvl":
        uuid, _, clique = value.rpartition(".")
        value = f"{uuid.split('-')[0]}-{clique}" if uuid else value
    return f"{kind}-" + (re.sub(r"[^A-Za-z0-9_-]+", "_", value).strip("_") or "x")[:48]


def topology_features(
    nvlink_domain: str | None, ib_leaf: str | None, rack: str | None
) -> list[str]:
    """Node features naming where a node sits (``nvl-…``, ``ib-…``, ``rack-…``), so a job can
    ask for one of each with a matching-OR constraint: ``--constraint="[nvl-a|nvl-b]"``."""
    out = []
    if nvlink_domain:
        out.append(switch_name("nvl", nvlink_domain))
    if ib_leaf:
        out.append(switch_name("ib", ib_leaf))
    if rack:
        out.append(switch_name("rack", rack))
    return out


def _hostlist(names: list[str]) -> str:
    return ",".join(sorted(names))


def render_topology_tree(nodes: list[TopoNode]) -> str:
    """topology.conf for topology/tree: each NVLink domain under a leaf is a level-0 switch
    holding its nodes, each InfiniBand leaf a switch above them, one root over the leaves, so
    Slurm packs a job into one NVLink domain first, then one leaf. Nodes with neither are
    under the root's ``other`` switch."""
    if not nodes:
        return ""
    lines = ["# metald: the tenant's nodes by NVLink domain and InfiniBand leaf (topology/tree)"]
    by_leaf: dict[str, dict[str, list[str]]] = {}
    for n in nodes:
        leaf = switch_name("ib", n.ib_leaf) if n.ib_leaf else "ib-other"
        low = switch_name("nvl", n.nvlink_domain) if n.nvlink_domain else f"{leaf}-nodes"
        by_leaf.setdefault(leaf, {}).setdefault(low, []).append(n.name)
    leaves = []
    for leaf, lows in sorted(by_leaf.items()):
        children = []
        for low, names in sorted(lows.items()):
            # One NVLink domain may span two leaves: a switch per (domain, leaf) pair.
            sw = low if low.startswith("ib-") else f"{low}-{leaf.removeprefix('ib-')}"
            lines.append(f"SwitchName={sw} Nodes={_hostlist(names)}")
            children.append(sw)
        lines.append(f"SwitchName={leaf} Switches={','.join(children)}")
        leaves.append(leaf)
    if len(leaves) > 1:
        lines.append(f"SwitchName=root Switches={','.join(leaves)}")
    return "\n".join(lines) + "\n"


def render_topology_block(nodes: list[TopoNode]) -> str:
    """topology.conf for topology/block (Slurm 23.11+): one block per NVLink domain; nodes
    without one are each left out (the block plugin places them anywhere)."""
    blocks: dict[str, list[str]] = {}
    for n in nodes:
        if n.nvlink_domain:
            blocks.setdefault(switch_name("nvl", n.nvlink_domain), []).append(n.name)
    if not blocks:
        return ""
    lines = ["# metald: the tenant's NVLink domains as blocks (topology/block)"]
    lines += [f"BlockName={b} Nodes={_hostlist(ns)}" for b, ns in sorted(blocks.items())]
    return "\n".join(lines) + "\n"


def imex_nodes_config(nodes: list[TopoNode]) -> dict[str, str]:
    """NVIDIA IMEX ``nodes_config.cfg`` per NVLink domain: the addresses of the tenant's nodes
    in that domain, one per line (IMEX shares GPU memory only within one domain)."""
    out: dict[str, list[str]] = {}
    for n in nodes:
        if n.nvlink_domain and n.address:
            out.setdefault(n.nvlink_domain, []).append(n.address)
    return {
        d: "".join(f"{a}\n" for a in sorted(addrs, key=_addr_key))
        for d, addrs in sorted(out.items())
    }


def _addr_key(a: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in a.split("."))
    except ValueError:
        return (1 << 32,)
