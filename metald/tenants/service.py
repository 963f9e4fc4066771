"""The old name of ``metald.tenants.clusters``, kept only for ``metald/tenants/runtime.py`` (on
another branch): when its ``from metald.tenants import controlplane, service`` reads
``clusters``, delete this module."""

from metald.tenants.clusters import hub_private_key, load_secrets, observe, peers

__all__ = ["hub_private_key", "load_secrets", "observe", "peers"]
