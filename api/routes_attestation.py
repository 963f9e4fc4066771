"""Measured-boot attestation (docs/attestation.md): the agent's key enrollment, nonce and
quote (/api/v1/agent/attestation...), and a machine's attestation as staff see and act on it
(/api/v1/machines/{id}/attestation...)."""

from __future__ import annotations

import base64
import binascii
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from api import workflows
from api.roles import ADMIN, AGENT
from api.routing import STAFF, ApiRequest, Router
from api.schemas import In, MachineOut, MachineRef, Version
from metald.errors import Unprocessable
from metald.usecases.attestation import Attestation

router = Router()
TAG = "attestation"

#: Base64 of at most ~96 KiB (a real UEFI event log is a few KiB to a few tens of KiB).
B64 = Annotated[
    str, StringConstraints(min_length=4, max_length=131072, pattern=r"^[A-Za-z0-9+/=\s]+$")
]
B64_SMALL = Annotated[
    str, StringConstraints(min_length=4, max_length=8192, pattern=r"^[A-Za-z0-9+/=\s]+$")
]


def _bytes(field: str, value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=False)
    except (binascii.Error, ValueError):
        raise Unprocessable(
            f"{field} is not base64; send the file's bytes base64-encoded"
        ) from None


class KeyIn(In):
    ak_public: B64_SMALL = Field(
        description="The AK's TPMT_PUBLIC (tpm2_createak -f tpmt), base64."
    )
    ek_public: Annotated[str, StringConstraints(min_length=1, max_length=4096)] | None = Field(
        default=None, description="The EK's public key, PEM (tpm2_readpublic -f pem)."
    )
    ek_certificate: B64_SMALL | None = Field(
        default=None,
        description="The EK certificate from the TPM's NV index 0x01c00002, DER, base64.",
    )
    activation_secret: (
        Annotated[str, StringConstraints(pattern=r"^([0-9a-fA-F]{2}){1,32}$")] | None
    ) = Field(
        default=None,
        description="Hex: the secret tpm2_activatecredential recovered from the credential "
        "the first call answered. Without it metald answers the challenge.",
    )


class KeyOut(BaseModel):
    machine_id: str
    #: challenge (activate ``credential`` and send the secret back) or enrolled.
    status: str
    ak_name: str
    ek_check: str | None
    #: tpm2-tools' credential file for tpm2_activatecredential -i, base64 (a challenge).
    credential: str | None


class NonceOut(BaseModel):
    #: Hex: pass it to tpm2_quote -q.
    nonce: str
    expires_at: datetime
    #: The SHA-256 PCRs to quote (tpm2_quote -l sha256:...).
    pcrs: list[int]
    #: The name of the AK metald holds for this machine (hex), or null: the agent enrolls
    #: only when its TPM's AK has another name.
    ak_name: str | None


class QuoteIn(In):
    nonce: Annotated[str, StringConstraints(pattern=r"^([0-9a-fA-F]{2}){16,64}$")]
    quote: B64_SMALL = Field(description="TPMS_ATTEST (tpm2_quote -m), base64.")
    signature: B64_SMALL = Field(description="TPMT_SIGNATURE (tpm2_quote -s), base64.")
    event_log: B64 = Field(
        description="/sys/kernel/security/tpm0/binary_bios_measurements, base64."
    )


class VerdictOut(BaseModel):
    machine_id: str
    id: str
    #: learned, passed, failed, refused.
    status: str
    reason: str | None
    summary: str
    changes: list[dict[str, Any]]
    state: str


class AttestationView(BaseModel):
    machine_id: str
    #: The machine's current boot passed its attestation (what a claim's attested: true asks).
    attested: bool
    key: dict[str, Any] | None
    golden: dict[str, Any] | None
    attestations: list[dict[str, Any]]


