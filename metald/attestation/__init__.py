"""Measured-boot attestation: pure cores (bytes in, decisions out) and nothing else.

- ``tpm``: the TPM 2.0 structures a quote needs (TPMT_PUBLIC, TPMS_ATTEST, TPMT_SIGNATURE),
  parsed and checked with ``cryptography``.
- ``eventlog``: the UEFI (TCG2 crypto-agile) event log, parsed and replayed into PCR values.
- ``verify``: a quote, its nonce and its event log against the machine's attestation key and
  golden values: a verdict with evidence (which PCR, which event changed).

No database, no API, no I/O: ``metald.usecases.attestation`` stores nonces, keys, golden
values and verdicts, and moves the machine.
"""
