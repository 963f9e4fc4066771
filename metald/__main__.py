"""``metald`` (also ``python -m metald``): run the daemon, and offline administration against
the store. metalctl, the HTTP client, is ``metald.metalctl``."""

from __future__ import annotations

import argparse
import logging
import sys

from metald import __version__
from metald.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="metald", description="Bare-metal provisioning daemon")
    ap.add_argument("--version", action="version", version=f"metald {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_serve = sub.add_parser("serve", help="run the daemon")
    p_check = sub.add_parser("check-config", help="validate a config file and exit")
    p_check.add_argument(
        "--config", "-c", required=True, help="TOML config file (env METALD_* overrides apply)"
    )
    p_mig = sub.add_parser("migrate", help="upgrade the database schema and exit")
    p_tok = sub.add_parser("create-token", help="mint a token directly in the store (recovery)")
    p_tok.add_argument("--name", required=True)
    p_tok.add_argument(
        "--role", required=True, choices=["admin", "technician", "orchestrator", "agent"]
    )
    p_tok.add_argument("--scope", action="append", default=[])
    p_ca = sub.add_parser(
        "boot-ca",
        help="make metald's boot CA in the state folder (as [boot] tls_auto would) and print "
        "its path: build metald's iPXE with it before the first start",
    )
    sub.add_parser(
        "config-schema", help="print the config file's JSON Schema (for editors) and exit"
    )
    for p in (p_serve, p_mig, p_tok, p_ca):
        p.add_argument("--config", "-c", help="TOML config file (env METALD_* overrides apply)")
    args = ap.parse_args(argv)

    if args.cmd == "config-schema":
        import json

        from metald.config import Config
        from metald.config_docs import describe_schema, descriptions, examples_path

        schema = Config.model_json_schema()
        example = examples_path()  # every key's comment there is its description here
        if example is not None:
            describe_schema(schema, descriptions(example.read_text()))
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = "metald configuration (metald.toml)"
        print(json.dumps(schema, indent=2, sort_keys=True))
        return 0

    warnings: list[str] = []
    try:
        cfg = load_config(args.config, warnings=warnings)
    except ConfigError as e:
        print(f"metald: {e}", file=sys.stderr)
        return 2

    from metald.logs import setup_logging
    from metald.store.db import store_unavailable

    setup_logging(cfg.log.level, cfg.log.format, is_outage=store_unavailable)
    for line in warnings:
        logging.getLogger("metald.config").warning("%s", line)
    if args.cmd == "check-config":
        print("config ok")
        return 0
    if args.cmd == "boot-ca":
        from pathlib import Path

        from metald.boot.pki import CA_CERT, PkiError, ensure_ca

        try:
            ensure_ca(Path(cfg.state_dir))
        except (PkiError, OSError) as e:
            print(f"metald: {e}", file=sys.stderr)
            return 2
        print(Path(cfg.state_dir) / CA_CERT)
        return 0
    if args.cmd == "migrate":
        from metald.store import Store

        Store(cfg.store_url).migrate()
        print("schema is up to date")
        return 0
    if args.cmd == "create-token":
        from metald.auth import issue_token
        from metald.errors import MetaldError
        from metald.store import Store

        store = Store(cfg.store_url)
        store.migrate()
        with store.session() as s:
            try:
                _row, secret = issue_token(
                    s, name=args.name, role=args.role, scope=args.scope, created_by="metald-cli"
                )
            except MetaldError as e:
                print(f"metald: {e}", file=sys.stderr)
                return 2
        print(secret)
        return 0

    import os

    from metald.boot import eventloop
    from metald.daemon import Daemon
    from metald.secrets import SecretError

    # Nothing the daemon writes (database, WAL, keys, hub and control-plane state) is for
    # other users of the host.
    os.umask(0o077)
    try:
        daemon = Daemon(cfg)
    except (SecretError, ConfigError) as e:
        print(f"metald: {e}", file=sys.stderr)
        return 2
    from metald.fleet.registry import InstanceNameInUse
    from metald.fleet.startup import StartupRefused

    try:
        eventloop.run(daemon.run_forever(), cfg.event_loop)
    except (StartupRefused, InstanceNameInUse, SecretError) as e:
        print(f"metald: cannot start: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"metald: cannot start: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
