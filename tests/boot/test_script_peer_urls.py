"""An agent script names the other live instances serving the network (``metald.urls=``), so
the agent outlives the instance that served it; the URLs come from the instances table."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from metald.boot.hooks import peer_urls
from metald.boot.http import boot_routes
from metald.boot.machine_hooks import StoreBootHooks
from metald.fleet.registry import Member

OWN = "http://10.0.0.1:8080"
NET = "10.0.0.0/24"


def member(name: str, url: str | None, nets: list[str] | None = None) -> Member:
    serves = {"boot_url": url, "provisioning_networks": [NET] if nets is None else nets}
    return Member(name=name, alive=True, heartbeat_age_s=0.5, version="x", serves=serves)


class Fleet:
    """What the hooks read of ``Membership``: this instance's serves and the live members."""

    def __init__(self, members: list[Member]) -> None:
        self.serves = {"boot_url": OWN, "provisioning_networks": [NET]}
        self.members = members

    def live(self) -> list[Member]:
        return self.members


def test_peer_urls_keeps_only_reachable_well_formed_others() -> None:
    members = [
        member("a", OWN),  # this instance's own URL (a shared fleet address too): not again
        member("b", "http://10.0.0.2:8080/"),
        member("c", "http://10.0.0.3:8080", ["10.9.0.0/24"]),  # another network
        member("d", "http://10.0.0.4:8080 metald.token=x"),  # would split the command line
        member("e", None),  # serves no boot plane
        member("f", "http://10.0.0.2:8080"),  # the same address twice
        member("g", "https://[fd00::5]:8443/metald"),
    ]
    assert peer_urls(OWN, members, [NET]) == [
        "http://10.0.0.2:8080",
        "https://[fd00::5]:8443/metald",
    ]


async def test_agent_script_carries_the_other_instances(
    aiohttp_client, store, assets: Path
) -> None:  # type: ignore[no-untyped-def]
    hooks = StoreBootHooks(store, "a", mint_agent_token=lambda s, m, mac, client: "agent-secret")
    hooks.fleet = Fleet([member("a", OWN), member("b", "http://10.0.0.2:8080")])
    await hooks.client_seen("52:54:00:00:00:01", arch="bios", network="prov", relay_agent=None)
    app = web.Application()
    app.add_routes(boot_routes(hooks, assets, OWN))
    c = await aiohttp_client(app)
    body = await (await c.get("/boot/52:54:00:00:00:01.ipxe")).text()
    assert f"metald.url={OWN} " in body
    assert "metald.token=agent-secret metald.urls=http://10.0.0.2:8080 " in body
    # without a token (nothing armed) there is no agent to guide: no list either
    hooks.mint_agent_token = lambda s, m, mac, client: None
    body = await (await c.get("/boot/52:54:00:00:00:01.ipxe")).text()
    assert "metald.urls" not in body and "metald.token" not in body
