"""What keeps the shipped Patroni deployment (deploy/patroni/) from splitting its brain in a
partition, pinned on the files themselves: the fast counterpart of the long
tests/fleet/test_patroni_failover.py ``partition`` and ``cut`` rounds, which run these very
files (docs/fleet.md, "PostgreSQL failover").

- A primary cut from etcd must stop taking writes before its leader key can expire and the
  standby be promoted: Patroni demotes it after ``retry_timeout``, inside its ``loop_wait``,
  so ``ttl >= loop_wait + 2 x retry_timeout`` (Patroni's own rule for these three).
- ``failsafe_mode`` stays off: with it, a primary cut from etcd that still reaches every
  member (the partition: its standby is reachable) keeps running as the leader, and the
  standby, which sees it alive over its REST API, is never promoted (Patroni 3.0's
  ``_handle_dcs_error`` and ``_is_healthiest_node``): no split brain, but no failover
  either while metald cannot reach that primary.
- Only the synchronous standby, with every byte, may be promoted; a COMMIT waits for it.
- etcd runs on hosts other than the PostgreSQL nodes: a cut database host must not take an
  etcd member with it (the split brain at the heal of Patroni 3.0.2, docs/fleet.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "patroni"


def _patroni() -> dict[str, Any]:
    conf: dict[str, Any] = yaml.safe_load((DEPLOY / "patroni.yml").read_text())
    return conf


def test_primary_demotes_before_its_leader_key_can_expire() -> None:
    dcs = _patroni()["bootstrap"]["dcs"]
    assert dcs["ttl"] >= dcs["loop_wait"] + 2 * dcs["retry_timeout"], dcs


def test_failsafe_mode_is_off() -> None:
    dcs = _patroni()["bootstrap"]["dcs"]
    assert not dcs.get("failsafe_mode", False), dcs


def test_only_the_synchronous_standby_is_promoted_and_commits_wait_for_it() -> None:
    dcs = _patroni()["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] is True
    assert dcs["maximum_lag_on_failover"] == 0
    assert dcs["postgresql"]["parameters"]["synchronous_commit"] == "on"
    assert dcs["postgresql"]["use_pg_rewind"] is True


def test_etcd_members_are_not_on_the_database_hosts() -> None:
    conf = _patroni()
    pg_host = conf["postgresql"]["connect_address"].rsplit(":", 1)[0]
    etcd_hosts = {h.rsplit(":", 1)[0] for h in conf["etcd3"]["hosts"].split(",")}
    assert len(etcd_hosts) == 3 and pg_host not in etcd_hosts, (pg_host, etcd_hosts)
    members = yaml.safe_load((DEPLOY / "etcd.conf.yml").read_text())["initial-cluster"]
    peers = {u.split("=", 1)[1].split("//", 1)[1].rsplit(":", 1)[0] for u in members.split(",")}
    assert peers == etcd_hosts, (peers, etcd_hosts)
