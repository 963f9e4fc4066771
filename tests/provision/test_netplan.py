"""The deployed OS's network config: rendered from requests, then read by Debian's
``netplan generate`` (netplan.io, run with ``--root-dir`` in a temporary folder), over requests
hypothesis draws: every config metald serves is one netplan accepts."""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metald.provision.netplan import NetworkRequestError, NicInfo, Pool, render

NETPLAN = shutil.which("netplan") or "/usr/sbin/netplan"
#: The C generator ``netplan generate`` runs after its Python preamble (a tenth of the time):
#: the same parser and checks, used for the many drawn requests.
GENERATOR = "/usr/lib/netplan/generate"
needs_netplan = pytest.mark.skipif(
    not Path(NETPLAN).exists(), reason="Debian's netplan.io is not installed (scripts/bootstrap)"
)

NICS = [
    NicInfo("eno1", "52:54:00:00:00:01", "0000:00:03.0", pxe=True),
    NicInfo("ens4f0", "52:54:00:00:00:02", "0000:3b:00.0"),
    NicInfo("ens4f1", "52:54:00:00:00:03", "0000:3b:00.1"),
] + [NicInfo(f"ibp{i}s0", f"52:54:00:00:01:{i:02x}", f"0000:{0x80 + i:02x}:00.0") for i in range(8)]
POOLS = {
    "tenant": Pool(
        "tenant",
        "10.20.0.0/24",
        "10.20.0.1",
        "10.20.0.10",
        "10.20.0.250",
        ("10.20.0.2",),
        ("acme.test",),
        9000,
        42,
    ),
    "storage": Pool("storage", "10.30.0.0/24", None, mtu=9000, vlan=43),
    **{
        f"rail{i}": Pool(f"rail{i}", f"192.168.{i}.0/24", f"192.168.{i}.1", mtu=4200)
        for i in range(8)
    },
}


def _allocator() -> Any:
    n = itertools.count(10)

    def take(pool: str, iface: str) -> str:
        return str(ipaddress.ip_network(POOLS[pool].cidr)[next(n)])

    return take


def netplan_generate(
    config: dict[str, Any], program: tuple[str, ...] = (NETPLAN, "generate")
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as root:
        d = Path(root, "etc/netplan")
        d.mkdir(parents=True)
        f = d / "50-cloud-init.yaml"
        f.write_text(json.dumps({"network": config}))  # JSON is YAML
        os.chmod(f, 0o600)
        return subprocess.run(
            [*program, "--root-dir", root], capture_output=True, text=True, timeout=60
        )


GPU_NODE = {
    "bonds": [
        {"name": "bond0", "mode": "802.3ad", "nics": [{"pci": "0000:3b:00.0"}, {"name": "ens4f1"}]}
    ],
    "vlans": [
        {"link": "bond0", "network": "tenant", "default_route": True},
        {"link": "bond0", "network": "storage"},
    ],
    "rails": {"networks": [f"rail{i}" for i in range(8)]},
    "pxe_dhcp": False,
}


def test_gpu_node_shape() -> None:
    out = render(GPU_NODE, NICS, POOLS, _allocator())
    bond = out["bonds"]["bond0"]
    assert bond["interfaces"] == ["ens4f0", "ens4f1"]
    assert bond["parameters"]["mode"] == "802.3ad"
    assert out["vlans"]["bond0.42"]["id"] == 42 and out["vlans"]["bond0.42"]["mtu"] == 9000
    assert {"to": "0.0.0.0/0", "via": "10.20.0.1"} in out["vlans"]["bond0.42"]["routes"]
    assert out["vlans"]["bond0.42"]["nameservers"] == {
        "addresses": ["10.20.0.2"],
        "search": ["acme.test"],
    }
    assert out["vlans"]["bond0.43"]["id"] == 43
    # rails: the non-PXE NICs not in the bond, in PCI order, one table and rule each
    rail3 = out["ethernets"]["ibp3s0"]
    assert rail3["mtu"] == 4200 and rail3["addresses"][0].startswith("192.168.3.")
    assert rail3["routing-policy"] == [{"from": rail3["addresses"][0][:-3], "table": 103}]
    assert {"to": "0.0.0.0/0", "via": "192.168.3.1", "table": 103} in rail3["routes"]
    assert "pxe0" not in out["ethernets"]  # static from the start


def test_gpu_node_rails_skip_bonded_nics() -> None:
    # The rails default to every data NIC; the bonded ones are taken: name the rails' NICs.
    req = {**GPU_NODE, "rails": {"networks": ["rail0"], "nics": [{"name": "ens4f0"}]}}
    with pytest.raises(NetworkRequestError, match="used twice"):
        render(req, NICS, POOLS, _allocator())


@needs_netplan
def test_netplan_accepts_gpu_node_and_refuses_nonsense() -> None:
    req = {
        **GPU_NODE,
        "rails": {
            "networks": [f"rail{i}" for i in range(8)],
            "nics": [{"name": f"ibp{i}s0"} for i in range(8)],
        },
    }
    out = render(req, NICS, POOLS, _allocator())
    r = netplan_generate(out)
    assert r.returncode == 0, r.stderr
    bad = json.loads(json.dumps(out))
    bad["bonds"]["bond0"]["parameters"]["mode"] = "802.3ax"
    r = netplan_generate(bad)
    assert r.returncode != 0 and "mode" in r.stderr
    r = netplan_generate(bad, (GENERATOR,))  # the generator alone refuses it too
    assert r.returncode != 0 and "mode" in r.stderr


def test_refusals_name_the_problem() -> None:
    with pytest.raises(NetworkRequestError, match="no NIC matches {'mac': '00:11:22:33:44:55'}"):
        render({"ethernets": [{"nic": {"mac": "00:11:22:33:44:55"}}]}, NICS, POOLS, _allocator())
    with pytest.raises(NetworkRequestError, match="no network 'nope'"):
        render(
            {"ethernets": [{"nic": {"role": "data"}, "network": "nope"}]}, NICS, POOLS, _allocator()
        )
    with pytest.raises(NetworkRequestError, match="at least two NICs"):
        render(
            {"bonds": [{"name": "bond0", "nics": [{"role": "data"}]}]}, NICS, POOLS, _allocator()
        )
    with pytest.raises(NetworkRequestError, match="8 rail networks but only 2 NICs"):
        render(
            {"rails": {"networks": [f"rail{i}" for i in range(8)]}}, NICS[:3], POOLS, _allocator()
        )


# ---- hypothesis: requests drawn over the NICs and pools above ------------------------------

_sel = st.one_of(
    st.builds(lambda n: {"name": n.name}, st.sampled_from(NICS)),
    st.builds(lambda n: {"mac": n.mac}, st.sampled_from(NICS)),
    st.builds(lambda n: {"pci": n.pci}, st.sampled_from(NICS)),
    st.builds(lambda i: {"role": f"data:{i}"}, st.integers(0, 9)),
    st.just({"role": "pxe"}),
)
_addressing = st.fixed_dictionaries(
    {},
    optional={
        "network": st.sampled_from(sorted(POOLS)),
        "dhcp4": st.booleans(),
        "mtu": st.integers(1280, 9216),
        "default_route": st.booleans(),
    },
)
_request = st.fixed_dictionaries(
    {},
    optional={
        "ethernets": st.lists(
            st.builds(lambda s, a: {"nic": s, **a}, _sel, _addressing), max_size=3
        ),
        "bonds": st.lists(
            st.builds(
                lambda i, mode, nics, a: {"name": f"bond{i}", "mode": mode, "nics": nics, **a},
                st.integers(0, 3),
                st.sampled_from(["802.3ad", "active-backup"]),
                st.lists(_sel, min_size=2, max_size=3),
                _addressing,
            ),
            max_size=2,
            unique_by=lambda b: b["name"],
        ),
        "vlans": st.lists(
            st.builds(
                lambda link, vid, a: {"link": link, "id": vid, **a},
                st.sampled_from(["bond0", "bond1", "ens4f0", "eno1"]),
                st.integers(1, 4094),
                _addressing,
            ),
            max_size=3,
            unique_by=lambda v: (v["link"], v["id"]),
        ),
        "rails": st.builds(
            lambda n, mtu: {"networks": [f"rail{i}" for i in range(n)], "mtu": mtu},
            st.integers(1, 8),
            st.sampled_from([None, 4200, 9000]),
        ),
        "dns": st.builds(
            lambda ns: {"nameservers": ns, "search": ["x.test"]},
            st.lists(st.sampled_from(["1.1.1.1", "10.20.0.2", "2001:db8::53"]), max_size=2),
        ),
        "pxe_dhcp": st.booleans(),
    },
)


@needs_netplan
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_request)
def test_every_rendered_config_is_one_netplan_accepts(req: dict[str, Any]) -> None:
    try:
        out = render(req, NICS, POOLS, _allocator())
    except NetworkRequestError:
        return  # refused with a reason: nothing is served
    r = netplan_generate(out, (GENERATOR,))
    assert r.returncode == 0, (req, out, r.stderr)


