"""Kubernetes driver: the tenant's CA, bootstrap tokens and a kubeadm JoinConfiguration. Pure.

metald holds the tenant's real CA (generated at hub creation, key encrypted at rest) so it can
hand nodes the CA cert hash kubeadm pins: ``sha256:`` of the DER SubjectPublicKeyInfo. The
bootstrap token must also exist on the tenant's API server (a ``bootstrap-token-<id>`` Secret);
metald renders it, the tenant's control plane must accept it.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from datetime import datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from metald.store.models import utcnow

TOKEN_RE = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}$")
_ALPHABET = string.ascii_lowercase + string.digits
DEFAULT_TOKEN_TTL = timedelta(hours=1)
API_PORT = 6443


def bootstrap_token() -> str:
    pick = lambda n: "".join(secrets.choice(_ALPHABET) for _ in range(n))  # noqa: E731
    return f"{pick(6)}.{pick(16)}"


def generate_ca(common_name: str, *, days: int = 3650) -> tuple[str, str]:
    """A self-signed CA like kubeadm's: (cert PEM, key PEM)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = utcnow()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=True,
                key_cert_sign=True,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem


def ca_cert_hash(cert_pem: str) -> str:
    """kubeadm's discovery hash: sha256 over the certificate's DER SubjectPublicKeyInfo."""
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def render_join_configuration(
    *, endpoint: str, token: str, ca_hash: str, node_name: str, node_ip: str, labels: dict[str, str]
) -> str:
    """kubeadm v1beta3 JoinConfiguration. Scalars are JSON-quoted (valid YAML, no escaping slips)."""
    q = json.dumps
    node_labels = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    lines = [
        "apiVersion: kubeadm.k8s.io/v1beta3",
        "kind: JoinConfiguration",
        "discovery:",
        "  bootstrapToken:",
        f"    apiServerEndpoint: {q(endpoint)}",
        f"    token: {q(token)}",
        "    caCertHashes:",
        f"      - {q(ca_hash)}",
        f"  tlsBootstrapToken: {q(token)}",
        "nodeRegistration:",
        f"  name: {q(node_name)}",
        "  kubeletExtraArgs:",
        f"    node-ip: {q(node_ip)}",
    ]
    if node_labels:
        lines.append(f"    node-labels: {q(node_labels)}")
    return "\n".join(lines) + "\n"


def join_material(
    *,
    control_plane: str,
    ca_cert_pem: str,
    node_name: str,
    node_ip: str,
    labels: dict[str, str],
    ttl: timedelta = DEFAULT_TOKEN_TTL,
    now: datetime | None = None,
) -> dict[str, Any]:
    endpoint = control_plane if ":" in control_plane else f"{control_plane}:{API_PORT}"
    token = bootstrap_token()
    ca_hash = ca_cert_hash(ca_cert_pem)
    return {
        "kind": "kubernetes",
        "api_server_endpoint": endpoint,
        "bootstrap_token": token,
        "bootstrap_token_expires_at": ((now or utcnow()) + ttl).isoformat(),
        "ca_cert_hash": ca_hash,
        "join_configuration": render_join_configuration(
            endpoint=endpoint,
            token=token,
            ca_hash=ca_hash,
            node_name=node_name,
            node_ip=node_ip,
            labels=labels,
        ),
    }
