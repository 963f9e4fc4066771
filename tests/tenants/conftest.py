"""Tenants with hubs on both backends: acme (Slurm) and globex (Kubernetes), from seed()."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from cryptography.fernet import Fernet

from metald import machines
from metald.lifecycle import Trigger
from metald.secrets import SecretBox
from metald.store import Store
from metald.tenants import clusters
from tests.conftest import Tokens, seed


@dataclass
class Env:
    store: Store
    box: SecretBox
    tokens: Tokens


def provisioned(store: Store, machine_id: str) -> None:
    with store.session() as s:
        machines.transition(s, machine_id, Trigger.PROVISION, actor="test")
        machines.transition(s, machine_id, Trigger.PROVISIONED, actor="test")


def make_env(store: Store, box: SecretBox) -> Env:
    tokens = seed(store)
    with store.session() as s:
        clusters.setup_hub(s, box, tokens.tenant_a, endpoint_host="10.99.0.1")
    with store.session() as s:
        from metald.store.models import Tenant

        t = s.get(Tenant, tokens.tenant_b)
        assert t is not None
        t.cluster_kind, t.control_plane = "kubernetes", "k8s.globex.example:6443"
        s.add(t)
        s.commit()
        clusters.setup_hub(s, box, tokens.tenant_b, endpoint_host="10.99.1.1")
    provisioned(store, tokens.machine_a)
    return Env(store, box, tokens)


@pytest.fixture
def box() -> SecretBox:
    return SecretBox(Fernet.generate_key())


@pytest.fixture
def env(store: Store, box: SecretBox) -> Env:
    return make_env(store, box)
