"""Run the boot plane on its own: ``python -m metald.boot --config metald.toml``.

DHCP, TFTP and RA from the config, plus HTTP boot on ``api.listen``, over the store the config
names (migrated on start), with ``StoreBootHooks``. The daemon hosts the same parts; this entry
point is what the tests and benchmarks start inside network namespaces. Prints ``READY`` once
every socket is bound; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import ssl
import sys
from pathlib import Path

from aiohttp import web

from metald.boot import eventloop
from metald.boot.http import boot_routes
from metald.boot.machine_hooks import StoreBootHooks
from metald.boot.plane import BootPlane, http_base_url
from metald.config import Config, load_config, split_hostport
from metald.store.db import Store

log = logging.getLogger(__name__)


async def run(cfg: Config, *, access_log: bool = True) -> None:
    store = Store(cfg.store_url)
    store.migrate()
    hooks = StoreBootHooks(store, cfg.instance)
    plane = BootPlane(cfg, store, hooks)
    app = web.Application()
    if cfg.boot.assets_dir:
        app.add_routes(boot_routes(hooks, Path(cfg.boot.assets_dir), http_base_url(cfg)))
    # The daemon's listeners keep no access log; this entry point keeps one (at info) for the
    # labs' logs unless told not to, as the HTTP benches do (their nginx runs access_log off).
    access = logging.getLogger("metald.boot.http.access") if access_log else None
    runner = web.AppRunner(app, access_log=access)
    await runner.setup()
    host, port = split_hostport(cfg.api.listen)
    tls = None
    if cfg.api.tls_cert:  # as the daemon's staff listener: HTTPS with the given certificate
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.minimum_version = ssl.TLSVersion.TLSv1_2
        tls.load_cert_chain(cfg.api.tls_cert, cfg.api.tls_key)
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await plane.start()
    await site.start()
    print("READY", flush=True)
    log.info("event loop: %s", type(loop).__module__)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await plane.stop()
        store.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metald.boot")
    ap.add_argument("--config", required=True)
    ap.add_argument("--log-level", default="warning")
    ap.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log each HTTP request at info (default on; the daemon's listeners keep none)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    cfg = load_config(args.config)
    eventloop.run(run(cfg, access_log=args.access_log), cfg.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
