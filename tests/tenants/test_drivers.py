"""Scheduler drivers: the kubeadm CA hash checked with openssl, bootstrap tokens, slurm.conf."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from metald.tenants import kubernetes, slurm


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl missing")
def test_ca_hash_matches_openssl(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cert, _key = kubernetes.generate_ca("acme-kubernetes-ca")
    (tmp_path / "ca.crt").write_text(cert)
    # The recipe from kubeadm's documentation.
    out = subprocess.run(
        f"openssl x509 -pubkey -in {tmp_path / 'ca.crt'} | openssl pkey -pubin -outform der"
        " | sha256sum",
        shell=True,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()[0]
    assert kubernetes.ca_cert_hash(cert) == f"sha256:{out}"
    info = subprocess.run(
        ["openssl", "x509", "-noout", "-text", "-in", str(tmp_path / "ca.crt")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "CA:TRUE" in info and "Certificate Sign" in info


def test_bootstrap_tokens() -> None:
    toks = {kubernetes.bootstrap_token() for _ in range(200)}
    assert len(toks) == 200
    assert all(re.fullmatch(r"[a-z0-9]{6}\.[a-z0-9]{16}", t) for t in toks)


def test_join_configuration() -> None:
    cert, _ = kubernetes.generate_ca("x")
    m = kubernetes.join_material(
        control_plane="10.0.0.5",
        ca_cert_pem=cert,
        node_name="node-1",
        node_ip="100.64.0.2",
        labels={"rack": "r1"},
    )
    assert m["api_server_endpoint"] == "10.0.0.5:6443"
    doc = m["join_configuration"]
    assert doc.startswith("apiVersion: kubeadm.k8s.io/v1beta3\nkind: JoinConfiguration\n")
    assert f'      - "{kubernetes.ca_cert_hash(cert)}"' in doc
    assert f'    token: "{m["bootstrap_token"]}"' in doc
    assert '    node-ip: "100.64.0.2"' in doc and '    node-labels: "rack=r1"' in doc
    assert "BEGIN" not in doc  # no key material, only the hash


def test_slurm_conf_has_configless_dynamic_essentials() -> None:
    conf = slurm.render_slurm_conf(
        slurm.ControlPlane(
            cluster_name="acme",
            host_name="hub",
            address="100.64.0.1",
            state_dir="/s",
            spool_dir="/sp",
            run_dir="/r",
            log_dir="/l",
        )
    )
    for line in (
        "SlurmctldHost=hub(100.64.0.1)",
        "SlurmctldParameters=enable_configless",
        "MaxNodeCount=1024",
        "TreeWidth=65533",
        "SelectType=select/cons_tres",
        "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ):
        assert line in conf.splitlines()


def test_slurm_node_conf() -> None:
    assert slurm.node_conf(gpu_count=0, features=[]) == ""
    assert (
        slurm.node_conf(gpu_count=8, features=["NVIDIA H100 80GB HBM3", "rack=a"], gpu_type="H100")
        == "Gres=gpu:h100:8 Feature=nvidia_h100_80gb_hbm3,rack_a"
    )


def test_guard_ruleset_parses() -> None:
    from netconfig import guard

    hub = guard.render(["uh0"], wireguard_port=51820)
    assert 'iifname { "uh0" } udp dport 51820 accept' in hub
    assert "dport" not in guard.render(["un0"])
    if shutil.which("nft"):
        r = subprocess.run(["nft", "-c", "-f", "-"], input=hub, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
