"""The lab Redfish BMC's UEFI Secure Boot resources (DMTF ``SecureBoot``, ``SecureBootDatabase``).

``Systems/{id}/SecureBoot``: ``SecureBootEnable`` (PATCH), ``SecureBootCurrentBoot`` (what the
firmware did at its last start: enabled only when enabled then and a platform key was
enrolled), ``SecureBootMode`` (``SetupMode`` without a PK, else ``UserMode``) and the
``ResetKeys`` action. ``SecureBoot/SecureBootDatabases/{PK,KEK,db,dbx}/Certificates``: the
certificates enrolled in each UEFI variable; a client POSTs a PEM certificate (201 with its
``Location``) or DELETEs one. Changes take effect at the machine's next reset through this BMC,
as real firmware reads its variables as it starts.

A machine built with Secure Boot (``Lab(secure_boot=True)``) gets this state written into its
OVMF variable store at that reset (``vmlab.secureboot_fw``: QEMU reads its pflash once, at
start, so the BMC restarts it on the new variables); on other UEFI machines only the state is
kept. The lab's default PK and KEK are one self-signed "vendor"
certificate made when the BMC starts; ``db`` and ``dbx`` start empty. Only UEFI machines have
these resources; a legacy-BIOS machine's BMC answers 404.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from . import redfish_json

DATABASES = ("PK", "KEK", "db", "dbx")
RESET_KEYS = ["ResetAllKeysToDefault", "DeleteAllKeys", "DeletePK"]
#: A hostile or careless client cannot grow the BMC's memory without bound.
MAX_CERTS_PER_DB = 64


@dataclass
class Cert:
    id: str
    pem: str
    subject: str
    issuer: str
    not_before: str
    not_after: str
    serial: str
    fingerprint: str


@dataclass
class SecureBootState:
    defaults: dict[str, list[Cert]]
    #: SecureBootEnable as last written; the firmware acts on it at its next start.
    enable: bool = False
    #: What the firmware did at its last start.
    current_boot: bool = False
    dbs: dict[str, list[Cert]] = field(default_factory=dict)
    next_id: int = 1

    def __post_init__(self) -> None:
        if not self.dbs:
            self.reset_keys("ResetAllKeysToDefault")

    @property
    def mode(self) -> str:
        return "UserMode" if self.dbs["PK"] else "SetupMode"

    def reset_keys(self, how: str) -> None:
        if how == "ResetAllKeysToDefault":
            self.dbs = {d: list(self.defaults.get(d, [])) for d in DATABASES}
        elif how == "DeleteAllKeys":
            self.dbs = {d: [] for d in DATABASES}
        elif how == "DeletePK":
            self.dbs["PK"] = []

    def reboot(self) -> None:
        """The firmware starts: Secure Boot is in force only when enabled and a PK is set."""
        self.current_boot = self.enable and self.mode != "SetupMode"

    def add(self, db: str, pem: str) -> Cert:
        cert = parse(pem, str(self.next_id))
        self.next_id += 1
        self.dbs[db].append(cert)
        return cert


def parse(pem: str, cert_id: str) -> Cert:
    """A certificate from its PEM (ValueError when it is not one X.509 certificate)."""
    c = x509.load_pem_x509_certificate(pem.encode())
    der = c.public_bytes(serialization.Encoding.DER)
    return Cert(
        id=cert_id,
        pem=c.public_bytes(serialization.Encoding.PEM).decode(),
        subject=c.subject.rfc4514_string(),
        issuer=c.issuer.rfc4514_string(),
        not_before=c.not_valid_before_utc.isoformat().replace("+00:00", "Z"),
        not_after=c.not_valid_after_utc.isoformat().replace("+00:00", "Z"),
        serial=format(c.serial_number, "x"),
        fingerprint=hashlib.sha256(der).hexdigest().upper(),
    )


def vendor_cert(common_name: str = "vm-lab platform key") -> str:
    """A self-signed certificate (EC P-256: quick to make) standing for the vendor's PK/KEK."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


