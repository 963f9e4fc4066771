"""The lab Redfish BMC's answers, shared by its services (updates, tasks, sessions, accounts):
OData headers, DMTF error bodies and member collections, written once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web

ODATA = {"OData-Version": "4.0"}


def json_response(
    body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(body, status=status, headers={**ODATA, **(headers or {})})


def error(status: int, message_id: str, message: str) -> web.Response:
    """A Redfish error body (``Base.1.8.<MessageId>``, with its extended info)."""
    return json_response(
        {
            "error": {
                "code": f"Base.1.8.{message_id}",
                "message": message,
                "@Message.ExtendedInfo": [
                    {
                        "@odata.type": "#Message.v1_1_1.Message",
                        "MessageId": f"Base.1.8.{message_id}",
                        "Message": message,
                        "Severity": "Warning",
                    }
                ],
            }
        },
        status,
    )


def collection(odata_type: str, odata_id: str, name: str, ids: Iterable[str]) -> web.Response:
    """A resource collection whose members live at ``<odata_id>/<id>``."""
    members = [{"@odata.id": f"{odata_id}/{i}"} for i in ids]
    return json_response(
        {
            "@odata.type": odata_type,
            "@odata.id": odata_id,
            "Name": name,
            "Members@odata.count": len(members),
            "Members": members,
        }
    )
