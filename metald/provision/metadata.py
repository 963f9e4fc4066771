"""First-boot metadata for a provisioned disk: cloud-init NoCloud files. Pure.

The agent writes these three files to a ``cidata`` volume (or the seed folder) after the image
is verified. JSON is valid YAML, so every file is rendered with ``json.dumps`` (user-data behind
its ``#cloud-config`` header line): no YAML library, and no quoting mistakes.
"""

from __future__ import annotations

import json
from typing import Any

JOIN_FILE = "/etc/metald/join.json"


def hostname(machine_id: str, name: str | None) -> str:
    return name or f"node-{machine_id[:8]}"


def nocloud(
    *,
    machine_id: str,
    name: str | None,
    pxe_mac: str | None,
    ssh_authorized_keys: list[str],
    join: dict[str, str] | None = None,
    user_data: str | None = None,
    meta_extra: dict[str, Any] | None = None,
    network: dict[str, Any] | None = None,
) -> dict[str, str]:
    """``meta-data``, ``user-data`` and ``network-config`` for one machine; with the tenant's
    ``user_data``, that is served byte for byte and metald's own cloud-config goes to
    ``vendor-data`` (docs/tenant-os.md). ``network``: the network-config (v2) to serve
    instead of DHCP on the PXE NIC."""
    host = hostname(machine_id, name)
    meta: dict[str, Any] = {**(meta_extra or {}), "instance-id": machine_id, "local-hostname": host}
    user: dict[str, Any] = {
        "hostname": host,
        "preserve_hostname": False,
        "ssh_authorized_keys": list(ssh_authorized_keys),
        "disable_root": False,
    }
    if join:
        # The tenant's one-time join token and where to use it ({"url", "token", "expires_at"}):
        # the node image's join agent reads it on first boot (docs/node-image.md).
        user["write_files"] = [
            {
                "path": JOIN_FILE,
                "permissions": "0600",
                "content": json.dumps(join, sort_keys=True),
            }
        ]
    net: dict[str, Any] = {"version": 2, "ethernets": {}}
    if network is not None:
        net = network
    elif pxe_mac:
        net["ethernets"]["pxe0"] = {
            "match": {"macaddress": pxe_mac},
            "set-name": "pxe0",
            "dhcp4": True,
        }
    ours = "#cloud-config\n" + json.dumps(user, indent=2) + "\n"
    files = {
        "meta-data": json.dumps(meta, indent=2) + "\n",
        "user-data": ours if user_data is None else user_data,
        "network-config": json.dumps(net, indent=2) + "\n",
    }
    if user_data is not None:
        files["vendor-data"] = ours
    return files
