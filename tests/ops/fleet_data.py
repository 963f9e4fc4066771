"""Rows that make every store gauge of /metrics have a series: a lease per state, BMCs, a claim,
a hub with one node that shook hands and one that never did, a running and a stopped instance."""

from __future__ import annotations

from datetime import timedelta
from ipaddress import IPv4Address, IPv4Network

from metald.config import DhcpNetwork
from metald.store import Store
from metald.store.models import Bmc, Claim, Instance, Lease, WgHub, WgPeer, utcnow
from tests.conftest import Tokens

#: The network the tests configure: a pool of 10 addresses.
NETWORK = DhcpNetwork(
    name="prov",
    subnet=IPv4Network("10.9.0.0/24"),
    pool_start=IPv4Address("10.9.0.10"),
    pool_end=IPv4Address("10.9.0.19"),
)


def populate(store: Store, tokens: Tokens) -> None:
    now = utcnow()
    with store.session() as s:
        for i, state in enumerate(["bound", "offered", "bound", "released"]):
            s.add(
                Lease(
                    network="prov",
                    ip=f"10.9.0.{10 + i}",
                    mac=f"52:54:00:aa:00:{i:02x}",
                    state=state,
                    expires_at=now + timedelta(hours=1),
                )
            )
        # Expired, outside the pool (a reservation), and on a network not configured.
        s.add(
            Lease(
                network="prov",
                ip="10.9.0.14",
                mac="52:54:00:aa:01:00",
                state="bound",
                expires_at=now - timedelta(seconds=1),
            )
        )
        s.add(
            Lease(
                network="prov",
                ip="10.9.0.200",
                mac="52:54:00:aa:01:01",
                state="bound",
                expires_at=now + timedelta(hours=1),
            )
        )
        s.add(
            Lease(
                network="gone",
                ip="10.9.0.15",
                mac="52:54:00:aa:01:02",
                state="bound",
                expires_at=now + timedelta(hours=1),
            )
        )
        for i, health in enumerate(["ok", "ok", "unreachable"]):
            s.add(
                Bmc(
                    address=f"10.8.0.{i + 1}",
                    protocol="ipmi",
                    username="u",
                    password_enc=b"x",
                    health=health,
                )
            )
        s.add(Claim(tenant_id=tokens.tenant_a, count=1, state="allocated"))
        s.add(
            WgHub(
                tenant_id=tokens.tenant_a,
                ifname="wgm-acme",
                public_key="hubkey",
                private_key_enc=b"x",
                endpoint="10.7.0.1:51820",
                listen_port=51820,
                address="10.100.0.1",
            )
        )
        s.add(
            WgPeer(
                tenant_id=tokens.tenant_a,
                machine_id=tokens.machine_a,
                public_key="k1",
                address="10.100.0.2",
                last_handshake_at=now - timedelta(seconds=90),
            )
        )
        s.add(
            WgPeer(
                tenant_id=tokens.tenant_a,
                machine_id=tokens.machine_free,
                public_key="k2",
                address="10.100.0.3",
            )
        )
        s.add(
            Instance(
                name="alive",
                incarnation="i1",
                version="0.1.0",
                heartbeat_at=now - timedelta(seconds=30),
            )
        )
        s.add(
            Instance(
                name="stopped",
                incarnation="i2",
                version="0.1.0",
                heartbeat_at=now - timedelta(hours=1),
                stopped_at=now,
            )
        )
        s.commit()
