"""Carrying a request to the instance of the fleet that owns what it acts on, and its answer
back: the transport under the router's one owner mechanism (``api.routing.Owner``).

A request goes to the owner's API URL on the same method and path, with the caller's own
credential (the owner authorizes it again) and a mark signed with a key only instances hold
(``metald.fleet.forward_auth``); the owner runs it where it lands and never forwards it again.
A plain request's answer comes back as it is (an error as the same problem); a WebSocket is
carried frame by frame, both ways, until either side closes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from metald.errors import MetaldError

#: How long a forwarded command may take at the owner (retries of a slow BMC included).
FORWARD_TIMEOUT_S = 120.0
#: The fields of a problem+json answer; what else it carries travels with the error.
PROBLEM_FIELDS = frozenset({"type", "title", "status", "detail", "instance"})


class ForwardFailed(MetaldError):
    status = 502
    title = "BMC owner unreachable"


async def forward(
    raw: web.Request,
    owner_url: str,
    headers: dict[str, str],
    body: Any,
) -> tuple[int, Any]:
    """Send ``raw``'s method and path (with its query) to the instance at ``owner_url`` with
    ``headers`` and the JSON ``body``; its answer's status and JSON. An error answer is raised
    as the same problem (status, title, detail and its other fields); no answer is a 502
    (``ForwardFailed``) saying what to do."""
    target = owner_url.rstrip("/") + raw.path_qs
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S)) as http,
            http.request(raw.method, target, json=body, headers=headers) as r,
        ):
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise _unreachable("this BMC", owner_url, e) from None
    if r.status >= 400:
        problem = data if isinstance(data, dict) else {}
        err = MetaldError(str(problem.get("detail") or "the BMC's owner refused the request"))
        err.status, err.title = r.status, str(problem.get("title") or "Error")
        err.extra = {k: v for k, v in problem.items() if k not in PROBLEM_FIELDS}
        raise err
    return r.status, data


async def proxy_websocket(
    raw: web.Request,
    owner_url: str,
    headers: dict[str, str],
    max_msg_size: int,
) -> web.WebSocketResponse:
    """Carry the WebSocket ``raw`` opens to the same path at the instance at ``owner_url``,
    frames as they are, both ways. A refused handshake there is the same refusal here; no
    answer is a 502 (``ForwardFailed``)."""
    target = owner_url.rstrip("/") + raw.path_qs
    http = aiohttp.ClientSession()
    try:
        try:
            upstream = await http.ws_connect(target, headers=headers, heartbeat=30.0)
        except aiohttp.WSServerHandshakeError as e:
            raise _owner_refusal(e, owner_url) from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _unreachable("this machine's BMC", owner_url, e) from None
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=max_msg_size)
        await ws.prepare(raw)

        async def down() -> None:
            async for m in upstream:
                if m.type == WSMsgType.BINARY:
                    await ws.send_bytes(m.data)
                elif m.type == WSMsgType.TEXT:
                    await ws.send_str(m.data)

        async def up() -> None:
            async for m in ws:
                if m.type == WSMsgType.BINARY:
                    await upstream.send_bytes(m.data)
                elif m.type == WSMsgType.TEXT:
                    await upstream.send_str(m.data)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(down()), loop.create_task(up())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await upstream.close()
        await ws.close()
        return ws
    finally:
        await http.close()


def _unreachable(what: str, owner_url: str, e: BaseException) -> ForwardFailed:
    return ForwardFailed(
        f"{what} is owned by the instance at {owner_url}, which did not answer "
        f"({type(e).__name__}); retry, or check that instance",
        owner_url=owner_url,
    )


def _owner_refusal(e: aiohttp.WSServerHandshakeError, owner_url: str) -> MetaldError:
    err = MetaldError(
        f"the instance that owns this machine's BMC ({owner_url}) refused the console "
        f"with HTTP {e.status}; run the same request there to read its reason"
    )
    err.status, err.title = e.status or 502, "Refused by the BMC's owner"
    return err
