"""``vm-lab up|down|status``: the command line over vmlab.lab."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from . import netns, plan
from .lab import Lab, LabError, default_home, down_all, list_labs, read_state
from .power import hung_marker
from .qmp import QmpClient, QmpError


def _up(args: argparse.Namespace) -> int:
    lab = Lab(args.name, machines=args.machines, uefi=args.uefi, workdir=args.home,
              memory_mb=args.memory, cpus=args.cpus, nics=args.nics, disks=args.disks)  # fmt: skip
    if not args.foreground:
        _print_lab(lab.up(), power=False)
        return 0
    # Stay until Ctrl-C or SIGTERM, then take the lab down (kill -9 leaves it for `down`). The
    # handler is in place before the lab comes up: a SIGTERM as soon as its state says "up"
    # (or earlier) still takes it down instead of killing this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        _print_lab(lab.up(), power=False)
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        lab.down(keep_logs=args.keep_logs)
    return 0


def _down(args: argparse.Namespace) -> int:
    if args.all:
        names = down_all(args.home)
        print("removed: " + (", ".join(names) if names else "(no labs)"))
        return 0
    Lab(args.name, workdir=args.home).down(keep_logs=args.keep_logs)
    print(f"removed: {args.name}")
    return 0


def _status(args: argparse.Namespace) -> int:
    home = args.home or default_home()
    labs = []
    for name in list_labs(home):
        state_path = home / name / "state.json"
        if state_path.exists():
            state = read_state(state_path)
        else:
            state = {"name": name, "status": "orphan namespace (run down)", "machines": []}
        state["namespace_present"] = netns.exists(plan.netns_name(name))
        labs.append(state)
    if args.json:
        print(json.dumps(labs, indent=2))
        return 0
    if not labs:
        print("no labs")
    for state in labs:
        _print_lab(state, power=True)
    return 0


def _power(qmp_path: str) -> str:
    async def query() -> str:
        qmp = QmpClient(qmp_path)
        try:
            # QEMU serves one client per QMP socket: if a tool holds it, do not wait long.
            await qmp.connect(timeout=2.0)
            status = await qmp.execute("query-status", timeout=2.0)
        except (OSError, QmpError, TimeoutError):
            return "?"
        finally:
            await qmp.close()
        if status["status"] == "running":
            return "on"
        return "hung" if hung_marker(qmp_path).exists() else "off"  # vmlab.faults.pause

    return asyncio.run(query())


def _print_lab(state: dict[str, Any], power: bool) -> None:
    print(f"lab {state['name']}: {state.get('status', '?')}")
    if "netns" in state:
        print(f"  namespace {state['netns']}, bridge {state['bridge']}, subnet {state['subnet']}")
        print(f"  boot server address {state['boot_address']}, DHCP range "
              f"{state['dhcp_range'][0]}-{state['dhcp_range'][1]}, accel {state['accel']}")  # fmt: skip
        print(f"  run inside: nsenter --net=/run/netns/{state['netns']} -- COMMAND")
    for m in state.get("machines", []):
        bmc = m["bmc"]
        line = (
            f"  {m['name']:4} {m['firmware']:4} {m['mac']}  BMC {bmc['address']} "
            f"ipmi:{bmc['ipmi_port']} {bmc['redfish_url']} "
            f"user {bmc['username']}  serial {m['serial_log']}"
        )
        if power:
            line += f"  power {_power(m['qmp'])}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vm-lab", description="virtual racks for metald")
    parser.add_argument("--home", type=Path, default=None,
                        help="where labs keep their files (default $VMLAB_HOME or .cache/vm-lab)")  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="build a lab")
    up.add_argument("--machines", type=int, default=2)
    up.add_argument("--name", default="lab")
    up.add_argument("--uefi", type=int, default=None, help="how many boot UEFI (default half)")
    up.add_argument("--memory", type=int, default=1024, help="MiB per machine")
    up.add_argument("--nics", type=int, default=1, help="NICs per machine (2+: a data network)")
    up.add_argument("--disks", type=int, default=1, help="disks per machine")
    up.add_argument("--cpus", type=int, default=2)
    up.add_argument("--foreground", action="store_true", help="stay; Ctrl-C takes the lab down")
    up.add_argument("--keep-logs", action="store_true", help="with --foreground: keep *.log")
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="remove a lab, or all of them")
    which = down.add_mutually_exclusive_group()
    which.add_argument("--name", default="lab")
    which.add_argument("--all", action="store_true", help="every lab and stale lab namespace")
    down.add_argument("--keep-logs", action="store_true", help="keep the lab's *.log files")
    down.set_defaults(func=_down)

    status = sub.add_parser("status", help="list labs, machines, BMCs and power")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=_status)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (LabError, plan.PlanError) as exc:
        print(f"vm-lab: {exc}", file=sys.stderr)
        return 1