SECURE_BOOT = web.AppKey("secure_boot", SecureBootState)
#: Set on a Secure Boot machine's BMC: brings its firmware's variables in step with the state
#: before a power-on (``vmlab.secureboot_fw.FirmwareVars.apply``).
APPLY = web.AppKey("secure_boot_apply", Callable[[SecureBootState], Awaitable[bool]])


_json = redfish_json.json_response
_error = redfish_json.error


class _Missing(web.HTTPNotFound):
    """A 404 with a Redfish error body."""

    def __init__(self, what: str) -> None:
        body = redfish_json.error(404, "ResourceMissingAtURI", f"no {what}")
        super().__init__(text=body.text, content_type="application/json")


def _sb_path(request: web.Request) -> str:
    return f"/redfish/v1/Systems/{request.match_info['system_id']}/SecureBoot"


def _db(request: web.Request) -> str:
    db = request.match_info["db_id"]
    if db not in DATABASES:
        raise _Missing(f"Secure Boot database {db}")
    return db


async def _body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def get_secure_boot(request: web.Request) -> web.Response:
    state, path = request.app[SECURE_BOOT], _sb_path(request)
    return _json(
        {
            "@odata.type": "#SecureBoot.v1_1_0.SecureBoot",
            "@odata.id": path,
            "Id": "SecureBoot",
            "Name": "UEFI Secure Boot",
            "SecureBootEnable": state.enable,
            "SecureBootCurrentBoot": "Enabled" if state.current_boot else "Disabled",
            "SecureBootMode": state.mode,
            "SecureBootDatabases": {"@odata.id": f"{path}/SecureBootDatabases"},
            "Actions": {
                "#SecureBoot.ResetKeys": {
                    "target": f"{path}/Actions/SecureBoot.ResetKeys",
                    "ResetKeysType@Redfish.AllowableValues": RESET_KEYS,
                }
            },
        }
    )


async def patch_secure_boot(request: web.Request) -> web.Response:
    body = await _body(request)
    if body is None:
        return _error(400, "MalformedJSON", "the request body is not a JSON object")
    if set(body) != {"SecureBootEnable"} or not isinstance(body["SecureBootEnable"], bool):
        return _error(400, "PropertyNotWritable", "only SecureBootEnable (a boolean) is writable")
    request.app[SECURE_BOOT].enable = body["SecureBootEnable"]
    return await get_secure_boot(request)


async def reset_keys(request: web.Request) -> web.Response:
    body = await _body(request)
    how = (body or {}).get("ResetKeysType")
    if how not in RESET_KEYS:
        return _error(
            400, "ActionParameterValueNotInList", f"ResetKeysType {how!r} not one of {RESET_KEYS}"
        )
    request.app[SECURE_BOOT].reset_keys(how)
    return web.Response(status=204, headers={"OData-Version": "4.0"})


async def get_databases(request: web.Request) -> web.Response:
    path = f"{_sb_path(request)}/SecureBootDatabases"
    return _json(
        {
            "@odata.type": "#SecureBootDatabaseCollection.SecureBootDatabaseCollection",
            "@odata.id": path,
            "Name": "UEFI Secure Boot Database Collection",
            "Members@odata.count": len(DATABASES),
            "Members": [{"@odata.id": f"{path}/{d}"} for d in DATABASES],
        }
    )


async def get_database(request: web.Request) -> web.Response:
    db = _db(request)
    path = f"{_sb_path(request)}/SecureBootDatabases/{db}"
    return _json(
        {
            "@odata.type": "#SecureBootDatabase.v1_0_0.SecureBootDatabase",
            "@odata.id": path,
            "Id": db,
            "Name": f"{db} database",
            "DatabaseId": db,
            "Certificates": {"@odata.id": f"{path}/Certificates"},
        }
    )


def _certs_path(request: web.Request) -> str:
    return f"{_sb_path(request)}/SecureBootDatabases/{_db(request)}/Certificates"


async def get_certificates(request: web.Request) -> web.Response:
    path, certs = _certs_path(request), request.app[SECURE_BOOT].dbs[_db(request)]
    return _json(
        {
            "@odata.type": "#CertificateCollection.CertificateCollection",
            "@odata.id": path,
            "Name": "Certificate Collection",
            "Members@odata.count": len(certs),
            "Members": [{"@odata.id": f"{path}/{c.id}"} for c in certs],
        }
    )


