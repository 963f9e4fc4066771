"""``metalctl bmcs import rack.csv``: the pure part. Reads a CSV of BMCs for a new rack
(``address,protocol,username,password-env,machine``; ``port`` and ``insecure`` optional),
checks every row, and says what is wrong with each bad one by its line number. Passwords
come from the environment variable a row names, never from the file: a ``password`` column is
refused outright, so a file with secrets in it does not get used (or copied around) as one.

The file is input from someone else (a rack vendor, a colleague), so it may not pick which of
the operator's variables are read and sent to its address: a row may name only a variable
starting with ``METALD_BMC_PASSWORD_`` or one the operator allowed on the command line
(``--allow-env NAME``), and never another ``METALD_*`` one (``METALD_TOKEN`` is the operator's
API token; see ``password_env_refusal``)."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

REQUIRED = ("address", "username", "password-env")
OPTIONAL = ("protocol", "machine", "port", "insecure")
PROTOCOLS = ("auto", "ipmi", "redfish")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: The variables a CSV row may name without the operator allowing each on the command line.
PASSWORD_PREFIX = "METALD_BMC_PASSWORD_"
#: metalctl's and metald's own settings and secrets (METALD_TOKEN): never read as a password.
_RESERVED_PREFIX = "METALD_"


def password_env_refusal(name: str, allowed: Collection[str] | None = None) -> str | None:
    """Why the BMC password may not be read from ``$name`` (None: it may).

    Never a ``METALD_*`` variable other than ``METALD_BMC_PASSWORD_<NAME>``: those hold the
    operator's token and settings, and the value read is sent to the BMC's address. With
    ``allowed`` (a CSV import) the name must also start with that prefix or be in ``allowed``,
    the names the operator gave on the command line; without it (``bmcs register
    --password-env``) the operator typed the name, so only the first rule applies."""
    if name.upper().startswith(_RESERVED_PREFIX) and not (
        name.startswith(PASSWORD_PREFIX) and len(name) > len(PASSWORD_PREFIX)
    ):
        return (
            f"${name} is not read as a BMC password: METALD_* variables hold metalctl's own "
            f"settings and secrets (METALD_TOKEN), and the password is sent to the BMC's "
            f"address; put the password in {PASSWORD_PREFIX}<NAME> or another variable"
        )
    if allowed is not None and not name.startswith(PASSWORD_PREFIX) and name not in allowed:
        return (
            f"password-env {name} is not allowed: a CSV row may name only a variable starting "
            f"with {PASSWORD_PREFIX} or one allowed on the command line (--allow-env {name})"
        )
    return None


_TRUE = {"true", "yes", "1"}
_FALSE = {"", "false", "no", "0"}
#: Rows one file may hold (a rack is tens; this bounds a mistaken file, not a real one).
MAX_ROWS = 2000


@dataclass
class Row:
    line: int
    address: str
    username: str
    password_env: str
    protocol: str = "auto"
    port: int | None = None
    machine: str | None = None
    verify_tls: bool = True

    def body(self, password: str, machine_id: str | None) -> dict[str, Any]:
        """The POST /api/v1/bmcs body (the password only here, only in memory)."""
        out: dict[str, Any] = {
            "address": self.address,
            "protocol": self.protocol,
            "username": self.username,
            "password": password,
            "verify_tls": self.verify_tls,
        }
        if self.port is not None:
            out["port"] = self.port
        if machine_id is not None:
            out["machine_id"] = machine_id
        return out


@dataclass
class Parsed:
    rows: list[Row] = field(default_factory=list)
    #: (line, what is wrong and what to do), in line order.
    errors: list[tuple[int, str]] = field(default_factory=list)


def parse(text: str, environ: Mapping[str, str], allowed_env: Collection[str] = ()) -> Parsed:
    """Every row checked on its own (fields, the named password variable allowed and set) and
    against the others (an address or a machine twice); bad rows are in ``errors``, good ones in
    ``rows``. ``allowed_env``: variables the operator allowed besides ``METALD_BMC_PASSWORD_*``."""
    out = Parsed()
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    seen_address: dict[tuple[str, int | None], int] = {}
    seen_machine: dict[str, int] = {}
    for record in reader:
        line = reader.line_num
        if not any(c.strip() for c in record) or record[0].lstrip().startswith("#"):
            continue  # blank lines and comments
        if header is None:
            header = [c.strip().lower().replace("_", "-") for c in record]
            problems = _check_header(header)
            if problems:
                out.errors.append((line, problems))
                return out
            continue
        if len(out.rows) + len(out.errors) >= MAX_ROWS:
            out.errors.append((line, f"more than {MAX_ROWS} rows; split the file"))
            return out
        if len(record) != len(header):
            out.errors.append(
                (
                    line,
                    f"{len(record)} fields where the header has {len(header)}; quote a "
                    "field that holds a comma",
                )
            )
            continue
        values = {h: v.strip() for h, v in zip(header, record, strict=True)}
        row, wrong = _row(line, values, environ, allowed_env)
        if row is not None:
            key = (row.address.lower(), row.port)
            if key in seen_address:
                wrong.append(f"address {row.address} is already on line {seen_address[key]}")
            else:
                seen_address[key] = line
            if row.machine:
                if row.machine in seen_machine:
                    wrong.append(
                        f"machine {row.machine} is already on line {seen_machine[row.machine]}"
                    )
                else:
                    seen_machine[row.machine] = line
        if wrong:
            out.errors.append((line, "; ".join(wrong)))
        elif row is not None:
            out.rows.append(row)
    if header is None:
        out.errors.append(
            (
                1,
                "the file is empty; the first line names the columns: "
                + ",".join(REQUIRED + OPTIONAL),
            )
        )
    return out


def _check_header(header: list[str]) -> str | None:
    if "password" in header:
        return (
            "a password column: passwords are never read from the file; put each in an "
            "environment variable and name it in a password-env column"
        )
    unknown = [h for h in header if h not in REQUIRED + OPTIONAL]
    missing = [h for h in REQUIRED if h not in header]
    dup = sorted({h for h in header if header.count(h) > 1})
    parts = []
    if missing:
        parts.append(f"missing column(s) {', '.join(missing)}")
    if unknown:
        parts.append(f"unknown column(s) {', '.join(unknown)}")
    if dup:
        parts.append(f"column(s) {', '.join(dup)} twice")
    if parts:
        return "; ".join(parts) + f" (columns: {','.join(REQUIRED + OPTIONAL)})"
    return None


def _row(
    line: int, v: dict[str, str], environ: Mapping[str, str], allowed_env: Collection[str]
) -> tuple[Row | None, list[str]]:
    wrong: list[str] = []
    address, username, env = v["address"], v["username"], v["password-env"]
    if not address:
        wrong.append("address is empty")
    elif len(address) > 255 or any(c.isspace() for c in address):
        wrong.append(f"address {address[:40]!r} is not a host name, IP or URL")
    if not username:
        wrong.append("username is empty")
    elif len(username) > 64:
        wrong.append("username is longer than 64 characters")
    if not _ENV_NAME.fullmatch(env):
        wrong.append(
            f"password-env {env[:40]!r} is not an environment variable name (e.g. RACK07_BMC_PW)"
        )
    elif refusal := password_env_refusal(env, allowed_env):
        wrong.append(refusal)
    elif not environ.get(env):
        wrong.append(f"${env} is not set (or empty): export it with the BMC's password")
    protocol = (v.get("protocol") or "auto").lower()
    if protocol not in PROTOCOLS:
        wrong.append(f"protocol {protocol[:20]!r}: one of {', '.join(PROTOCOLS)}")
    port: int | None = None
    if v.get("port"):
        if not v["port"].isdigit() or not 1 <= int(v["port"]) <= 65535:
            wrong.append(f"port {v['port'][:10]!r} is not a number from 1 to 65535")
        else:
            port = int(v["port"])
    insecure = (v.get("insecure") or "").lower()
    if insecure not in _TRUE | _FALSE:
        wrong.append(f"insecure {insecure[:10]!r}: true or false")
    if wrong:
        return None, wrong
    return (
        Row(
            line=line,
            address=address,
            username=username,
            password_env=env,
            protocol=protocol,
            port=port,
            machine=v.get("machine") or None,
            verify_tls=insecure not in _TRUE,
        ),
        [],
    )
