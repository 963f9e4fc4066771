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