@pytest.mark.skipif(not shutil.which("cloud-init"), reason="Debian's cloud-init not installed")
def test_cloud_init_parses_every_rendered_config() -> None:
    """Images without netplan: cloud-init 22.4 (Debian 12) parses the network-config itself
    (its network-state interpreter, as ``cloud-init devel net-convert`` runs it; it refused
    netplan's ``to: default``). The GPU node and 60 requests drawn from a seeded generator,
    in one run of the system Python cloud-init is installed into."""
    import random

    rng = random.Random(32)
    sels = [{"name": n.name} for n in NICS] + [{"role": f"data:{i}"} for i in range(9)]
    configs = [render(GPU_NODE, NICS, POOLS, _allocator())]
    while len(configs) < 60:
        net = {"network": rng.choice(sorted(POOLS)), "default_route": rng.random() < 0.3}
        req: dict[str, Any] = {
            "bonds": [{"name": "bond0", "mode": rng.choice(["802.3ad", "active-backup"]),
                       "nics": rng.sample(sels, 2), **net}] if rng.random() < 0.5 else [],
            "ethernets": [{"nic": rng.choice(sels), "mtu": rng.choice([1500, 9000])}],
            "vlans": [{"link": "bond0", "id": rng.randint(1, 4094), "network": "tenant"}]
            if rng.random() < 0.5 else [],
            "rails": {"networks": [f"rail{i}" for i in range(rng.randint(1, 4))]}
            if rng.random() < 0.5 else None,
            "dns": {"nameservers": ["10.0.0.53"]} if rng.random() < 0.5 else None,
        }  # fmt: skip
        try:
            configs.append(render(req, NICS, POOLS, _allocator()))
        except NetworkRequestError:
            continue
    prog = (
        "import json, sys\n"
        "from cloudinit.net.network_state import parse_net_config_data\n"
        "out = []\n"
        "for c in json.load(sys.stdin):\n"
        "    try:\n"
        "        parse_net_config_data(c, skip_broken=False); out.append(None)\n"
        "    except Exception as e:\n"
        "        out.append(repr(e))\n"
        "print(json.dumps(out))\n"
    )
    real = subprocess.run(
        ["/usr/bin/python3", "-c", prog],
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    verdicts = json.loads(real.stdout.strip().splitlines()[-1])
    bad = [(c, v) for c, v in zip(configs, verdicts, strict=True) if v]
    assert not bad, bad[:2]
