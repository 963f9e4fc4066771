"""The lab's CA for metald's iPXE: made once per cache (so every lab shares one iPXE build), a
private key only its owner reads, server certificates that verify against it, and foreign ones
that do not."""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature

from bootassets import ipxe
from vmlab import labipxe


def test_the_lab_ca_is_made_once_and_its_key_is_private(tmp_path: Path) -> None:
    ca = labipxe.lab_ca(tmp_path)
    first = ca.read_bytes()
    assert labipxe.lab_ca(tmp_path).read_bytes() == first  # the same CA: the same iPXE build
    assert stat.S_IMODE(os.stat(ca.parent / "boot-ca.key").st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(first)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ipxe.read_ca(ca) == first  # what the recipe takes as --ca


@pytest.mark.parametrize("foreign", [False, True])
def test_server_certificates_verify_only_against_their_ca(tmp_path: Path, foreign: bool) -> None:
    ca = labipxe.lab_ca(tmp_path / "cache")
    cert, key = labipxe.server_cert(
        tmp_path / "tls", "10.79.0.1", cache_dir=tmp_path / "cache", foreign=foreign
    )
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    issuer = x509.load_pem_x509_certificate(ca.read_bytes())
    if foreign:
        # the same issuer name (a man in the middle copies it), another key
        assert leaf.issuer == issuer.subject
        with pytest.raises(InvalidSignature):
            leaf.verify_directly_issued_by(issuer)
    else:
        leaf.verify_directly_issued_by(issuer)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)  # loads as a server certificate


def test_a_seeded_state_folder_gives_tls_auto_the_lab_ca(tmp_path: Path) -> None:
    """The lab's CA is one metald's tls_auto makes (RSA): a state folder seeded with it keeps
    it, and the listener certificate tls_auto issues verifies against it, so a tls_auto lab's
    machines boot the one cached iPXE build."""
    from metald.boot import pki

    ca = labipxe.lab_ca(tmp_path / "cache")
    state = labipxe.seed_state(tmp_path / "state", tmp_path / "cache")
    assert stat.S_IMODE(os.stat(state / pki.CA_KEY).st_mode) == 0o600
    tls = pki.ensure_boot_tls(state, "10.79.0.1")
    assert tls.ca_pem == ca.read_bytes()
    leaf = x509.load_pem_x509_certificate(tls.cert.read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.read_bytes()))