def _cert_body(path: str, c: Cert) -> dict[str, Any]:
    return {
        "@odata.type": "#Certificate.v1_3_0.Certificate",
        "@odata.id": f"{path}/{c.id}",
        "Id": c.id,
        "Name": c.subject[:64],
        "CertificateString": c.pem,
        "CertificateType": "PEM",
        "Subject": {"CommonName": _cn(c.subject)},
        "Issuer": {"CommonName": _cn(c.issuer)},
        "ValidNotBefore": c.not_before,
        "ValidNotAfter": c.not_after,
        "SerialNumber": _colons(c.serial),
        "Fingerprint": _colons(c.fingerprint),
        "FingerprintHashAlgorithm": "TPM_ALG_SHA256",
    }


def _colons(hexed: str) -> str:
    """Hex as the schema spells it: byte pairs joined by colons."""
    hexed = hexed.upper() if len(hexed) % 2 == 0 else "0" + hexed.upper()
    return ":".join(hexed[i : i + 2] for i in range(0, len(hexed), 2))


def _cn(rfc4514: str) -> str:
    for part in rfc4514.split(","):
        if part.startswith("CN="):
            return part[3:]
    return rfc4514[:64]


def _find(request: web.Request) -> Cert:
    for c in request.app[SECURE_BOOT].dbs[_db(request)]:
        if c.id == request.match_info["cert_id"]:
            return c
    raise _Missing("such certificate")


async def get_certificate(request: web.Request) -> web.Response:
    return _json(_cert_body(_certs_path(request), _find(request)))


async def post_certificate(request: web.Request) -> web.Response:
    state, db = request.app[SECURE_BOOT], _db(request)
    body = await _body(request)
    if body is None:
        return _error(400, "MalformedJSON", "the request body is not a JSON object")
    pem, kind = body.get("CertificateString"), body.get("CertificateType", "PEM")
    if not isinstance(pem, str) or kind != "PEM":
        return _error(400, "PropertyMissing", "POST CertificateString (PEM), CertificateType PEM")
    if len(state.dbs[db]) >= MAX_CERTS_PER_DB:
        return _error(400, "CreateLimitReachedForResource", f"{db} is full")
    try:
        cert = state.add(db, pem)
    except ValueError as e:
        return _error(400, "PropertyValueFormatError", f"not a PEM X.509 certificate: {e}")
    path = _certs_path(request)
    return _json(_cert_body(path, cert), 201, {"Location": f"{path}/{cert.id}"})


async def delete_certificate(request: web.Request) -> web.Response:
    cert = _find(request)
    request.app[SECURE_BOOT].dbs[_db(request)].remove(cert)
    return web.Response(status=204, headers={"OData-Version": "4.0"})


def install(app: web.Application, system: str, firmware: str) -> SecureBootState | None:
    """Add the Secure Boot resources under ``system`` (a route pattern) of a UEFI machine."""
    if firmware != "uefi":
        return None
    vendor = parse(vendor_cert(), "1")
    state = SecureBootState(defaults={"PK": [vendor], "KEK": [vendor]}, next_id=2)
    app[SECURE_BOOT] = state
    sb = system + "/SecureBoot"
    app.router.add_get(sb, get_secure_boot)
    app.router.add_patch(sb, patch_secure_boot)
    app.router.add_post(sb + "/Actions/SecureBoot.ResetKeys", reset_keys)
    app.router.add_get(sb + "/SecureBootDatabases", get_databases)
    app.router.add_get(sb + "/SecureBootDatabases/{db_id}", get_database)
    certs = sb + "/SecureBootDatabases/{db_id}/Certificates"
    app.router.add_get(certs, get_certificates)
    app.router.add_post(certs, post_certificate)
    app.router.add_get(certs + "/{cert_id}", get_certificate)
    app.router.add_delete(certs + "/{cert_id}", delete_certificate)
    return state