class AcceptIn(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    version: Version = None


class ReasonIn(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]


@router.route(
    "POST",
    "/api/v1/agent/attestation/key",
    summary="Enroll the machine's attestation key",
    roles=AGENT,
    body=KeyIn,
    response=KeyOut,
    tag=TAG,
    errors=(409, 422),
    use_case=workflows.attestation,
)
async def enroll_key(req: ApiRequest, att: Attestation) -> KeyOut:
    """In a discovery boot: the machine's AK (trust on first use) with its EK and EK
    certificate, in two calls. The first answers ``challenge``: a credential made for the EK
    over the AK's name (TPM2 MakeCredential); the second sends the secret
    tpm2_activatecredential recovered, and the AK is enrolled only when it matches (422
    otherwise: the AK is not in the TPM holding that EK). The same AK again is accepted at
    once; another AK for an enrolled machine is 409."""
    b: KeyIn = req.body
    out = await att.enroll_key(
        req.require_principal(),
        ak_public=_bytes("ak_public", b.ak_public),
        ek_public=b.ek_public,
        ek_certificate=None
        if b.ek_certificate is None
        else _bytes("ek_certificate", b.ek_certificate),
        activation_secret=None
        if b.activation_secret is None
        else bytes.fromhex(b.activation_secret),
        actor=req.actor,
    )
    if out["credential"] is not None:
        out = {**out, "credential": base64.b64encode(out["credential"]).decode()}
    return KeyOut.model_validate(out)


@router.route(
    "POST",
    "/api/v1/agent/attestation/nonce",
    summary="Get a nonce to quote over",
    roles=AGENT,
    response=NonceOut,
    tag=TAG,
    errors=(409,),
    use_case=workflows.attestation,
)
async def issue_nonce(req: ApiRequest, att: Attestation) -> NonceOut:
    """A fresh nonce for this boot's quote, usable once, for attestation.nonce_ttl_s."""
    return NonceOut.model_validate(await att.nonce(req.require_principal()))


@router.route(
    "POST",
    "/api/v1/agent/attestation",
    summary="Submit a quote and the event log",
    roles=AGENT,
    body=QuoteIn,
    response=VerdictOut,
    tag=TAG,
    errors=(409, 422),
    use_case=workflows.attestation,
)
async def submit_quote(req: ApiRequest, att: Attestation) -> VerdictOut:
    """The quote over the nonce, its signature and the UEFI event log. The answer is metald's
    verdict: ``learned`` (first attestation: golden values), ``passed``, ``failed`` (a discovery
    boot's machine is held in attestation-failed; a wipe boot's is held when its wipe ends),
    or ``refused`` (the submission proved nothing: replayed nonce, another TPM's quote, an
    altered log)."""
    b: QuoteIn = req.body
    out = await att.submit(
        req.require_principal(),
        nonce=b.nonce,
        quote=_bytes("quote", b.quote),
        signature=_bytes("signature", b.signature),
        event_log=_bytes("event_log", b.event_log),
        actor=req.actor,
    )
    return VerdictOut.model_validate(out)


@router.route(
    "GET",
    "/api/v1/machines/{id}/attestation",
    summary="Show a machine's attestation",
    roles=STAFF,
    response=AttestationView,
    tag=TAG,
    errors=(404,),
    use_case=workflows.attestation,
)
async def show(req: ApiRequest, att: Attestation) -> AttestationView:
    """Its attestation key (and how far the EK certificate was checked), golden values (whose,
    set by whom and why) and last attestations with their changed PCRs and events."""
    return AttestationView.model_validate(await att.show(req.require_principal(), req.params["id"]))


@router.route(
    "POST",
    "/api/v1/machines/{id}/attestation/accept",
    summary="Accept new golden values",
    roles=STAFF,
    body=AcceptIn,
    response=MachineOut,
    versioned=True,
    tag=TAG,
    errors=(404, 409, 422),
    use_case=workflows.attestation,
)
async def accept(req: ApiRequest, att: Attestation) -> MachineOut:
    """A machine held in attestation-failed: its last measured boot becomes its golden values
    (e.g. after a firmware rollout) and it goes back to ready. The reason is required and
    recorded with the technician's name (``machine.state`` event of ``accept-golden``)."""
    b: AcceptIn = req.body
    out = await att.accept(
        req.require_principal(),
        req.params["id"],
        actor=req.actor,
        reason=b.reason,
        expected_version=req.expected_version(b.version),
    )
    return MachineOut.model_validate(out)


@router.route(
    "DELETE",
    "/api/v1/machines/{id}/attestation/key",
    summary="Forget a machine's attestation key",
    roles=STAFF,
    body=ReasonIn,
    response=AttestationView,
    tag=TAG,
    errors=(404,),
    use_case=workflows.attestation,
)
async def remove_key(req: ApiRequest, att: Attestation) -> AttestationView:
    """Its TPM was cleared or replaced: the next discovery boot enrolls a new key. Golden values
    stay. The reason is recorded (``attestation.key-removed`` event)."""
    out = await att.remove_key(
        req.require_principal(), req.params["id"], actor=req.actor, reason=req.body.reason
    )
    return AttestationView.model_validate(out)


HEX64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]
PCR_KEY = Annotated[str, StringConstraints(pattern=r"^(1?[0-9]|2[0-3])$")]


class GoldenEventIn(In):
    type: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    label: Annotated[str, StringConstraints(max_length=256)] = ""
    digest: HEX64


class GoldenIn(In):
    #: PCR number -> SHA-256 value (hex), as ``GET .../attestation`` shows them.
    pcrs: dict[PCR_KEY, HEX64] = Field(min_length=1, max_length=24)
    #: PCR number -> its events in order (type, label, digest): lets a failure name the
    #: changed events, not only the PCR. Optional.
    events: dict[PCR_KEY, list[GoldenEventIn]] = Field(default_factory=dict, max_length=24)


class SkuGoldenIn(In):
    reason: Annotated[str, StringConstraints(min_length=1, max_length=500)]
    #: The values themselves (e.g. from the vendor or a reference boot recorded elsewhere) ...
    golden: GoldenIn | None = None
    #: ... or a reference machine of this SKU: its last measured boot.
    machine_id: MachineRef | None = None


class SkuGoldenOut(BaseModel):
    product: str
    subject: str
    source: str
    set_by: str
    reason: str | None
    set_at: datetime
    attestation_id: str | None
    pcrs: dict[str, str]
    #: Machines of this SKU held in attestation-failed whose last measured boot equals the
    #: new values: back to ready (a PUT only).
    released: list[str] = []


class SkuGoldenList(BaseModel):
    items: list[SkuGoldenOut]


@router.route(
    "GET",
    "/api/v1/attestation/skus",
    summary="List per-SKU golden values",
    roles=STAFF,
    response=SkuGoldenList,
    tag=TAG,
    use_case=workflows.attestation,
)
async def list_skus(req: ApiRequest, att: Attestation) -> SkuGoldenList:
    """The golden values operators gave per SKU (the SMBIOS product), who set them and why."""
    return SkuGoldenList.model_validate({"items": await att.skus()})


@router.route(
    "GET",
    "/api/v1/attestation/skus/{id}",
    summary="Show a SKU's golden values",
    roles=STAFF,
    response=SkuGoldenOut,
    tag=TAG,
    errors=(404,),
    use_case=workflows.attestation,
)
async def show_sku(req: ApiRequest, att: Attestation) -> SkuGoldenOut:
    """One SKU's golden values (``id``: the SMBIOS product as machines report it, URL-encoded)."""
    return SkuGoldenOut.model_validate(await att.sku(req.params["id"]))


@router.route(
    "PUT",
    "/api/v1/attestation/skus/{id}",
    summary="Set a SKU's golden values",
    roles=ADMIN,
    body=SkuGoldenIn,
    response=SkuGoldenOut,
    tag=TAG,
    errors=(404, 422),
    use_case=workflows.attestation,
)
async def set_sku(req: ApiRequest, att: Attestation) -> SkuGoldenOut:
    """Every machine of this SKU is checked against these values instead of trust on first
    use. Give them (``golden``: PCR values, optionally their events) or name a reference
    machine of the SKU (``machine_id``: its last measured boot, e.g. one booted after a
    firmware rollout). The reason is required (``attestation.sku-golden-set`` event). Held
    machines of the SKU whose last measured boot equals the new values go back to ready
    (``released``): a rollout is accepted once, not machine by machine."""
    b: SkuGoldenIn = req.body
    golden = None
    if b.golden is not None:  # stored as the verification core keeps golden values
        golden = {
            "alg": "sha256",
            "pcrs": {k: v.lower() for k, v in b.golden.pcrs.items()},
            "events": {
                k: [{**e.model_dump(), "digest": e.digest.lower()} for e in v]
                for k, v in b.golden.events.items()
            },
        }
    out = await att.set_sku(
        req.params["id"], reason=b.reason, actor=req.actor, golden=golden,
        machine_id=b.machine_id,
    )  # fmt: skip
    return SkuGoldenOut.model_validate(out)


@router.route(
    "DELETE",
    "/api/v1/attestation/skus/{id}",
    summary="Forget a SKU's golden values",
    roles=ADMIN,
    body=ReasonIn,
    status=204,
    tag=TAG,
    errors=(404,),
    use_case=workflows.attestation,
)
async def remove_sku(req: ApiRequest, att: Attestation) -> None:
    """Its machines are checked against their own golden values again (learned or
    accepted). The reason is recorded (``attestation.sku-golden-removed`` event)."""
    await att.remove_sku(req.params["id"], reason=req.body.reason, actor=req.actor)
